"""Garbage collection of a job directory after crashes: dry run, execute, and what must survive."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from keyedstate.common.errors import StorageError
from keyedstate.jobmanager.checkpoint import execute, load_checkpoint, plan_gc, verify_files_exist
from keyedstate.jobmanager.checkpoint.gc import TASKOWNED_KEPT


def _rel(h: Any, entries: Any) -> dict[str, str]:
    return {e.path[len(h.job_dir) + 1 :]: e.why for e in entries}


@pytest.fixture
def crashed(make_harness: Any) -> Any:
    """Three real checkpoints (retention 3), then the debris a crash leaves behind."""
    h = make_harness(num_retained=3)
    for _ in range(3):
        h.coordinator.trigger()
    st, jd = h.storage, h.job_dir
    st.write_bytes(f"{jd}/chk-99/counts-0/MANIFEST", b"half-written checkpoint")
    st.write_bytes(f"{jd}/shared/orphan.sst", b"uploaded, never referenced")
    st.write_bytes(f"{jd}/taskowned/orphan.log", b"task-owned, never referenced")
    st.write_bytes(f"{jd}/README.txt", b"an operator's note")
    return h


def test_dry_run_plans_without_deleting(crashed: Any) -> None:
    h = crashed
    before = h.files()
    plan = plan_gc(h.storage, h.job_dir, retained=h.coordinator.store.all())
    removed = _rel(h, plan.remove)
    assert removed == {
        "chk-99": "no _metadata: aborted or crashed before completing",
        "shared/orphan.sst": "not referenced by any valid _metadata",
    }
    kept = _rel(h, plan.keep)
    assert kept["taskowned"] == TASKOWNED_KEPT, "TaskManagers own taskowned/: gc never plans to delete it"
    assert kept["chk-3"] == "retained checkpoint 3" and kept["README.txt"] == "not a checkpoint directory"
    assert kept["shared/counts-0-1.sst"] == "referenced by chk-1, chk-2, chk-3"
    assert h.files() == before
    assert "remove " in plan.describe() and "chk-99/" in plan.describe()


def test_execute_deletes_only_garbage_and_retained_checkpoints_stay_restorable(crashed: Any) -> None:
    h = crashed
    plan = plan_gc(h.storage, h.job_dir, retained=h.coordinator.store.all())
    deleted = execute(h.storage, plan)
    assert deleted[0].endswith("/chk-99"), "directories go first"
    files = h.files()
    assert not any(f.startswith(("chk-99", "shared/orphan")) for f in files)
    assert "README.txt" in files and "taskowned/orphan.log" in files
    for c in h.coordinator.store.all():
        verify_files_exist(h.storage, load_checkpoint(h.storage, c.external_path), c.external_path)
    assert plan_gc(h.storage, h.job_dir, retained=h.coordinator.store.all()).remove == []


def test_subsumed_checkpoints_and_the_files_only_they_used_are_removed(crashed: Any) -> None:
    h = crashed
    latest = h.coordinator.store.latest()
    plan = plan_gc(h.storage, h.job_dir, retained=[latest.metadata])
    removed = _rel(h, plan.remove)
    assert removed["chk-1"] == "checkpoint 1 was subsumed by newer retained checkpoints"
    assert removed["chk-2"] == "checkpoint 2 was subsumed by newer retained checkpoints"
    # chk-3 reuses the SSTs of checkpoints 1 and 2 (window 2): those stay, only never-reused ones go.
    assert "shared/counts-0-1.sst" not in removed and "shared/counts-0-2.sst" not in removed
    execute(h.storage, plan)
    verify_files_exist(h.storage, load_checkpoint(h.storage, latest.external_path), latest.external_path)


def test_offline_gc_keeps_every_valid_checkpoint_unless_told_how_many(crashed: Any) -> None:
    h = crashed
    plan = plan_gc(h.storage, h.job_dir)
    assert {"chk-1", "chk-2", "chk-3"} <= set(_rel(h, plan.keep))
    plan = plan_gc(h.storage, h.job_dir, num_retained=1)
    assert {"chk-1", "chk-2"} <= set(_rel(h, plan.remove)) and "chk-3" in _rel(h, plan.keep)


def test_valid_checkpoints_unknown_to_the_store_are_kept(crashed: Any) -> None:
    h = crashed
    # The JobManager wrote chk-3's _metadata but crashed before adding it to its store.
    plan = plan_gc(h.storage, h.job_dir, retained=[c for c in h.coordinator.store.all() if c.checkpoint_id < 3])
    assert _rel(h, plan.keep)["chk-3"] == "valid checkpoint 3 not in the store (kept to be safe)"
    assert "shared/counts-0-3.sst" in _rel(h, plan.keep)


def test_in_progress_checkpoints_and_their_possible_files_are_kept(crashed: Any) -> None:
    h = crashed
    plan = plan_gc(h.storage, h.job_dir, retained=h.coordinator.store.all(), in_progress_ids={99})
    kept = _rel(h, plan.keep)
    assert kept["chk-99"] == "checkpoint 99 is in progress"
    assert "in progress may own it" in kept["shared/orphan.sst"]
    assert plan.remove == []


def test_an_unreadable_metadata_protects_every_shared_file(crashed: Any) -> None:
    h = crashed
    Path(h.job_dir[len("file://") :], "chk-99", "_metadata").write_text("{ truncated")
    plan = plan_gc(h.storage, h.job_dir, retained=h.coordinator.store.all())
    kept = _rel(h, plan.keep)
    assert kept["chk-99"].startswith("unreadable _metadata, inspect it by hand")
    assert kept["shared/orphan.sst"] == "an unreadable _metadata (chk-99) may reference it"
    assert plan.remove == []


def test_retained_checkpoint_without_metadata_is_never_removed(crashed: Any) -> None:
    h = crashed
    Path(h.job_dir[len("file://") :], "chk-3", "_metadata").unlink()
    plan = plan_gc(h.storage, h.job_dir, retained=h.coordinator.store.all())
    assert _rel(h, plan.keep)["chk-3"] == "retained checkpoint 3 (its _metadata is missing!)"


def test_missing_job_dir_is_an_empty_plan(storage: Any, tmp_path: Path) -> None:
    plan = plan_gc(storage, tmp_path.as_uri() + "/no-such-job")
    assert plan.remove == [] and plan.keep == []


def test_execute_reports_what_it_could_not_delete(crashed: Any) -> None:
    h = crashed
    plan = plan_gc(h.storage, h.job_dir, retained=h.coordinator.store.all())
    plan.remove.insert(0, type(plan.remove[0])("file:///", "the storage refuses to delete a root", True))
    with pytest.raises(StorageError, match=r"gc deleted 2 of 3 paths; could not delete file:///.*run gc again"):
        execute(h.storage, plan)
    assert not any(f.startswith("chk-99") for f in h.files())
