"""CheckpointCoordinator against real file:// storage, simulated TaskManagers and manual time."""

from __future__ import annotations

import gc
import json
import threading
import weakref
from pathlib import Path
from typing import Any, cast

import pytest

from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.handles import StateFileHandle
from keyedstate.common.ids import KeyGroupRange, SubtaskId
from keyedstate.jobmanager.checkpoint import (
    AckOutcome,
    CheckpointException,
    CheckpointInProgressError,
    CheckpointNotFoundError,
    PendingStatus,
    load_checkpoint,
    load_completed_checkpoint,
    verify_files_exist,
)
from keyedstate.jobmanager.checkpoint import (
    CheckpointFailureReason as R,
)
from keyedstate.jobmanager.rpc.checkpoint_wire import summary_to_proto

JOB = "job-1"


def metadata_of(h: Any, checkpoint_id: int) -> dict[str, Any]:
    path = Path(h.job_dir[len("file://") :]) / f"chk-{checkpoint_id}" / "_metadata"
    return cast("dict[str, Any]", json.loads(path.read_text(encoding="utf-8")))


def referenced_files(h: Any) -> set[str]:
    """Every file the retained checkpoints' _metadata reference, relative to the job dir."""
    out = set()
    for c in h.coordinator.store.all():
        if c.savepoint:
            continue
        for _, _, f in load_checkpoint(h.storage, c.external_path).files():
            chk = f"chk-{c.checkpoint_id}"
            out.add(str(Path(chk, f.path)).replace(f"{chk}/../", ""))
        out.add(f"chk-{c.checkpoint_id}/_metadata")
    return out


# -- the happy path ------------------------------------------------------------------------------
def test_full_lifecycle_writes_metadata_last_and_notifies(make_harness: Any) -> None:
    h = make_harness(mode="manual")
    pending = h.coordinator.trigger()
    assert pending.checkpoint_id == 1 and pending.status is PendingStatus.IN_PROGRESS
    barrier = h.cluster.barriers[0]
    assert barrier.target_path == h.job_dir + "/chk-1" and barrier.epoch == -1 and not barrier.savepoint

    subtasks = h.cluster.subtasks()
    for s in subtasks[:-1]:
        assert h.cluster.ack(s, 1) is AckOutcome.SUCCESS
    # Every other file is uploaded, but without _metadata the checkpoint does not exist yet.
    assert "chk-1/_metadata" not in h.files() and "chk-1/counts-0/MANIFEST" in h.files()
    assert h.coordinator.latest_completed() is None and h.metric("numberOfInProgressCheckpoints") == 1

    assert h.cluster.ack(subtasks[-1], 1) is AckOutcome.SUCCESS
    completed = h.coordinator.wait_for(1, timeout=0)
    assert completed.external_path == h.job_dir + "/chk-1"
    assert h.coordinator.latest_completed() == completed
    assert h.cluster.notifications == [(1, True)]
    assert cast(PendingStatus, pending.status) is PendingStatus.COMPLETED  # the last ack moved it on

    meta = metadata_of(h, 1)
    assert meta["format"] == "keyedstate-checkpoint" and meta["version"] == 1
    assert (meta["job_id"], meta["checkpoint_id"], meta["savepoint"], meta["max_parallelism"]) == (JOB, 1, False, 8)
    assert meta["timestamp_ms"] == h.clock.now_ms()
    counts = meta["operators"][0]
    assert counts["operator_id"] == "counts" and counts["parallelism"] == 2
    assert counts["states"] == [{"name": "total", "kind": "value", "ttl": None, "reduce_fields": []}]
    assert [s["key_groups"] for s in counts["subtasks"]] == [[0, 3], [4, 7]]
    files = counts["subtasks"][0]["files"]
    assert {f["path"] for f in files} == {"../shared/counts-0-1.sst", "counts-0/MANIFEST"}
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in files)
    verify_files_exist(h.storage, load_checkpoint(h.storage, completed.external_path), completed.external_path)

    assert h.metric("numberOfCompletedCheckpoints") == 1 and h.metric("lastCompletedCheckpointId") == 1
    assert h.metric("numberOfInProgressCheckpoints") == 0 and h.metric("totalNumberOfCheckpoints") == 1
    assert h.metric("lastCheckpointFullSize") == completed.metadata.full_size > 0
    history = h.coordinator.stats.history()
    assert history[0].status == "COMPLETED" and history[0].path == completed.external_path
    assert summary_to_proto(history[0].summary()).checkpoint_id == 1


def test_acks_arriving_during_barrier_delivery_complete_the_checkpoint(make_harness: Any) -> None:
    h = make_harness()  # the simulated TaskManagers ack from inside send_barrier
    pending = h.coordinator.trigger()
    assert pending.status is PendingStatus.COMPLETED
    assert h.coordinator.wait_for(pending.checkpoint_id).checkpoint_id == 1


def test_duration_comes_from_the_injected_clock(make_harness: Any) -> None:
    h = make_harness(mode="manual")
    h.coordinator.trigger()
    h.clock.advance(1234)
    h.cluster.ack_all(1)
    assert h.metric("lastCheckpointDuration") == 1234


def test_the_epoch_of_the_cut_is_carried_by_the_barrier_and_recorded(make_harness: Any) -> None:
    h = make_harness(mode="manual")
    h.cluster.committed_epoch = 7
    h.coordinator.trigger()
    assert h.cluster.barriers[-1].epoch == 7
    h.cluster.ack_all(1)
    assert metadata_of(h, 1)["epoch"] == 7


def test_an_ack_holding_another_epoch_than_the_cut_spoils_the_checkpoint(make_harness: Any) -> None:
    # A consistent cut: every subtask must hold exactly the epoch the barrier was cut at, neither
    # less (the checkpoint would claim an epoch it lacks) nor more (a restore would double it).
    for held in (6, 8):
        h = make_harness(mode="manual")
        h.cluster.committed_epoch = 7
        h.coordinator.trigger()
        h.cluster.committed_epoch = held
        outcome = h.cluster.ack(h.cluster.subtasks()[0], 1)
        assert outcome is AckOutcome.DISCARDED
        with pytest.raises(
            CheckpointException, match=f"committed epoch is {held} but the checkpoint was cut at epoch 7"
        ) as info:
            h.coordinator.wait_for(1, timeout=0)
        assert info.value.failure_reason is R.CHECKPOINT_DECLINED
        assert "chk-1" not in {p.split("/")[0] for p in h.files()}


def test_duplicate_unknown_and_retried_acks_change_nothing(make_harness: Any) -> None:
    h = make_harness(mode="manual")
    h.coordinator.trigger()
    first, *rest = h.cluster.subtasks()
    handle = h.cluster.snapshot(first, 1)
    assert h.coordinator.acknowledge(1, handle) is AckOutcome.SUCCESS
    assert h.coordinator.acknowledge(1, handle) is AckOutcome.DUPLICATE
    assert h.coordinator.acknowledge(99, handle) is AckOutcome.UNKNOWN
    stranger = h.cluster.snapshot(first, 1)
    stranger.operator_id = "no-such-operator"
    assert h.coordinator.acknowledge(1, stranger) is AckOutcome.UNKNOWN
    assert h.coordinator.pending_checkpoints()[0].num_acknowledged == 1
    for s in rest:
        h.cluster.ack(s, 1)
    before = h.files()
    # A TaskManager retrying its ack after the checkpoint completed: DUPLICATE, nothing deleted.
    assert h.coordinator.acknowledge(1, handle) is AckOutcome.DUPLICATE
    assert h.files() == before and "chk-1/_metadata" in before


def test_late_ack_for_an_expired_checkpoint_is_discarded_and_its_files_deleted(make_harness: Any) -> None:
    h = make_harness(mode="manual", timeout_ms=5_000)
    h.coordinator.trigger()
    h.cluster.ack(h.cluster.subtasks()[0], 1)
    h.scheduler.advance(5_000)
    with pytest.raises(CheckpointException) as info:
        h.coordinator.wait_for(1, timeout=0)
    assert info.value.failure_reason is R.CHECKPOINT_EXPIRED
    assert "2 of 3 subtasks did not acknowledge" in str(info.value)
    assert h.files() == set()
    # A slow TaskManager uploads after the abort and then acknowledges.
    late = h.cluster.subtasks()[1]
    assert h.cluster.ack(late, 1) is AckOutcome.DISCARDED
    assert h.files() == set(), "the late upload must be deleted too"
    assert h.cluster.notifications == [(1, False)]


# -- timeouts --------------------------------------------------------------------------------------
def test_timeout_aborts_through_the_scheduler_without_sleeping(make_harness: Any) -> None:
    h = make_harness(mode="silent", timeout_ms=60_000)
    h.coordinator.trigger()
    assert h.scheduler.pending() == [60_000]
    h.scheduler.advance(59_999)
    assert h.coordinator.in_progress_ids() == {1}
    h.scheduler.advance(1)
    assert h.coordinator.in_progress_ids() == set()
    entry = h.coordinator.stats.history()[0]
    assert (entry.status, entry.failure_reason, entry.duration_ms) == ("FAILED", "CHECKPOINT_EXPIRED", 60_000)
    assert (
        h.registry.get_sample_value(
            "keyedstate_jobmanager_job_checkpoint_failures_total", {"job_id": JOB, "reason": "CHECKPOINT_EXPIRED"}
        )
        == 1
    )


def test_completion_cancels_the_timeout(make_harness: Any) -> None:
    h = make_harness(timeout_ms=1_000)
    h.coordinator.trigger()
    assert h.scheduler.pending() == []
    h.scheduler.advance(10_000)
    assert h.coordinator.latest_completed() is not None and h.metric("numberOfFailedCheckpoints") == 0


# -- concurrency limits ----------------------------------------------------------------------------
def test_max_concurrent_rejects_manual_triggers_clearly(make_harness: Any) -> None:
    h = make_harness(mode="silent", max_concurrent=1)
    h.coordinator.trigger()
    with pytest.raises(
        CheckpointException, match=r"\[1\] already in progress .*max-concurrent-checkpoints is 1"
    ) as info:
        h.coordinator.trigger()
    assert info.value.failure_reason is R.TOO_MANY_CHECKPOINT_REQUESTS
    assert h.coordinator.in_progress_ids() == {1}
    # A savepoint is forced past the limit, as in Flink.
    assert h.coordinator.trigger(savepoint=True).checkpoint_id == 2


def test_min_pause_is_measured_from_the_last_completion(make_harness: Any) -> None:
    h = make_harness(min_pause_ms=1_000)
    h.coordinator.trigger()
    h.clock.advance(400)
    with pytest.raises(CheckpointException, match="completed 400 ms ago .* retry in 600 ms") as info:
        h.coordinator.trigger()
    assert info.value.failure_reason is R.MINIMUM_TIME_BETWEEN_CHECKPOINTS
    h.clock.advance(600)
    assert h.coordinator.trigger().checkpoint_id == 2


def test_a_newer_completed_checkpoint_subsumes_older_pending_ones(make_harness: Any) -> None:
    h = make_harness(mode="manual", max_concurrent=2, tolerable_failures=0)
    h.coordinator.trigger()
    h.coordinator.trigger()
    h.cluster.ack(h.cluster.subtasks()[0], 1)
    h.cluster.ack_all(2)
    with pytest.raises(CheckpointException) as info:
        h.coordinator.wait_for(1, timeout=0)
    assert info.value.failure_reason is R.CHECKPOINT_SUBSUMED
    assert h.failovers == [], "a subsumed checkpoint is not a failure that counts"
    assert {p.split("/")[0] for p in h.files()} == {"chk-2", "shared"}
    assert h.files() == referenced_files(h)


# -- periodic --------------------------------------------------------------------------------------
def test_periodic_checkpoints_respect_interval_and_min_pause(make_harness: Any) -> None:
    h = make_harness(interval_ms=100, min_pause_ms=250)
    assert h.coordinator.start_periodic()
    h.scheduler.advance(99)
    assert h.cluster.barriers == []
    h.scheduler.advance(1)
    assert [b.checkpoint_id for b in h.cluster.barriers] == [1]
    t0 = h.cluster.barriers[0].timestamp_ms
    # The tick at +200 falls inside the pause; the next checkpoint waits until +100+250.
    h.scheduler.advance(1_000)
    times = [b.timestamp_ms - t0 for b in h.cluster.barriers]
    assert times[:3] == [0, 250, 500]
    assert h.metric("numberOfFailedCheckpoints") == 0
    h.coordinator.stop()
    count = len(h.cluster.barriers)
    h.scheduler.advance(10_000)
    assert len(h.cluster.barriers) == count


def test_periodic_trigger_skips_while_the_previous_one_is_running(make_harness: Any) -> None:
    h = make_harness(mode="silent", interval_ms=100, timeout_ms=350)
    h.coordinator.start_periodic()
    h.scheduler.advance(300)
    assert [b.checkpoint_id for b in h.cluster.barriers] == [1]
    assert h.metric("numberOfFailedCheckpoints") == 0, "a skipped periodic trigger is not a failure"
    h.scheduler.advance(150)  # checkpoint 1 expires at 450; the tick at 500 starts checkpoint 2
    h.scheduler.advance(50)
    assert [b.checkpoint_id for b in h.cluster.barriers] == [1, 2]


def test_start_periodic_without_interval_is_a_no_op(make_harness: Any) -> None:
    h = make_harness()
    assert h.coordinator.start_periodic() is False
    assert h.scheduler.pending() == []


# -- failures and failover -------------------------------------------------------------------------
def test_tolerable_failures_then_failover_exactly_once(make_harness: Any) -> None:
    h = make_harness(mode="decline", tolerable_failures=1)
    for expected_failovers in (0, 1, 1):
        with pytest.raises(CheckpointException):
            pending = h.coordinator.trigger()
            h.coordinator.wait_for(pending.checkpoint_id, timeout=0)
        assert len(h.failovers) == expected_failovers
    reason, message = h.failovers[0]
    assert reason is R.CHECKPOINT_DECLINED
    assert "2 consecutive checkpoints failed" in message and "tolerable-failed-checkpoints=1" in message
    assert "disk full" in message
    # A success resets the count; two more failures fail over again.
    h.cluster.mode = "ack"
    h.coordinator.trigger()
    h.cluster.mode = "decline"
    for _ in range(2):
        pending = h.coordinator.trigger()
    assert len(h.failovers) == 2


def test_failed_savepoints_do_not_count_toward_failover(make_harness: Any) -> None:
    h = make_harness(mode="decline", tolerable_failures=0)
    for _ in range(2):
        with pytest.raises(CheckpointException):
            h.coordinator.wait_for(h.coordinator.trigger(savepoint=True).checkpoint_id, timeout=0)
    assert h.failovers == [] and h.coordinator.consecutive_failures == 0
    assert h.files((Path(h.job_dir[len("file://") :]).parent.parent / "savepoints").as_uri()) == set()


def test_failed_uncounted_checkpoints_do_not_count_toward_failover(make_harness: Any) -> None:
    """The checkpoint the JobManager adds after a restore's replay (counted=False): with slow storage
    every one failing would fail the restored job over again, in a loop, until the restarts ran out."""
    h = make_harness(mode="decline", tolerable_failures=0)
    for _ in range(3):
        with pytest.raises(CheckpointException):
            h.coordinator.wait_for(h.coordinator.trigger(counted=False).checkpoint_id, timeout=0)
    assert h.failovers == [] and h.coordinator.consecutive_failures == 0
    with pytest.raises(CheckpointException):  # an ordinary checkpoint still counts
        h.coordinator.wait_for(h.coordinator.trigger().checkpoint_id, timeout=0)
    assert len(h.failovers) == 1


def test_decline_outcomes(make_harness: Any) -> None:
    h = make_harness(mode="manual")
    first = h.cluster.subtasks()[0]
    assert h.coordinator.decline(7, first, "no such checkpoint") is AckOutcome.UNKNOWN
    h.coordinator.trigger()
    assert h.coordinator.decline(1, SubtaskId(JOB, "other", 0), "not part of it") is AckOutcome.UNKNOWN
    assert h.coordinator.in_progress_ids() == {1}
    assert h.coordinator.decline(1, first, "disk full", R.CHECKPOINT_ASYNC_EXCEPTION) is AckOutcome.SUCCESS
    assert h.coordinator.decline(1, first, "again") is AckOutcome.DISCARDED
    with pytest.raises(
        CheckpointException, match="CHECKPOINT_ASYNC_EXCEPTION: subtask job-1/counts/0 declined checkpoint 1: disk full"
    ):
        h.coordinator.wait_for(1, timeout=0)


def test_pre_flight_rejections_do_not_count_toward_failover(make_harness: Any) -> None:
    running = {SubtaskId(JOB, "counts", 0)}
    h = make_harness(tasks=lambda: running, tolerable_failures=0)
    for _ in range(3):
        with pytest.raises(
            CheckpointException, match=r"2 subtask\(s\) are not running: job-1/counts/1, job-1/sessions/0"
        ) as info:
            h.coordinator.trigger()
        assert info.value.failure_reason is R.NOT_ALL_REQUIRED_TASKS_RUNNING
    assert h.failovers == [] and h.cluster.barriers == []
    assert h.metric("numberOfFailedCheckpoints") == 3  # reported, as Flink does
    running.update(h.cluster.subtasks())
    assert h.coordinator.trigger().checkpoint_id == 1, "rejected triggers consume no ids"


def test_unreachable_taskmanager_fails_the_trigger_and_cleans_up(make_harness: Any) -> None:
    h = make_harness(mode="partial")
    with pytest.raises(CheckpointException, match="tm-2 went away") as info:
        h.coordinator.trigger()
    assert info.value.failure_reason is R.NOT_ALL_REQUIRED_TASKS_RUNNING
    assert h.files() == set(), "files of the subtask that did ack are deleted"
    assert h.cluster.notifications == [(1, False)]
    assert h.coordinator.in_progress_ids() == set()


def test_abort_pending_on_task_failure_does_not_count(make_harness: Any) -> None:
    h = make_harness(mode="manual", tolerable_failures=0)
    h.coordinator.trigger()
    h.cluster.ack(h.cluster.subtasks()[0], 1)
    assert h.coordinator.abort_pending(R.TASK_FAILURE, "TaskManager tm-1 lost") == 1
    assert h.failovers == [] and h.files() == set()


def test_invalid_ack_aborts_the_checkpoint_with_a_clear_message(make_harness: Any) -> None:
    h = make_harness(mode="manual")
    h.coordinator.trigger()
    subtask = h.cluster.subtasks()[0]
    handle = h.cluster.snapshot(subtask, 1)
    handle.files.append(StateFileHandle(path="../../other-job/chk-3/x.sst", size=1, sha256="", shared=False))
    assert h.coordinator.acknowledge(1, handle) is AckOutcome.DISCARDED
    with pytest.raises(CheckpointException, match="must be inside the checkpoint directory"):
        h.coordinator.wait_for(1, timeout=0)
    assert h.files() == set()

    h.coordinator.trigger()
    handle = h.cluster.snapshot(subtask, 2)
    handle.key_groups = KeyGroupRange(handle.key_groups.start, 7)
    assert h.coordinator.acknowledge(2, handle) is AckOutcome.DISCARDED
    with pytest.raises(CheckpointException, match=r"key groups \[0, 7\], but the subtask owns \[0, 3\]"):
        h.coordinator.wait_for(2, timeout=0)


# -- retention and shared files --------------------------------------------------------------------
def test_retention_deletes_subsumed_dirs_and_only_unreferenced_shared_files(make_harness: Any) -> None:
    h = make_harness(num_retained=2)
    for _ in range(5):
        h.coordinator.trigger()
    assert [c.checkpoint_id for c in h.coordinator.store.all()] == [4, 5]
    files = h.files()
    assert {p.split("/")[0] for p in files} == {"chk-4", "chk-5", "shared"}
    # Nothing unreferenced is left, and everything referenced exists.
    assert files == referenced_files(h)
    # Subtasks reuse their last two confirmed SSTs: chk-4 still needs 2 and 3; 1 is gone.
    assert {f for f in files if f.startswith("shared/counts-0-")} == {f"shared/counts-0-{i}.sst" for i in (2, 3, 4, 5)}
    for c in h.coordinator.store.all():
        verify_files_exist(h.storage, c.metadata, c.external_path)


def test_initialize_locations_creates_flinks_pools_and_retention_keeps_them(make_harness: Any) -> None:
    h = make_harness(num_retained=1)
    job_dir = Path(h.job_dir[len("file://") :])
    h.coordinator.initialize_locations()
    h.coordinator.initialize_locations()  # idempotent: a recovered job initializes again
    assert sorted(p.name for p in job_dir.iterdir()) == ["shared", "taskowned"]
    (job_dir / "taskowned" / "log").write_bytes(b"a TaskManager's")
    for _ in range(3):
        h.coordinator.trigger()
    assert sorted(p.name for p in job_dir.iterdir()) == ["chk-3", "shared", "taskowned"]
    assert (job_dir / "taskowned" / "log").read_bytes() == b"a TaskManager's"


def test_retaining_one_checkpoint_keeps_the_files_it_shares_with_the_subsumed_one(make_harness: Any) -> None:
    h = make_harness(num_retained=1)
    for _ in range(1, 5):
        h.coordinator.trigger()
        latest = h.coordinator.latest_completed()
        verify_files_exist(h.storage, latest.metadata, latest.external_path)
        assert h.files() == referenced_files(h)
    assert {f for f in h.files() if f.startswith("shared/counts-0-")} == {f"shared/counts-0-{i}.sst" for i in (2, 3, 4)}


def test_the_coordinator_lets_go_of_subsumed_checkpoints(make_harness: Any) -> None:
    """Finished checkpoints are remembered (late acks, wait_for) without their file lists: only the
    retained one stays in memory, however many completed before it."""
    h = make_harness(num_retained=1)
    first = h.cluster.subtasks()[0]
    kept = []
    for _ in range(4):
        pending = h.coordinator.trigger()
        completed = h.coordinator.wait_for(pending.checkpoint_id)
        kept.append(weakref.ref(completed.metadata))
        del pending, completed
    gc.collect()
    assert [ref() is not None for ref in kept] == [False, False, False, True]
    # Still remembered as completed: a retried ack is a DUPLICATE (it deletes nothing)...
    h.cluster.write_files = False
    assert h.coordinator.acknowledge(2, h.cluster.snapshot(first, 2)) is AckOutcome.DUPLICATE
    assert h.files() == referenced_files(h)
    # ... and waiting for it says what happened to it; the retained one is still there to wait for.
    with pytest.raises(CheckpointNotFoundError, match="checkpoint 2 of job job-1 completed, and a newer checkpoint"):
        h.coordinator.wait_for(2)
    assert h.coordinator.wait_for(4).checkpoint_id == 4


def test_deletion_rechecks_references_just_before_deleting(make_harness: Any) -> None:
    """Deletions run later on the cleaner's executor; a file referenced again by then survives."""
    from concurrent.futures import Executor, Future

    class QueuedExecutor(Executor):
        def __init__(self) -> None:
            self.queue: list[tuple[Any, Future[Any]]] = []

        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
            future: Future[Any] = Future()
            self.queue.append((lambda: fn(*args, **kwargs), future))
            return future

        def run_all(self) -> None:
            while self.queue:
                task, future = self.queue.pop(0)
                future.set_result(task())

    executor = QueuedExecutor()
    h = make_harness(mode="manual", num_retained=1, cleaner_executor=executor)
    h.coordinator.trigger()
    h.cluster.ack_all(1)
    h.coordinator.trigger()
    for s in h.cluster.subtasks():
        h.cluster.ack(s, 2, reuse=[])  # checkpoint 1's SSTs lose their last reference: deletion queued
    h.coordinator.trigger()
    for s in h.cluster.subtasks():  # a TaskManager that still reuses them
        h.cluster.ack(s, 3, reuse=[f"{s.operator_id}-{s.subtask_index}-1.sst"])
    executor.run_all()
    assert "shared/counts-0-1.sst" in h.files()
    assert h.files() == referenced_files(h)


def test_a_shared_file_reused_by_a_running_checkpoint_survives_subsumption(make_harness: Any) -> None:
    h = make_harness(mode="manual", max_concurrent=2, num_retained=1)
    h.coordinator.trigger()
    h.cluster.ack_all(1)  # shared/<tag>-1.sst confirmed
    h.coordinator.trigger()
    h.coordinator.trigger()
    # Checkpoint 3's TaskManagers reuse the files of checkpoint 1; checkpoint 2's do not.
    for s in h.cluster.subtasks():
        h.cluster.ack(s, 2, reuse=[])
    assert h.coordinator.store.all()[0].checkpoint_id == 2
    assert "shared/counts-0-1.sst" in h.files(), "deletion waits while checkpoint 3 may reference it"
    for s in h.cluster.subtasks():
        h.cluster.ack(s, 3, reuse=[f"{s.operator_id}-{s.subtask_index}-1.sst"])
    assert "shared/counts-0-1.sst" in h.files()
    assert h.files() == referenced_files(h)


def test_a_deferred_file_is_deleted_once_the_blocking_checkpoint_aborts(make_harness: Any) -> None:
    h = make_harness(mode="manual", max_concurrent=2, num_retained=1)
    h.coordinator.trigger()
    h.cluster.ack_all(1)
    h.coordinator.trigger()
    h.coordinator.trigger()
    for s in h.cluster.subtasks():
        h.cluster.ack(s, 2, reuse=[])
    assert "shared/counts-0-1.sst" in h.files()
    h.coordinator.decline(3, h.cluster.subtasks()[0], "cancelled")
    assert h.files() == referenced_files(h)


def test_abort_leaves_nothing_behind_but_keeps_files_of_completed_checkpoints(make_harness: Any) -> None:
    h = make_harness()
    h.coordinator.trigger()
    before = h.files()
    h.cluster.mode = "decline"
    with pytest.raises(CheckpointException):
        h.coordinator.trigger()
        h.coordinator.wait_for(2, timeout=0)
    assert h.cluster.outcomes[-1] is AckOutcome.SUCCESS  # the decline aborted checkpoint 2
    assert h.files() == before, "new uploads of checkpoint 2 are gone; reused files of checkpoint 1 stay"
    assert h.cluster.notifications[-1] == (2, False)


# -- savepoints ------------------------------------------------------------------------------------
def test_savepoint_is_self_contained_movable_and_never_subsumed(make_harness: Any, tmp_path: Path) -> None:
    h = make_harness(num_retained=1)
    h.coordinator.trigger()
    savepoint = h.coordinator.wait_for(h.coordinator.trigger(savepoint=True).checkpoint_id)
    assert savepoint.external_path == (tmp_path / "savepoints").as_uri() + "/savepoint-job-1-2"
    assert not h.cluster.barriers[-1].incremental
    sp_files = h.files(savepoint.external_path)
    assert "_metadata" in sp_files and all(not f.path.startswith("..") for _, _, f in savepoint.metadata.files())
    assert savepoint.shared_files == frozenset()
    assert h.coordinator.latest_completed() == savepoint
    for _ in range(3):
        h.coordinator.trigger()
    assert h.files(savepoint.external_path) == sp_files, "retention never touches a savepoint"
    assert h.coordinator.latest_completed().checkpoint_id == 5

    moved = tmp_path / "elsewhere" / "my-savepoint"
    moved.parent.mkdir()
    Path(savepoint.external_path[len("file://") :]).rename(moved)
    reloaded = load_completed_checkpoint(h.storage, moved.as_uri() + "/_metadata")
    assert reloaded.metadata == savepoint.metadata
    verify_files_exist(h.storage, reloaded.metadata, reloaded.external_path)


def test_savepoint_needs_a_target_directory(make_harness: Any) -> None:
    h = make_harness()
    h.coordinator.savepoints_dir = None
    with pytest.raises(InvalidArgumentError, match="state.savepoints.dir"):
        h.coordinator.trigger(savepoint=True)
    with pytest.raises(InvalidArgumentError, match="savepoints only"):
        h.coordinator.trigger(target_dir="file:///x")


def test_savepoint_files_outside_its_directory_are_refused(make_harness: Any) -> None:
    h = make_harness(mode="manual")
    h.coordinator.trigger(savepoint=True)
    handle = h.cluster.snapshot(h.cluster.subtasks()[0], 1)
    handle.files.append(StateFileHandle(path="shared/reused.sst", size=3, sha256="", shared=True))
    assert h.coordinator.acknowledge(1, handle) is AckOutcome.DISCARDED
    with pytest.raises(CheckpointException, match="a savepoint owns all its files"):
        h.coordinator.wait_for(1, timeout=0)


# -- finalization failures -------------------------------------------------------------------------
def test_existing_metadata_is_never_overwritten_nor_deleted(make_harness: Any) -> None:
    h = make_harness(mode="manual")
    foreign = Path(h.job_dir[len("file://") :]) / "chk-1" / "_metadata"
    foreign.parent.mkdir(parents=True)
    foreign.write_text("someone else's checkpoint")
    h.coordinator.trigger()
    h.cluster.ack_all(1)
    with pytest.raises(CheckpointException, match="already exists") as info:
        h.coordinator.wait_for(1, timeout=0)
    assert info.value.failure_reason is R.FINALIZE_CHECKPOINT_FAILURE
    assert foreign.read_text() == "someone else's checkpoint"
    assert h.coordinator.latest_completed() is None


def test_metadata_write_failure_aborts_and_cleans_up(make_harness: Any) -> None:
    h = make_harness(mode="manual", tolerable_failures=0)
    h.cluster.exclusive_files = False
    blocker = Path(h.job_dir[len("file://") :]) / "chk-1"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("a file where the checkpoint directory should be")
    h.coordinator.trigger()
    h.cluster.ack_all(1)
    with pytest.raises(CheckpointException) as info:
        h.coordinator.wait_for(1, timeout=0)
    assert info.value.failure_reason is R.FINALIZE_CHECKPOINT_FAILURE
    assert "could not write" in str(info.value) and "chk-1/_metadata" in str(info.value)
    assert h.files() == set(), "shared uploads and the broken directory are removed"
    assert len(h.failovers) == 1 and h.failovers[0][0] is R.FINALIZE_CHECKPOINT_FAILURE


# -- waiting, shutdown, restore --------------------------------------------------------------------
def test_wait_for_blocks_until_acks_arrive_on_other_threads(make_harness: Any) -> None:
    h = make_harness(mode="manual")
    h.coordinator.trigger()
    with pytest.raises(CheckpointInProgressError, match=r"still in progress \(0/3"):
        h.coordinator.wait_for(1, timeout=0)
    with pytest.raises(CheckpointNotFoundError, match="checkpoint 42 of job job-1 is unknown"):
        h.coordinator.wait_for(42, timeout=0)
    result: list[Any] = []
    waiter = threading.Thread(target=lambda: result.append(h.coordinator.wait_for(1, timeout=30)))
    waiter.start()
    ackers = [threading.Thread(target=h.cluster.ack, args=(s, 1)) for s in h.cluster.subtasks()]
    for t in ackers:
        t.start()
    for t in ackers + [waiter]:
        t.join(timeout=30)
    assert result and result[0].checkpoint_id == 1


def test_many_threads_acknowledging_complete_exactly_once(make_harness: Any) -> None:
    from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind

    ops = [OperatorSpec("wide", 8, (StateDescriptor("s", StateKind.MAP),))]
    h = make_harness(mode="manual", operators=ops)
    h.coordinator.trigger()
    handles = [h.cluster.snapshot(s, 1) for s in h.cluster.subtasks()]
    outcomes: list[AckOutcome] = []
    lock = threading.Lock()

    def ack(handle: Any) -> None:
        for _ in range(3):  # every ack is sent three times
            outcome = h.coordinator.acknowledge(1, handle)
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=ack, args=(hd,)) for hd in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert outcomes.count(AckOutcome.SUCCESS) == 8 and outcomes.count(AckOutcome.DUPLICATE) == 16
    assert h.cluster.notifications == [(1, True)] and h.metric("numberOfCompletedCheckpoints") == 1


def test_shutdown_aborts_pending_and_refuses_new_triggers(make_harness: Any) -> None:
    h = make_harness(mode="manual", interval_ms=100)
    h.coordinator.start_periodic()
    h.scheduler.advance(100)
    h.cluster.ack(h.cluster.subtasks()[0], 1)
    h.coordinator.shutdown()
    with pytest.raises(CheckpointException) as info:
        h.coordinator.wait_for(1, timeout=0)
    assert info.value.failure_reason is R.CHECKPOINT_COORDINATOR_SHUTDOWN
    assert h.files() == set() and h.failovers == []
    with pytest.raises(CheckpointException) as info:
        h.coordinator.trigger()
    assert info.value.failure_reason is R.CHECKPOINT_COORDINATOR_SHUTDOWN
    h.scheduler.advance(1_000)
    assert len(h.cluster.barriers) == 1
    h.coordinator.shutdown()  # idempotent


def test_restore_latest_and_restore_from_continue_ids(make_harness: Any) -> None:
    h = make_harness()
    assert h.coordinator.restore_latest() is None
    h.coordinator.trigger()
    h.coordinator.trigger()
    h.clock.advance(5)
    meta = h.coordinator.restore_latest()
    assert meta is not None and meta.checkpoint_id == 2
    assert h.metric("lastCheckpointRestoreTimestamp") == h.clock.now_ms()

    # A new JobManager on the same job dir claims the latest checkpoint and continues after it.
    latest = load_completed_checkpoint(h.storage, h.job_dir + "/chk-2")
    h2 = make_harness()
    h2.coordinator.restore_from(latest, claim=True)
    assert h2.coordinator.trigger().checkpoint_id == 3
    assert [c.checkpoint_id for c in h2.coordinator.store.all()] == [3]
    assert {p.split("/")[0] for p in h2.files()} == {"chk-3", "shared"}
    assert h2.files() == referenced_files(h2)
