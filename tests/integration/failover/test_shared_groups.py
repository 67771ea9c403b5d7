"""The storage side of "no orphans after a TaskManager dies mid-upload", on real local storage.

Shared files live in ``shared/chk-<n>/``, the checkpoint that first uploaded them. The
JobManager deletes an aborted checkpoint's group at once and again when later checkpoints
complete (a dead TaskManager's last request bodies may land after the first deletion), and
``statectl checkpoint gc`` can tell which unreferenced shared files a checkpoint in progress
may still claim: only those of its own group.
"""

from __future__ import annotations

from pathlib import Path

from keyedstate.common.config import Configuration
from keyedstate.common.descriptors import StateDescriptor, StateKind
from keyedstate.common.ids import KeyGroupRange
from keyedstate.common.storage import CheckpointStorage, open_storage
from keyedstate.jobmanager.checkpoint import CheckpointMetadata, plan_gc
from keyedstate.jobmanager.checkpoint.cleaner import REVISITS, CheckpointsCleaner, InlineExecutor
from keyedstate.jobmanager.checkpoint.metadata import FileRef, OperatorSnapshot, SubtaskSnapshot
from tests.integration.failover._support import relative_files


def _storage(tmp_path: Path) -> tuple[CheckpointStorage, str]:
    job_dir = (tmp_path / "checkpoints" / "job").as_uri()
    return open_storage(job_dir, Configuration({})), job_dir


def _complete(storage: CheckpointStorage, job_dir: str, checkpoint_id: int, shared: list[str]) -> CheckpointMetadata:
    """Write a completed checkpoint referencing ``shared`` files (paths below ``shared/``)."""
    files = tuple(FileRef(f"../shared/{name}", 3, local_name=name.rsplit("/", 1)[-1], shared=True) for name in shared)
    for name in shared:
        storage.write_bytes(f"{job_dir}/shared/{name}", b"sst")
    snapshot = SubtaskSnapshot(0, KeyGroupRange(0, 127), "rocksdb", -1, 3 * len(files), 3 * len(files), files)
    meta = CheckpointMetadata(
        "job",
        checkpoint_id,
        False,
        0,
        -1,
        128,
        (OperatorSnapshot("op", 1, (StateDescriptor("s", StateKind.VALUE),), (snapshot,)),),
    )
    storage.write_bytes(f"{job_dir}/chk-{checkpoint_id}/_metadata", meta.to_bytes())
    return meta


def test_gc_keeps_only_the_group_of_a_checkpoint_in_progress(tmp_path: Path) -> None:
    storage, job_dir = _storage(tmp_path)
    retained = _complete(storage, job_dir, 3, ["chk-3/op-0-a-000010.sst", "chk-2/op-0-b-000007.sst"])
    # Checkpoint 4 is uploading; checkpoint 2's other file and checkpoint 1's were never used.
    for name in ("chk-4/op-0-c-000011.sst", "chk-2/op-0-d-000008.sst", "chk-1/op-0-e-000003.sst"):
        storage.write_bytes(f"{job_dir}/shared/{name}", b"sst")
    storage.write_bytes(f"{job_dir}/shared/op-0-f-000001.sst", b"an older layout: no group to tell its owner")

    plan = plan_gc(storage, job_dir, retained=[retained], in_progress_ids=[4])

    removed = {e.path[len(job_dir) + 1 :]: e.why for e in plan.remove}
    kept = {e.path[len(job_dir) + 1 :]: e.why for e in plan.keep}
    assert set(removed) == {"shared/chk-2/op-0-d-000008.sst", "shared/chk-1/op-0-e-000003.sst"}
    assert all("not referenced by any valid _metadata" in why for why in removed.values())
    assert kept["shared/chk-4/op-0-c-000011.sst"] == "uploaded for checkpoint 4, which is in progress"
    assert "in progress may own it" in kept["shared/op-0-f-000001.sst"]
    assert kept["shared/chk-2/op-0-b-000007.sst"] == "referenced by chk-3"

    # Once nothing is in progress, the group of 4 (never completed) is garbage as well.
    idle = {e.path[len(job_dir) + 1 :] for e in plan_gc(storage, job_dir, retained=[retained]).remove}
    assert idle == {
        "shared/chk-4/op-0-c-000011.sst",
        "shared/chk-2/op-0-d-000008.sst",
        "shared/chk-1/op-0-e-000003.sst",
        "shared/op-0-f-000001.sst",
    }


def test_an_aborted_group_is_swept_again_when_later_checkpoints_complete(tmp_path: Path) -> None:
    storage, job_dir = _storage(tmp_path)
    cleaner = CheckpointsCleaner(storage, InlineExecutor())
    group = f"{job_dir}/shared/chk-5"
    storage.write_bytes(f"{group}/op-0-a-000012.sst", b"uploaded before the abort")
    storage.write_bytes(f"{job_dir}/chk-5/op-0/MANIFEST-000004", b"uploaded before the abort")

    cleaner.discard(revisit=[f"{job_dir}/chk-5", group], what="aborted checkpoint 5").result()
    assert relative_files(storage, job_dir) == set()

    for visit in range(REVISITS):
        # The dead TaskManager's last request lands after the deletion.
        storage.write_bytes(f"{group}/op-0-b-{visit:06d}.sst", b"landed late")
        storage.write_bytes(f"{job_dir}/chk-5/op-0/OPTIONS-{visit}", b"landed late")
        cleaner.revisit().result()
        assert relative_files(storage, job_dir) == set(), f"revisit {visit + 1} left late uploads"

    # After its revisits the group is forgotten: a path reused later is not touched.
    storage.write_bytes(f"{group}/kept.sst", b"not ours to delete any more")
    assert cleaner.revisit().result() == []
    assert relative_files(storage, job_dir) == {"shared/chk-5/kept.sst"}


def test_a_revisit_spares_what_keep_protects(tmp_path: Path) -> None:
    storage, job_dir = _storage(tmp_path)
    cleaner = CheckpointsCleaner(storage, InlineExecutor())
    group = f"{job_dir}/shared/chk-7"
    cleaner.discard(revisit=[group])
    storage.write_bytes(f"{group}/x.sst", b"data")
    assert cleaner.revisit(keep=lambda path: path == group).result() == []
    assert relative_files(storage, job_dir) == {"shared/chk-7/x.sst"}
