"""Retention deletes exactly what no retained checkpoint needs; ``statectl checkpoint gc`` removes
exactly the orphans a crash could leave, and never what a checkpoint in progress is writing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from keyedstate.cli.statectl import main as statectl
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.config import Configuration
from keyedstate.common.storage import open_storage
from keyedstate.jobmanager.checkpoint import PendingStatus
from tests.fixtures.cluster import PATIENT
from tests.integration.checkpoints.conftest import (
    JOB,
    MAX_P,
    CheckpointCluster,
    GatedProxy,
    Workload,
    assert_state_equals,
    key_names,
    operators,
    read_metadata,
    referenced_files,
    relative_files,
    s3_keys,
    wait_for_files,
    wait_until,
)

INCREMENTAL = {"execution.checkpointing.incremental": "true", "execution.checkpointing.num-retained": "2"}


def _checkpoint(client: Any) -> Any:
    info = client.trigger_checkpoint(JOB, timeout_s=60)
    assert info.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, info.failure_reason
    return info


@pytest.mark.parametrize("storage", ["file", pytest.param("s3", marks=pytest.mark.s3)])
def test_num_retained_2_keeps_the_last_two_checkpoints_and_exactly_their_files(
    checkpoint_cluster: Callable[..., CheckpointCluster], storage: str
) -> None:
    # Small memtables: the rounds below flush several SSTs each, so RocksDB compacts them
    # between checkpoints and later checkpoints stop referencing some files of earlier ones.
    cc = checkpoint_cluster(storage, "rocksdb", tm={"state.backend.rocksdb.writebuffer.size": "64kb"})
    client = cc.client()
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P, config=INCREMENTAL)
    work = Workload(client)
    job_dir = cc.job_dir()
    referenced: dict[int, set[str]] = {}
    states = {}
    for n in range(1, 5):
        work.write(key_names(4000, f"r{n}") + key_names(500), f"round{n}")
        info = _checkpoint(client)
        assert info.checkpoint_id == n
        referenced[n] = referenced_files(read_metadata(cc.storage, info.path), f"chk-{n}")
        states[n] = work.reference.copy()

    # Only chk-3 and chk-4 remain, with every file they reference and nothing else; files only
    # the subsumed chk-1 and chk-2 used are gone.
    expected = {"chk-3/_metadata", "chk-4/_metadata"} | referenced[3] | referenced[4]
    wait_for_files(cc.storage, job_dir, expected, "chk-1 and chk-2 to be deleted", cc.flush_deletions)
    shared_12 = {p for n in (1, 2) for p in referenced[n] if p.startswith("shared/")}
    assert shared_12 - expected, "compactions replaced some files of chk-1/chk-2, which had to be deleted"
    assert [c.checkpoint_id for c in cc.coordinator().store.all()] == [3, 4]

    # The older retained checkpoint is whole: it restores exactly.
    client.cancel_job(JOB)
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P, config=INCREMENTAL, restore_path=f"{job_dir}/chk-3")
    assert_state_equals(work.read(), states[3])


def _gc(cc: CheckpointCluster, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    args = [
        "checkpoint",
        "gc",
        JOB,
        "--jobmanager",
        cc.cluster.address,
        "-D",
        f"state.checkpoints.dir={cc.checkpoints_dir}",
    ]
    for key, value in cc.config.items():
        args += ["-D", f"{key}={value}"]
    code = statectl([*args, *extra])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("storage", ["file", pytest.param("s3", marks=pytest.mark.s3)])
def test_gc_removes_exactly_the_orphans(
    checkpoint_cluster: Callable[..., CheckpointCluster], storage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cc = checkpoint_cluster(storage, "rocksdb")
    client = cc.client()
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P, config=INCREMENTAL)
    work = Workload(client)
    for n in range(1, 4):
        work.write(key_names(300, f"r{n}"), f"round{n}")
        _checkpoint(client)
    at_chk3 = work.reference.copy()
    job_dir = cc.job_dir()
    cc.flush_deletions()
    real = relative_files(cc.storage, job_dir)
    assert {p.split("/")[0] for p in real} == {"chk-2", "chk-3", "shared"}

    # What a crash leaves: a checkpoint that never got its _metadata, an upload no checkpoint
    # references; and a file in taskowned/, which TaskManagers own and gc keeps.
    orphans = {
        "chk-99/sessions-0/CURRENT",
        "chk-99/sessions-1/000012.sst",
        "shared/sessions-0-0123456789ab-000042.sst",
        "taskowned/tm-0/leftover.bin",
    }
    for path in orphans:
        cc.storage.write_bytes(f"{job_dir}/{path}", b"orphan")

    code, out = _gc(cc, capsys, "--dry-run")
    assert code == 0, out
    assert relative_files(cc.storage, job_dir) == real | orphans, "a dry run removes nothing"
    would = {line.split()[2] for line in out.splitlines() if line.startswith("  would remove")}
    assert would == {f"{job_dir}/chk-99/", f"{job_dir}/shared/sessions-0-0123456789ab-000042.sst"}
    assert "no _metadata" in out and "not referenced by any valid _metadata" in out
    kept = {line.split()[1] for line in out.splitlines() if line.startswith("  keep")}
    assert {f"{job_dir}/chk-2/", f"{job_dir}/chk-3/", f"{job_dir}/taskowned/"} <= kept
    assert {f"{job_dir}/{p}" for p in real if p.startswith("shared/")} <= kept, (
        "every referenced shared file is listed as kept"
    )

    code, out = _gc(cc, capsys, "--dry-run", "--json")
    assert code == 0, out
    report = json.loads(out)
    assert report["dry_run"] and len(report["would_remove"]) == 2 and not report["notes"]
    assert {e["path"] + ("/" if e["dir"] else "") for e in report["kept"]} == kept

    code, out = _gc(cc, capsys)
    assert code == 0, out
    assert relative_files(cc.storage, job_dir) == real | {"taskowned/tm-0/leftover.bin"}, (
        "gc removed exactly the orphans, and nothing in taskowned/"
    )
    assert not Path(job_dir.removeprefix("file://"), "chk-99").exists()
    assert out.count("  removed") == 2

    # Nothing is left to collect, and the retained checkpoint restores exactly.
    code, out = _gc(cc, capsys)
    assert code == 0 and "0 removed" in out
    client.cancel_job(JOB)
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P, config=INCREMENTAL, restore_path=f"{job_dir}/chk-3")
    assert_state_equals(work.read(), at_chk3)


def test_gc_without_jobmanager_and_bad_arguments(
    checkpoint_cluster: Callable[..., CheckpointCluster], capsys: pytest.CaptureFixture[str]
) -> None:
    cc = checkpoint_cluster("file", "hashmap", taskmanagers=1, slots=2)
    client = cc.client()
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P)
    _checkpoint(client)
    cc.storage.write_bytes(f"{cc.job_dir()}/chk-5/sessions-0/meta.kvs", b"orphan")

    # Offline (nothing listens on port 1): gc says so, and still finds the orphan.
    code = statectl(["checkpoint", "gc", JOB, "--dry-run", "--dir", cc.checkpoints_dir, "--jobmanager", "127.0.0.1:1"])
    out = capsys.readouterr().out
    assert code == 0 and "note: the JobManager at 127.0.0.1:1 did not list" in out
    assert f"would remove  {cc.job_dir()}/chk-5/" in out and f"keep  {cc.job_dir()}/chk-1/" in out

    code = statectl(["checkpoint", "gc", "nosuchjob", "--dir", cc.checkpoints_dir, "--jobmanager", cc.cluster.address])
    err = capsys.readouterr().err
    assert code == 1 and "nothing under" in err and "nosuchjob" in err and JOB in err
    code = statectl(["checkpoint", "gc", JOB, "--jobmanager", cc.cluster.address])
    err = capsys.readouterr().err
    assert code == 2 and "--dir" in err and "state.checkpoints.dir" in err


@pytest.mark.s3
def test_gc_keeps_a_checkpoint_in_progress(
    gated_s3: tuple[GatedProxy, str, str], inprocess_cluster: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """The JobManager's _metadata write stalls: chk-2 is fully uploaded but has no _metadata yet,
    exactly what an orphan looks like. gc must keep it and every shared file, and still remove
    a real orphan; once the write goes through, chk-2 completes and restores."""
    proxy, endpoint, bucket = gated_s3
    checkpoints_dir = f"s3://{bucket}/checkpoints"
    cluster = inprocess_cluster(
        taskmanagers=1,
        slots=2,
        jm={"state.checkpoints.dir": checkpoints_dir, **s3_keys(f"http://127.0.0.1:{proxy.port}"), **PATIENT},
        tm=s3_keys(endpoint),
    )
    storage = open_storage(checkpoints_dir, Configuration(s3_keys(endpoint)))
    cc = CheckpointCluster(cluster, storage, checkpoints_dir, s3_keys(endpoint))
    client = cc.client()
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P, config=INCREMENTAL)
    work = Workload(client)
    work.write(key_names(300), "a")
    _checkpoint(client)
    work.write(key_names(300, "b"), "b")
    job_dir = cc.job_dir()
    storage.write_bytes(f"{job_dir}/chk-77/sessions-0/CURRENT", b"orphan")
    try:
        proxy.gate.clear()
        assert client.trigger_checkpoint(JOB, wait=False).checkpoint_id == 2
        coordinator = cc.coordinator()
        wait_until(
            lambda: [p.status for p in coordinator.pending_checkpoints()] == [PendingStatus.FINALIZING],
            "every subtask of checkpoint 2 to acknowledge",
        )
        uploaded = relative_files(storage, job_dir)
        assert any(p.startswith("chk-2/") for p in uploaded) and "chk-2/_metadata" not in uploaded

        code, out = _gc(cc, capsys)
        assert code == 0, out
        assert "checkpoint 2 is in progress" in out
        assert relative_files(storage, job_dir) == uploaded - {"chk-77/sessions-0/CURRENT"}
    finally:
        proxy.gate.set()
    wait_until(lambda: not coordinator.pending_checkpoints(), "checkpoint 2 to complete")
    info = client.job_info(JOB)
    assert info.latest_checkpoint_id == 2, info
    expected = work.reference.copy()
    client.cancel_job(JOB)
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P, config=INCREMENTAL, restore_path=f"{job_dir}/chk-2")
    assert_state_equals(work.read(), expected)


def test_job_directory_has_flinks_layout_from_the_start_and_keeps_it(
    checkpoint_cluster: Callable[..., CheckpointCluster], capsys: pytest.CaptureFixture[str]
) -> None:
    """<dir>/<job>/{chk-<n>, shared, taskowned}: both pools exist once the job is submitted, and
    neither retention nor gc removes them (taskowned/ and its files belong to the TaskManagers)."""
    cc = checkpoint_cluster("file", "hashmap", taskmanagers=1, slots=2)
    client = cc.client()
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P, config={"execution.checkpointing.num-retained": "1"})
    job_dir = Path(cc.job_dir().removeprefix("file://"))
    assert {p.name for p in job_dir.iterdir()} == {"shared", "taskowned"}, "created at job start"
    assert all((job_dir / d).is_dir() for d in ("shared", "taskowned"))

    owned = job_dir / "taskowned" / "tm-0" / "state.bin"
    owned.parent.mkdir()
    owned.write_bytes(b"owned by a TaskManager")
    for _ in range(3):
        _checkpoint(client)
    cc.flush_deletions()
    assert {p.name for p in job_dir.iterdir()} == {"chk-3", "shared", "taskowned"}, "retention kept both pools"

    code, out = _gc(cc, capsys)
    assert code == 0 and "0 removed" in out, out
    assert f"keep  {cc.job_dir()}/taskowned/" in out
    assert (job_dir / "shared").is_dir() and owned.read_bytes() == b"owned by a TaskManager"
