"""Who owns a restored checkpoint's files (claim modes), and what the JobManager then deletes."""

from __future__ import annotations

from typing import Any

import pytest

from keyedstate.common.claim_mode import RecoveryClaimMode
from keyedstate.jobmanager.checkpoint import (
    RestoreOwnership,
    decide_ownership,
    execute,
    load_completed_checkpoint,
    plan_gc,
    references_restored,
)

CLAIM, NO_CLAIM = RecoveryClaimMode.CLAIM, RecoveryClaimMode.NO_CLAIM


@pytest.fixture
def snapshots(make_harness: Any) -> Any:
    """A job with checkpoint 1 and a savepoint; returns (harness, checkpoint, savepoint)."""
    h = make_harness()
    h.coordinator.trigger()
    savepoint = h.coordinator.trigger(savepoint=True).future.result(5)
    return h, load_completed_checkpoint(h.storage, h.job_dir + "/chk-1"), savepoint


@pytest.mark.parametrize("mode", list(RecoveryClaimMode))
def test_a_recovery_of_the_jobs_own_checkpoint_is_owned_in_either_mode(snapshots: Any, mode: Any) -> None:
    h, checkpoint, _ = snapshots
    ownership = decide_ownership(mode, checkpoint, h.job_dir, recovery=True)
    assert ownership is RestoreOwnership.OWNED and ownership.job_owns_files


def test_no_claim_leaves_every_snapshot_to_the_user(snapshots: Any) -> None:
    h, checkpoint, savepoint = snapshots
    for snapshot in (checkpoint, savepoint):
        ownership = decide_ownership(NO_CLAIM, snapshot, h.job_dir)
        assert ownership is RestoreOwnership.USER and not ownership.job_owns_files
    # Even a checkpoint of another job directory.
    assert decide_ownership(NO_CLAIM, checkpoint, h.job_dir + "-other") is RestoreOwnership.USER


def test_claim_takes_over_a_checkpoint_of_the_jobs_own_directory(snapshots: Any) -> None:
    h, checkpoint, _ = snapshots
    ownership = decide_ownership(CLAIM, checkpoint, h.job_dir + "/")
    assert ownership is RestoreOwnership.CLAIMED and ownership.job_owns_files


def test_claim_takes_over_savepoints_and_other_jobs_checkpoints_too(snapshots: Any) -> None:
    h, checkpoint, savepoint = snapshots
    assert decide_ownership(CLAIM, savepoint, h.job_dir) is RestoreOwnership.CLAIMED
    # A sibling whose name merely starts like the job's directory is another job's directory.
    assert decide_ownership(CLAIM, checkpoint, h.job_dir + "x") is RestoreOwnership.CLAIMED


def test_only_shared_files_of_the_jobs_own_directory_can_be_referenced(snapshots: Any) -> None:
    h, checkpoint, savepoint = snapshots
    assert references_restored(checkpoint, h.job_dir + "/")
    assert not references_restored(checkpoint, h.job_dir + "x"), "../shared/ of the new job is another directory"
    assert not references_restored(savepoint, h.job_dir), "a savepoint has no shared files"


def test_a_claimed_savepoint_is_deleted_once_subsumed(snapshots: Any, make_harness: Any) -> None:
    h, _, savepoint = snapshots
    root = savepoint.external_path
    assert h.files(root), "the savepoint holds files"
    owner = make_harness()  # a new run of the job, restored from the savepoint under CLAIM
    owner.coordinator.restore_from(load_completed_checkpoint(h.storage, root), claim=True)
    assert [c.checkpoint_id for c in owner.coordinator.store.all()] == [savepoint.checkpoint_id]
    assert owner.coordinator.trigger().future.result(5).checkpoint_id == savepoint.checkpoint_id + 1
    assert owner.coordinator.cleaner.flush(timeout=10)
    assert not h.files(root), "CLAIM: a savepoint is deleted once subsumed, like a checkpoint"


def _restored(make_harness: Any) -> tuple[Any, set[str]]:
    """Checkpoint 1 of an earlier run of the job, and its files (relative to the job directory)."""
    h = make_harness()
    h.coordinator.trigger()
    restored = load_completed_checkpoint(h.storage, h.job_dir + "/chk-1")
    files = {p[len(h.job_dir) + 1 :] for p in restored.file_paths()}
    assert files <= h.files() and restored.shared_files
    return restored, files


def test_an_unclaimed_checkpoint_is_never_deleted(make_harness: Any) -> None:
    restored, files = _restored(make_harness)
    user = make_harness()  # a new run of the job on the same directory, restoring chk-1 under NO_CLAIM
    user.coordinator.restore_from(restored, claim=False)
    for _ in range(3):
        user.coordinator.trigger()
    assert [c.checkpoint_id for c in user.coordinator.store.all()] == [4]
    assert files <= user.files(), "NO_CLAIM: the job never deletes the restored checkpoint"


def test_a_claimed_checkpoint_is_deleted_once_subsumed(make_harness: Any) -> None:
    restored, files = _restored(make_harness)
    owner = make_harness()
    owner.coordinator.restore_from(restored, claim=True)
    assert owner.coordinator.shared_registry.reference_count(sorted(restored.shared_files)[0]) == 1
    owner.coordinator.trigger()
    assert [c.checkpoint_id for c in owner.coordinator.store.all()] == [2]
    assert not files & owner.files(), "CLAIM: subsumed, with every file only it used"


def test_gc_keeps_a_checkpoint_restored_under_no_claim_with_its_files(make_harness: Any) -> None:
    h = make_harness(num_retained=3)
    for _ in range(3):
        h.coordinator.trigger()
    retained = h.coordinator.store.all()[-1:]  # as after a restart: only chk-3 is the job's
    plan = plan_gc(h.storage, h.job_dir, retained, protected=[h.job_dir + "/chk-1/"])
    kept = {e.path[len(h.job_dir) + 1 :]: e.why for e in plan.keep}
    removed = {e.path[len(h.job_dir) + 1 :] for e in plan.remove}
    assert kept["chk-1"].startswith("checkpoint 1 was restored from with claim mode NO_CLAIM")
    assert "chk-2" in removed
    execute(h.storage, plan)
    restored = load_completed_checkpoint(h.storage, h.job_dir + "/chk-1")
    assert {p[len(h.job_dir) + 1 :] for p in restored.file_paths()} <= h.files()
