"""EpochCoordinator: BeginBatch answers, two-phase commits, and durability only through completed checkpoints.

The job model and its CheckpointCoordinator are real (file:// storage, manual clock and
scheduler). The TaskManagers are the process boundary: commits go to a scripted ``commit_on`` and
barriers to the simulated TaskManagers of the checkpoint tests, which snapshot the epoch the job's
slots hold.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from keyedstate.common.batches import Winner
from keyedstate.common.changesets import ChangeSetFile
from keyedstate.common.config import Configuration
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.errors import (
    CheckpointError,
    EpochConflictError,
    EpochGapError,
    InvalidArgumentError,
    JobStateError,
    KeyedStateError,
    UnavailableError,
)
from keyedstate.common.ids import JobId, SubtaskId, TaskManagerId
from keyedstate.common.keygroups import key_group_range_for_subtask
from keyedstate.common.lifecycle import BatchAction, JobStatus
from keyedstate.common.storage import open_storage
from keyedstate.jobmanager.checkpoint import (
    CheckpointCoordinator,
    CheckpointingSettings,
    CheckpointsCleaner,
    CoordinatorConfig,
    CoordinatorServices,
    EpochCut,
    InlineExecutor,
)
from keyedstate.jobmanager.checkpoint import (
    CheckpointFailureReason as R,
)
from keyedstate.jobmanager.epochs.coordinator import EpochCommit, EpochCoordinator
from keyedstate.jobmanager.jobs import Job, JobSpec
from keyedstate.jobmanager.lineage import LineageEntry
from keyedstate.jobmanager.scheduling import SlotAssignment
from tests.fakes.clock import ManualClock
from tests.fakes.scheduler import ManualScheduler
from tests.fixtures.waiting import Call, wait_for
from tests.unit.jobmanager.checkpoint.conftest import JOB, MAX_P, SimulatedTaskManagers

OPERATORS = [OperatorSpec("counts", 2, (StateDescriptor("total", StateKind.VALUE),))]
TM_A, TM_B = "127.0.0.1:7001", "127.0.0.1:7002"
VERSION = 3


class JobTaskManagers(SimulatedTaskManagers):
    """The simulated TaskManagers, cut at the epoch the job's slots hold (as the real gateway does)."""

    job: Job | None = None
    barrier_ms = 0  # how long delivering a barrier takes on the manual clock
    clock: ManualClock | None = None

    @contextmanager
    def cut(self) -> Iterator[EpochCut]:
        assert self.job is not None
        with self.job.epoch_lock:
            with self.job.lock:
                self.committed_epoch = self.job.committed_epoch
                cut = EpochCut(self.job.committed_epoch, self.job.lineage)
            yield cut

    def send_barrier(self, barrier: Any) -> None:
        if self.barrier_ms and self.clock is not None:
            self.clock.advance(self.barrier_ms)
        super().send_barrier(barrier)


@dataclass
class TaskManagers:
    """``commit_on``: each TaskManager's answer to a prepare or an apply, scripted per test."""

    job: Job
    calls: list[tuple[str, str, int]] = field(default_factory=list)  # (address, "prepare"|"apply", epoch)
    refuse: dict[tuple[str, str], KeyedStateError] = field(default_factory=dict)
    during: dict[tuple[str, str], Callable[[], object]] = field(default_factory=dict)

    def __call__(
        self,
        address: str,
        *,
        job_id: JobId,
        epoch: int,
        winners: Sequence[Winner],
        routing_version: int,
        prepare: bool,
        upload_change_set: bool = False,
    ) -> list[ChangeSetFile]:
        phase = "prepare" if prepare else "apply"
        assert routing_version == VERSION and job_id == JOB
        self.calls.append((address, phase, epoch))
        action = self.during.get((address, phase))
        if action is not None:
            action()
        error = self.refuse.get((address, phase))
        if error is not None:
            raise error
        return []


@dataclass
class Harness:
    job: Job
    coordinator: CheckpointCoordinator
    tms: TaskManagers
    cluster: JobTaskManagers
    epochs: EpochCoordinator
    clock: ManualClock
    scheduler: ManualScheduler
    closed: threading.Event
    failovers: list[tuple[str, bool, bool]]  # cause, job lock held, epoch lock held

    def commit(
        self,
        epoch: int,
        *,
        batch_id: int | None = None,
        query: str = "q1",
        version: int = VERSION,
        wait: bool = False,
        checkpoint: bool = False,
        timeout_ms: int = 5_000,
    ) -> Any:
        return self.epochs.commit(
            EpochCommit(
                job_id=JOB,
                epoch=epoch,
                query_id=query,
                batch_id=epoch if batch_id is None else batch_id,
                winners=[Winner(partition=0, attempt=1)],
                routing_version=version,
                checkpoint=checkpoint,
                wait_for_checkpoint=wait,
                timeout_ms=timeout_ms,
            )
        )

    def commit_epochs(self, upto: int, query: str = "q1") -> None:
        for e in range(self.job.committed_epoch + 1, upto + 1):
            self.commit(e, query=query)


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    pools: list[ThreadPoolExecutor] = []
    made: list[Harness] = []

    def factory(**settings: Any) -> Harness:
        clock = ManualClock()
        scheduler = ManualScheduler(clock)
        storage = open_storage(tmp_path.as_uri())
        job_dir = (tmp_path / "checkpoints" / JOB).as_uri()
        spec = JobSpec(JOB, tuple(OPERATORS), MAX_P)
        job = Job(spec, Configuration({}), status=JobStatus.RUNNING, routing_version=VERSION)
        for i, address in enumerate((TM_A, TM_B)):
            subtask = SubtaskId(JOB, "counts", i)
            job.assignments[subtask] = SlotAssignment(
                subtask, key_group_range_for_subtask(MAX_P, 2, i), TaskManagerId(f"tm-{i}"), address, 0
            )
        cluster = JobTaskManagers(storage, job_dir, OPERATORS, mode=settings.pop("mode", "ack"))
        cluster.job, cluster.clock = job, clock
        coordinator = CheckpointCoordinator(
            CoordinatorConfig(
                JobId(JOB), job_dir, MAX_P, CheckpointingSettings(**{"tolerable_failures": 100, **settings})
            ),
            CoordinatorServices(
                storage, cluster, clock, scheduler, cleaner=CheckpointsCleaner(storage, InlineExecutor())
            ),
            operators=OPERATORS,
        )
        cluster.coordinator = coordinator
        job.coordinator = coordinator
        tms = TaskManagers(job)
        failovers: list[tuple[str, bool, bool]] = []

        def fail_over_now(j: Job, cause: str) -> None:
            failovers.append((cause, j.lock._is_owned(), j.epoch_lock.locked()))  # type: ignore[attr-defined]
            j.move_to(JobStatus.RESTARTING)
            j.routing_version += 1
            j.failure_cause = cause
            assert j.coordinator is not None
            j.coordinator.abort_pending(R.JOB_FAILOVER_REGION, cause)

        pool = ThreadPoolExecutor(4)
        pools.append(pool)
        closed = threading.Event()
        epochs = EpochCoordinator(
            lambda job_id: job, tms, pool, fail_over_now, clock, closed, default_timeout_ms=60_000
        )
        h = Harness(job, coordinator, tms, cluster, epochs, clock, scheduler, closed, failovers)
        made.append(h)
        return h

    yield factory
    for h in made:
        h.closed.set()
        h.coordinator.shutdown()
    for pool in pools:
        pool.shutdown(wait=False)


# -- BeginBatch ------------------------------------------------------------------------------------
def test_begin_batch_runs_the_next_epoch_and_only_makes_a_committed_one_durable(make: Callable[..., Harness]) -> None:
    h = make()
    start = h.epochs.begin_batch(JOB, "q1", 0)
    assert (start.action, start.epoch, start.committed_epoch, start.durable_epoch) == (BatchAction.RUN, 0, -1, -1)
    assert start.routing.version == VERSION and start.job_status is JobStatus.RUNNING
    h.commit_epochs(2)
    assert h.epochs.begin_batch(JOB, "q1", 3).action is BatchAction.RUN
    for batch in (0, 2):
        again = h.epochs.begin_batch(JOB, "q1", batch)
        assert (again.action, again.epoch, again.committed_epoch) == (BatchAction.ALREADY_COMMITTED, batch, 2)


@pytest.mark.parametrize(
    "status, action",
    [
        (JobStatus.CREATED, BatchAction.WAIT),
        (JobStatus.RESTARTING, BatchAction.WAIT),
        (JobStatus.FAILED, BatchAction.STOP),
        (JobStatus.CANCELED, BatchAction.STOP),
    ],
)
def test_begin_batch_asks_to_wait_or_stop_while_the_job_is_not_running(
    make: Callable[..., Harness], status: JobStatus, action: BatchAction
) -> None:
    h = make()
    h.job.status, h.job.failure_cause = status, "TaskManager tm-1 lost"
    start = h.epochs.begin_batch(JOB, "q1", 7)  # not even a gap is reported then
    assert (start.action, start.epoch, start.job_status, start.failure_cause) == (
        action,
        -1,
        status,
        "TaskManager tm-1 lost",
    )


def test_begin_batch_refuses_a_gap_naming_the_epochs_missing_and_the_ways_out(make: Callable[..., Harness]) -> None:
    h = make()
    h.commit_epochs(2)
    with pytest.raises(EpochGapError) as info:
        h.epochs.begin_batch(JOB, "q1", 5)
    assert info.value.message == (
        "job 'job-1': batch 5 is epoch 5, but the job's state holds epoch 2, so epochs 3..4 are missing from it (an "
        "older checkpoint or savepoint was restored, or the newest checkpoint was lost). Nothing was applied. Restore a "
        "checkpoint that holds epoch 4 (statectl checkpoint list; statectl job restore), or start the query from a new "
        "checkpointLocation"
    )
    h.job.predecessor = "job 'job-1' was cancelled; its latest checkpoint is file:///ckpt/job-1/chk-9"
    with pytest.raises(
        EpochGapError,
        match=r"checkpointLocation\. job 'job-1' was cancelled; its latest checkpoint is file:///ckpt/job-1/chk-9$",
    ):
        h.epochs.begin_batch(JOB, "q1", 5)
    with pytest.raises(
        EpochGapError, match="^job 'job-1': query q9 is at batch 1, but the job's state holds epoch 2 \\(of query q1\\)"
    ):
        h.epochs.begin_batch(JOB, "q9", 1)
    with pytest.raises(InvalidArgumentError, match="batch_id must be >= 0"):
        h.epochs.begin_batch(JOB, "q1", -1)


def test_a_new_query_binds_at_batch_0_only_by_its_commit(make: Callable[..., Harness]) -> None:
    h = make()
    h.commit_epochs(1)
    for _ in range(2):  # asking twice binds nothing
        start = h.epochs.begin_batch(JOB, "q2", 0)
        assert (start.action, start.epoch) == (BatchAction.RUN, 2)
    assert [e.query_id for e in h.job.lineage.entries] == ["q1"]
    h.commit(2, batch_id=0, query="q2")
    assert h.job.lineage.entries == (LineageEntry("q1", 0, 0), LineageEntry("q2", 2, 2))
    assert h.epochs.begin_batch(JOB, "q2", 1).epoch == 3
    with pytest.raises(EpochGapError, match="has moved on from query q1 to query q2 \\(since epoch 2\\)"):
        h.epochs.begin_batch(JOB, "q1", 2)


# -- CommitEpoch -----------------------------------------------------------------------------------
def test_a_commit_prepares_on_every_taskmanager_before_applying_on_any(make: Callable[..., Harness]) -> None:
    h = make()
    outcome = h.commit(0)
    assert sorted(h.tms.calls[:2]) == [(TM_A, "prepare", 0), (TM_B, "prepare", 0)]
    assert sorted(h.tms.calls[2:]) == [(TM_A, "apply", 0), (TM_B, "apply", 0)]
    assert (outcome.committed_epoch, outcome.already_committed, outcome.checkpoint) == (0, False, None)
    assert (h.job.committed_epoch, h.job.lineage.entries) == (0, (LineageEntry("q1", 0, 0),))


@pytest.mark.parametrize(
    "error",
    [
        EpochConflictError(
            "partition 0 attempt 1 of epoch 0 had 2 write request(s) acknowledged by job-1/counts/1, but 1 are staged here"
        ),
        UnavailableError("this TaskManager stopped serving (no heartbeat answered by the JobManager within the lease)"),
    ],
)
def test_a_refused_prepare_applies_nothing_anywhere_and_the_batch_runs_again(
    make: Callable[..., Harness], error: KeyedStateError
) -> None:
    h = make()
    h.tms.refuse[(TM_B, "prepare")] = error
    with pytest.raises(EpochConflictError) as info:
        h.commit(0)
    assert info.value.message == (
        f"job 'job-1': epoch 0 was refused by TaskManager {TM_B} before anything was applied ({error.message}); run "
        "the batch again"
    )
    assert [c for c in h.tms.calls if c[1] == "apply"] == []
    assert (h.job.committed_epoch, h.job.status, h.failovers) == (-1, JobStatus.RUNNING, [])
    h.tms.refuse.clear()
    assert h.commit(0).committed_epoch == 0  # the batch again


def test_slots_that_disagree_about_the_epoch_fail_the_job_over_before_anything_applies(
    make: Callable[..., Harness],
) -> None:
    h = make()
    h.tms.refuse[(TM_A, "prepare")] = EpochGapError("job-1/counts/0 holds epoch -1, so epoch 0 ...")
    with pytest.raises(
        JobStateError,
        match=f"^job 'job-1': preparing epoch 0 failed on TaskManager {TM_A}: .*; the job restarts from its latest checkpoint$",
    ):
        h.commit(0)
    assert [c for c in h.tms.calls if c[1] == "apply"] == []
    assert h.failovers == [
        (f"preparing epoch 0 failed on TaskManager {TM_A}: job-1/counts/0 holds epoch -1, so epoch 0 ...", True, True)
    ]


def test_a_partial_apply_fails_the_job_over_while_no_checkpoint_can_cut(make: Callable[..., Harness]) -> None:
    h = make()
    h.tms.refuse[(TM_B, "apply")] = UnavailableError("connection reset")
    with pytest.raises(JobStateError) as info:
        h.commit(0)
    assert info.value.message == (
        f"job 'job-1': commit of epoch 0 failed on TaskManager {TM_B}: connection reset; the job restarts from its "
        "latest checkpoint and the batch runs again"
    )
    # The failover started under the job's lock and before the epoch lock was released.
    assert h.failovers == [(f"commit of epoch 0 failed on TaskManager {TM_B}: connection reset", True, True)]
    assert h.job.committed_epoch == -1 and h.job.status is JobStatus.RESTARTING
    assert h.epochs.begin_batch(JOB, "q1", 0).action is BatchAction.WAIT


def test_a_commit_under_a_routing_version_that_moved_is_refused_before_any_taskmanager_call(
    make: Callable[..., Harness],
) -> None:
    h = make()
    with pytest.raises(EpochConflictError) as info:
        h.commit(0, version=VERSION - 1)
    assert info.value.message == (
        f"job 'job-1' was redeployed while epoch 0 ran (routing v{VERSION - 1} -> v{VERSION}); its staged writes are "
        "gone: run the batch again"
    )
    assert h.tms.calls == []


def test_a_redeploy_during_the_prepare_round_stops_the_commit(make: Callable[..., Harness]) -> None:
    h = make()

    def redeploy() -> None:
        with h.job.lock:
            h.job.routing_version += 1
            h.job.move_to(JobStatus.RESTARTING)
            h.job.failure_cause = "TaskManager tm-1 lost"

    h.tms.during[(TM_B, "prepare")] = redeploy
    with pytest.raises(
        EpochConflictError,
        match=(
            f"^job 'job-1' is RESTARTING under routing v{VERSION + 1} since the commit of epoch 0 began \\(v{VERSION}\\): "
            "TaskManager tm-1 lost; run the batch again$"
        ),
    ):
        h.commit(0)
    assert [c for c in h.tms.calls if c[1] == "apply"] == [] and h.job.committed_epoch == -1


def test_a_commit_for_an_epoch_the_batch_no_longer_is_refused(make: Callable[..., Harness]) -> None:
    h = make()
    h.commit_epochs(3)
    h.job.set_epochs(1, h.job.lineage)  # a restore of an older checkpoint
    with pytest.raises(EpochConflictError, match="^job 'job-1': batch 2 is epoch 2 now, not 4 \\(the job restored"):
        h.commit(4, batch_id=2)
    with pytest.raises(EpochGapError, match="batch 4 is epoch 4, but the job's state holds epoch 1"):
        h.commit(4)
    assert h.tms.calls[-1][2] == 3  # nothing was sent for either


def test_an_already_committed_batch_is_not_applied_again(make: Callable[..., Harness]) -> None:
    h = make()
    h.commit(0)
    sent = len(h.tms.calls)
    outcome = h.commit(0)
    assert (outcome.committed_epoch, outcome.already_committed) == (0, True)
    assert len(h.tms.calls) == sent
    # Even under a routing version that moved since: it is in the state already.
    h.job.routing_version += 1
    assert h.commit(0).already_committed


@pytest.mark.parametrize("status", [JobStatus.RESTARTING, JobStatus.FAILED, JobStatus.CANCELED])
def test_a_commit_needs_a_running_job(make: Callable[..., Harness], status: JobStatus) -> None:
    h = make()
    h.job.status, h.job.failure_cause = status, "TaskManager tm-1 lost"
    with pytest.raises(JobStateError, match=f"^job 'job-1' is {status.value}"):
        h.commit(0)
    assert h.tms.calls == []


def test_a_commit_needs_an_epoch_and_a_routing_version(make: Callable[..., Harness]) -> None:
    h = make()
    with pytest.raises(InvalidArgumentError, match="expected_routing_version is required"):
        h.commit(0, version=0)
    with pytest.raises(InvalidArgumentError, match="epoch must be >= 0"):
        h.commit(-1, batch_id=0)


# -- durability ------------------------------------------------------------------------------------
def test_the_answer_is_a_completed_checkpoint_holding_the_epoch(make: Callable[..., Harness]) -> None:
    h = make()
    h.commit(0)
    h.coordinator.trigger()  # a checkpoint of epoch 0 ...
    outcome = h.commit(1, wait=True, checkpoint=True)  # ... is not one of epoch 1
    assert outcome.checkpoint is not None
    assert (outcome.checkpoint.checkpoint_id, outcome.checkpoint.metadata.epoch) == (2, 1)
    assert h.job.durable_epoch() == 1
    # Asked again: the latest completed one holds it, no new checkpoint.
    again = h.commit(1, wait=True, checkpoint=True)
    assert again.already_committed and again.checkpoint.checkpoint_id == 2 and len(h.cluster.barriers) == 2


def test_a_failed_checkpoint_is_retried_until_one_completes(make: Callable[..., Harness]) -> None:
    h = make(mode="decline")
    h.commit(0)
    outcomes: list[Any] = []

    def fix_after_two(barrier: Any) -> None:
        if len(h.cluster.barriers) == 2:
            h.cluster.mode = "ack"

    original = h.cluster.send_barrier

    def send(barrier: Any) -> None:
        fix_after_two(barrier)
        original(barrier)

    h.cluster.send_barrier = send  # type: ignore[method-assign]
    call = Call(lambda: h.epochs.ensure_durable(h.job, 0, "q1", 0, True, 60_000))
    _advance_retry_pauses(h, 2)
    outcome = call.outcome()
    outcomes.append(outcome)
    assert outcome.checkpoint_id == 3 and outcome.metadata.epoch == 0
    assert [e.status for e in reversed(h.coordinator.stats.history())] == ["FAILED", "FAILED", "COMPLETED"]


def test_no_completed_checkpoint_by_the_deadline_raises_naming_the_last_failure(make: Callable[..., Harness]) -> None:
    h = make(mode="decline")
    h.cluster.barrier_ms = 1_000  # each attempt takes a second on the manual clock
    h.commit(0)
    call = Call(lambda: h.epochs.ensure_durable(h.job, 0, "q1", 0, True, 2_500))
    _advance_retry_pauses(h, 3)  # declined at 1.0 s, 2.2 s and 3.4 s on the manual clock; past the deadline after
    with pytest.raises(CheckpointError) as info:
        call.outcome()
    assert info.value.message == (
        "job 'job-1': epoch 0 is committed but no checkpoint holding it completed within 2500 ms (last failure: "
        "CHECKPOINT_DECLINED: subtask job-1/counts/1 declined checkpoint 3: RocksDB snapshot failed: disk full); call "
        "again to keep waiting"
    )
    assert h.job.committed_epoch == 0  # still committed: a later call may make it durable


def _advance_retry_pauses(h: Harness, pauses: int) -> None:
    """Let ``pauses`` declined checkpoints be tried again: the pause runs on the coordinator's manual scheduler."""
    for declined in range(1, pauses + 1):
        wait_for(lambda: h.scheduler.pending() == [200], 10, f"the pause after declined checkpoint {declined}")
        assert len(h.cluster.barriers) == declined
        h.scheduler.advance(200)


def test_a_rollback_below_the_epoch_while_waiting_means_the_batch_runs_again(make: Callable[..., Harness]) -> None:
    h = make(mode="manual")
    h.commit_epochs(1)
    call = Call(lambda: h.epochs.ensure_durable(h.job, 1, "q1", 1, True, 60_000))
    wait_for(lambda: len(h.cluster.barriers) == 1, 10, "the checkpoint of epoch 1 triggered")
    with h.job.lock:  # a failover restored a checkpoint of epoch 0
        h.job.failure_cause = "TaskManager tm-1 lost"
        h.job.set_epochs(0, h.job.lineage)
    h.coordinator.abort_pending(R.JOB_FAILOVER_REGION, "TaskManager tm-1 lost")
    with pytest.raises(EpochConflictError) as info:
        call.outcome()
    assert info.value.message == (
        "job 'job-1' restored a checkpoint that holds epoch 0, from before epoch 1 was durable (TaskManager tm-1 "
        "lost); run the batch again"
    )


def test_a_checkpoint_in_flight_from_before_the_commit_is_waited_for_then_one_holding_the_epoch_is_taken(
    make: Callable[..., Harness],
) -> None:
    h = make(mode="manual")
    h.commit(0)
    h.coordinator.trigger()  # cut at epoch 0, in flight
    h.commit(1)
    call = Call(lambda: h.epochs.ensure_durable(h.job, 1, "q1", 1, True, 60_000))
    h.cluster.ack_all(1)
    wait_for(lambda: len(h.cluster.barriers) == 2, 10, "a checkpoint of epoch 1 triggered")
    assert h.cluster.barriers[1].epoch == 1
    h.cluster.ack_all(2)
    assert call.outcome().checkpoint_id == 2


def test_an_in_flight_checkpoint_holding_the_epoch_answers_without_waiting_the_minimum_pause(
    make: Callable[..., Harness],
) -> None:
    h = make(mode="manual", min_pause_ms=60_000)
    h.commit(0)
    h.coordinator.trigger()  # a periodic checkpoint cut right after the commit: it holds epoch 0
    call = Call(lambda: h.epochs.ensure_durable(h.job, 0, "q1", 0, True, 120_000))
    wait_for(lambda: h.coordinator.pending_checkpoints()[0].num_acknowledged == 0, 10, "checkpoint 1 in flight")
    h.cluster.ack_all(1)
    try:
        assert call.outcome(timeout_s=3).checkpoint_id == 1
        assert len(h.cluster.barriers) == 1
    finally:
        h.closed.set()
        h.scheduler.advance(60_000)


def test_two_drivers_committing_one_batch_apply_it_once(make: Callable[..., Harness]) -> None:
    h = make()
    release = threading.Event()
    h.tms.during[(TM_A, "prepare")] = lambda: release.wait(10) and None  # the first commit holds the epoch lock
    first = Call(lambda: h.commit(0))
    wait_for(lambda: (TM_A, "prepare", 0) in h.tms.calls, 10, "the first commit's prepare round")
    second = Call(
        lambda: h.epochs.commit(
            EpochCommit(
                job_id=JOB,
                epoch=0,
                query_id="q1",
                batch_id=0,
                winners=[Winner(partition=0, attempt=2)],
                routing_version=VERSION,
                checkpoint=False,
                wait_for_checkpoint=False,
            )
        )
    )
    h.tms.during.clear()
    release.set()
    outcomes = sorted([first.outcome(), second.outcome()], key=lambda o: o.already_committed)
    assert [(o.committed_epoch, o.already_committed) for o in outcomes] == [(0, False), (0, True)]
    assert sorted(c for c in h.tms.calls if c[1] == "apply") == [(TM_A, "apply", 0), (TM_B, "apply", 0)]


def test_a_batch_committed_without_its_own_checkpoint_needs_periodic_checkpoints(make: Callable[..., Harness]) -> None:
    h = make()
    with pytest.raises(InvalidArgumentError) as info:
        h.commit(0, wait=True, checkpoint=False)
    assert info.value.message == (
        "job 'job-1' takes no periodic checkpoints, so a batch committed without a checkpoint of its own never becomes "
        "durable: set execution.checkpointing.interval, or let each batch take its checkpoint"
    )
    assert h.job.committed_epoch == 0 and h.cluster.barriers == []  # committed, just not durable yet


def test_a_batch_committed_without_its_own_checkpoint_is_answered_by_the_next_periodic_one(
    make: Callable[..., Harness],
) -> None:
    h = make(interval_ms=1_000)
    assert h.coordinator.start_periodic()
    call = Call(lambda: h.commit(0, wait=True, checkpoint=False))
    wait_for(lambda: h.job.committed_epoch == 0, 10, "the commit")
    assert h.cluster.barriers == []
    h.scheduler.advance(1_000)  # the periodic checkpoint, cut after the commit
    outcome = call.outcome()
    assert outcome.checkpoint.checkpoint_id == 1 and outcome.checkpoint.metadata.epoch == 0
    assert len(h.cluster.barriers) == 1


def test_a_commit_that_does_not_wait_still_triggers_its_checkpoint(make: Callable[..., Harness]) -> None:
    h = make(mode="manual")
    outcome = h.commit(0, wait=False, checkpoint=True)
    assert outcome.checkpoint is None
    assert [b.epoch for b in h.cluster.barriers] == [0]
    # A second one while it is in flight is not an error.
    h.commit_epochs(1)
    assert h.commit(2, wait=False, checkpoint=True).committed_epoch == 2
    assert len(h.cluster.barriers) == 1
