"""The JobManager's side of exactly-once epochs: where a batch stands, commits, durability.

One :class:`EpochCoordinator` serves every job of the JobManager. Its three steps follow
docs/exactly-once.md:

* :meth:`EpochCoordinator.begin_batch` tells the driver the job epoch of a Spark batch and what
  to do with it (run it, only make it durable, wait, or stop), or refuses a batch that would
  skip epochs (``EpochGapError``).
* :meth:`EpochCoordinator.commit` applies a batch on every TaskManager of the job in two rounds
  (prepare everywhere, then apply everywhere), under the job's lock so that no checkpoint cut
  sees half an epoch; a failed apply fails the job over before the lock is released.
* :meth:`EpochCoordinator.ensure_durable` answers only once a *completed* checkpoint holds the
  epoch: it triggers one, waits for one in flight or for the minimum pause instead of failing,
  and retries failed ones until the job rolls back (the batch then runs again) or the deadline
  passes. Nothing here takes a checkpoint that did not complete as a success.

With ``execution.checkpointing.commit-mode: overlapped`` (docs/exactly-once.md, "Overlapped
commits") a commit prepares with change sets, writes the epoch's decision create-only and answers
DECIDED; the apply runs in the background still holding the job's epoch lock (the next commit
and every checkpoint cut wait for it), then a checkpoint at the newest applied epoch follows,
and the change sets and decisions it covers are deleted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import NoReturn, Protocol

from keyedstate.common.batches import Winner
from keyedstate.common.changesets import ChangeSetFile
from keyedstate.common.clock import Clock
from keyedstate.common.errors import (
    CheckpointError,
    EpochConflictError,
    EpochGapError,
    InvalidArgumentError,
    JobStateError,
    KeyedStateError,
    UnavailableError,
)
from keyedstate.common.faults import crash_point
from keyedstate.common.ids import JobId, SubtaskId
from keyedstate.common.lifecycle import BatchAction, JobStatus
from keyedstate.jobmanager.checkpoint.completed import CompletedCheckpoint
from keyedstate.jobmanager.checkpoint.coordinator import CheckpointCoordinator
from keyedstate.jobmanager.checkpoint.decisions import Decision, DecisionLog
from keyedstate.jobmanager.checkpoint.failure import CheckpointException
from keyedstate.jobmanager.jobs import Job, RoutingTable

logger = logging.getLogger(__name__)

_POLL_S = 0.1


@dataclass(frozen=True)
class BatchStart:
    """Where one Spark batch stands (the answer to BeginBatch)."""

    action: BatchAction
    epoch: int
    committed_epoch: int
    durable_epoch: int
    job_status: JobStatus
    failure_cause: str
    routing: RoutingTable


@dataclass(frozen=True)
class EpochCommit:
    """One commit request: a batch's epoch, its winners (with ledgers) and what to wait for."""

    job_id: JobId
    epoch: int
    query_id: str
    batch_id: int
    winners: Sequence[Winner]
    routing_version: int
    checkpoint: bool = True
    """Trigger a checkpoint containing the epoch (False: wait for a periodic one)."""
    wait_for_checkpoint: bool = True
    timeout_ms: int = 0


@dataclass(frozen=True)
class CommitOutcome:
    committed_epoch: int
    already_committed: bool
    checkpoint: CompletedCheckpoint | None
    """The completed checkpoint holding the epoch (None when not waited for)."""
    decided: bool = False
    """Overlapped commits: the epoch is decided (durable) and the driver may return."""


class EpochCommitSender(Protocol):
    """Sends one round of an epoch commit to the TaskManager at ``address`` (the TaskManager gateway)."""

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
        """Prepare (``prepare``: only check) or apply ``epoch`` on every slot of the job there; raises if refused.

        ``upload_change_set``: the prepare also writes each slot's change set; the files written."""


class EpochCoordinator:
    """Begins, commits and makes durable the epochs of every job (see the module docstring)."""

    def __init__(
        self,
        jobs: Callable[[JobId], Job],
        commit_on: EpochCommitSender,
        executor: Executor,
        fail_over_now: Callable[[Job, str], None],
        clock: Clock,
        closed: threading.Event,
        default_timeout_ms: int,
        decisions: Callable[[Job], DecisionLog | None] = lambda job: None,
    ) -> None:
        """``commit_on(address, ...)`` sends one round of an epoch commit to one TaskManager;
        ``fail_over_now(job, cause)`` starts a failover (the caller holds the job's lock);
        ``decisions(job)`` is the job's decision log when it commits overlapped (else None)."""
        self._decisions = decisions
        self._jobs = jobs
        self._commit_on = commit_on
        self._executor = executor
        self._fail_over_now = fail_over_now
        self._clock = clock
        self._closed = closed
        self._default_timeout_ms = default_timeout_ms

    # -- begin -------------------------------------------------------------------------------
    def begin_batch(self, job_id: JobId, query_id: str, batch_id: int) -> BatchStart:
        """Where batch ``batch_id`` of ``query_id`` stands: run it, only make it durable, wait, or stop.

        Raises EpochGapError when the job's state cannot take the batch next (epochs would be skipped).
        """
        if batch_id < 0:
            raise InvalidArgumentError(f"batch_id must be >= 0 (the Spark batch id), got {batch_id}")
        job = self._jobs(job_id)
        with job.lock:
            durable = job.durable_epoch()

            def answer(action: BatchAction, epoch: int = -1) -> BatchStart:
                return BatchStart(
                    action,
                    epoch,
                    job.committed_epoch,
                    durable,
                    job.status,
                    job.failure_cause,
                    job.routing_table(),
                )

            if job.status.terminal:
                return answer(BatchAction.STOP)
            if job.status is not JobStatus.RUNNING:
                return answer(BatchAction.WAIT)
            epoch = self._epoch_of(job, query_id, batch_id)
            if epoch <= job.committed_epoch:
                return answer(BatchAction.ALREADY_COMMITTED, epoch)
            return answer(BatchAction.RUN, epoch)

    def _epoch_of(self, job: Job, query_id: str, batch_id: int) -> int:
        """The batch's job epoch; EpochGapError if the state cannot take it next (caller holds the lock)."""
        try:
            epoch = job.lineage.epoch_of(query_id, batch_id, job.committed_epoch)
        except EpochGapError as exc:
            raise EpochGapError(f"job {job.job_id!r}: {exc.message}{_predecessor_hint(job)}") from None
        if epoch > job.committed_epoch + 1:
            raise EpochGapError(
                f"job {job.job_id!r}: batch {batch_id} is epoch {epoch}, but the job's state holds epoch "
                f"{job.committed_epoch}, so epochs {job.committed_epoch + 1}..{epoch - 1} are missing from it (an older "
                "checkpoint or savepoint was restored, or the newest checkpoint was lost). Nothing was applied. Restore a "
                f"checkpoint that holds epoch {epoch - 1} (statectl checkpoint list; statectl job restore), or start "
                f"the query from a new checkpointLocation{_predecessor_hint(job)}"
            )
        return epoch

    # -- commit ------------------------------------------------------------------------------
    def commit(self, request: EpochCommit) -> CommitOutcome:
        """Apply the batch's winners as its epoch (once), then wait for a checkpoint holding it if asked."""
        if request.epoch < 0:
            raise InvalidArgumentError(f"epoch must be >= 0 (from BeginBatch), got {request.epoch}")
        if request.routing_version <= 0:
            raise InvalidArgumentError(
                "expected_routing_version is required: send the routing version the batch ran under (BeginBatch)"
            )
        job = self._jobs(request.job_id)
        log = self._decisions(job)
        if log is not None:
            return self._commit_overlapped(job, request, log)
        with job.epoch_lock:
            with job.lock:
                epoch = self._request_epoch(job, request)
                already = epoch <= job.committed_epoch
                if not already and request.routing_version != job.routing_version:
                    raise EpochConflictError(
                        f"job {job.job_id!r} was redeployed while epoch {epoch} ran (routing v{request.routing_version} "
                        f"-> v{job.routing_version}); its staged writes are gone: run the batch again"
                    )
                addresses = sorted({a.address for a in job.assignments.values()})
            if not already:
                self._apply(job, addresses, epoch, request)
        if not request.wait_for_checkpoint or job.coordinator is None:
            if request.checkpoint and job.coordinator is not None:
                self._trigger_quietly(job, job.coordinator)
            return CommitOutcome(epoch, already, None)
        timeout = request.timeout_ms or self._default_timeout_ms
        completed = self.ensure_durable(job, epoch, request.query_id, request.batch_id, request.checkpoint, timeout)
        return CommitOutcome(epoch, already, completed)

    def _request_epoch(self, job: Job, request: EpochCommit) -> int:
        """The epoch of the request's batch (caller holds ``job.lock``); refused unless the job runs and it is the
        epoch the batch began with."""
        _require_running(job)
        epoch = self._epoch_of(job, request.query_id, request.batch_id)
        if epoch != request.epoch:
            raise EpochConflictError(
                f"job {job.job_id!r}: batch {request.batch_id} is epoch {epoch} now, not {request.epoch} (the "
                "job restored a checkpoint since the batch began); run the batch again"
            )
        return epoch

    # -- overlapped commits ------------------------------------------------------------------
    def _commit_overlapped(self, job: Job, request: EpochCommit, log: DecisionLog) -> CommitOutcome:
        """Prepare with change sets, decide, answer; the apply goes on in the background holding the epoch lock."""
        job.epoch_lock.acquire()
        handed_off = False
        try:
            with job.lock:
                epoch = self._request_epoch(job, request)
                if epoch <= job.committed_epoch:
                    # Decided before (or restored from a checkpoint or decisions holding it): durable.
                    return CommitOutcome(epoch, True, None, decided=True)
                if request.routing_version != job.routing_version:
                    raise EpochConflictError(
                        f"job {job.job_id!r} was redeployed while epoch {epoch} ran (routing v{request.routing_version} "
                        f"-> v{job.routing_version}); its staged writes are gone: run the batch again"
                    )
                addresses = sorted({a.address for a in job.assignments.values()})
                subtasks = set(job.assignments)
            self._decide(job, addresses, subtasks, epoch, request, log)
            applier = threading.Thread(
                target=self._apply_decided,
                args=(job, addresses, epoch, request, log),
                name=f"apply-{job.job_id}-{epoch}",
                daemon=True,
            )
            applier.start()
            handed_off = True  # the applier releases the epoch lock
        finally:
            if not handed_off:
                job.epoch_lock.release()
        return CommitOutcome(epoch, False, None, decided=True)

    def _decide(
        self,
        job: Job,
        addresses: list[str],
        subtasks: set[SubtaskId],
        epoch: int,
        commit: EpochCommit,
        log: DecisionLog,
    ) -> None:
        """Prepare everywhere with change sets, then write the decision; the epoch is the job's once this returns."""
        version = commit.routing_version
        answers, refused = self._round(addresses, job.job_id, epoch, commit, prepare=True, upload=True)
        with job.lock:
            self._still_current(job, epoch, version)
            if refused:
                self._refused_prepare(job, epoch, refused)
        files = [f for written in answers for f in written]
        named = {(f.operator_id, f.subtask_index) for f in files if f.epoch == epoch}
        missing = sorted(
            f"{s.operator_id}/{s.subtask_index}" for s in subtasks if (s.operator_id, s.subtask_index) not in named
        )
        if missing or len(files) != len(subtasks):
            raise EpochConflictError(
                f"job {job.job_id!r}: epoch {epoch} was prepared, but the change sets of {', '.join(missing) or 'some slots'} "
                f"did not come back ({len(files)} for {len(subtasks)} subtasks); nothing was decided: run the batch again"
            )
        crash_point("jobmanager.epoch.before-decision")
        decision = Decision.of(epoch, commit.query_id, commit.batch_id, version, commit.winners, files)
        try:
            log.decide(decision)
        except EpochConflictError:
            raise  # DecisionRaceError: a restore sealed the epoch; nothing was decided
        except (KeyedStateError, OSError) as exc:
            # The write may have landed or not: only a restore (which seals) can tell.
            cause = f"writing the decision of epoch {epoch} failed, its outcome is unknown: {exc}"
            with job.lock:
                if job.status is JobStatus.RUNNING and job.routing_version == version:
                    self._fail_over_now(job, cause)
            raise JobStateError(
                f"job {job.job_id!r}: {cause}; the job restarts from its latest checkpoint and the decisions above it"
            ) from exc
        crash_point("jobmanager.epoch.decided")
        with job.lock:
            # A failover since the prepare restored (and sealed) on its own: whether it replays this
            # decision or not, the driver learns where the batch stands from BeginBatch again.
            self._still_current(job, epoch, version)
            job.set_epochs(epoch, job.lineage.bind(commit.query_id, commit.batch_id, epoch), applying=True)
        logger.info(
            "job=%s epoch=%d decided (batch %d, %d partitions, %d change sets, routing v%d)",
            job.job_id,
            epoch,
            commit.batch_id,
            len(commit.winners),
            len(files),
            version,
        )

    def _refused_prepare(self, job: Job, epoch: int, refused: list[tuple[str, KeyedStateError]]) -> NoReturn:
        """Raise for a refused prepare round (caller holds ``job.lock``); fails the job over when only a restore helps."""
        address, error = refused[0]
        if all(isinstance(e, (EpochConflictError, UnavailableError)) for _, e in refused):
            raise EpochConflictError(
                f"job {job.job_id!r}: epoch {epoch} was refused by TaskManager {address} before anything was "
                f"applied ({error.message}); run the batch again"
            ) from error
        # The slots disagree with the JobManager about the job's epochs: only a restore makes them agree.
        cause = f"preparing epoch {epoch} failed on TaskManager {address}: {error.message}"
        self._fail_over_now(job, cause)
        raise JobStateError(f"job {job.job_id!r}: {cause}; the job restarts from its latest checkpoint") from error

    def _apply_decided(self, job: Job, addresses: list[str], epoch: int, commit: EpochCommit, log: DecisionLog) -> None:
        """Apply a decided epoch everywhere, then release the epoch lock; a failed apply fails the job over
        (the restore replays the epoch from its change sets). Then a checkpoint at the newest applied epoch."""
        version = commit.routing_version
        applied = False
        try:
            crash_point("jobmanager.epoch.before-apply")
            _, failed = self._round(addresses, job.job_id, epoch, commit, prepare=False, upload=False)
            with job.lock:
                if failed:
                    address, error = failed[0]
                    cause = f"applying decided epoch {epoch} failed on TaskManager {address}: {error.message}"
                    logger.error("job=%s %s; failing over (the restore replays it)", job.job_id, cause)
                    if job.status is JobStatus.RUNNING and job.routing_version == version:
                        self._fail_over_now(job, cause)
                else:
                    applied = job.status is JobStatus.RUNNING and job.routing_version == version
                    if applied:
                        job.applied(epoch)
            crash_point("jobmanager.epoch.applied")
        except Exception:
            logger.exception("job=%s applying decided epoch %d failed", job.job_id, epoch)
        finally:
            job.epoch_lock.release()
        if applied and commit.checkpoint and job.coordinator is not None:
            self._checkpoint_applied(job, job.coordinator, epoch, log)

    def _checkpoint_applied(self, job: Job, coordinator: CheckpointCoordinator, epoch: int, log: DecisionLog) -> None:
        """One checkpoint at the newest applied epoch, coalescing: one in flight is waited for, a newer
        apply's own checkpoint makes this one unnecessary. Then the changelog it covers is deleted.

        ``coordinator`` and ``log`` are the run's that decided ``epoch``: after an operator restore they are
        not the job's any more, and neither checkpoints nor deletes anything of the restored run."""

        def wanted() -> bool:
            # Not when restarted, when a newer decided epoch checkpoints itself, or when an operator
            # restore replaced the run.
            with job.lock:
                return (
                    job.status is JobStatus.RUNNING and job.committed_epoch <= epoch and job.coordinator is coordinator
                )

        if coordinator.checkpoint_holding(epoch, self._closed, wanted=wanted).checkpoint is not None:
            log.collect_after_checkpoint(coordinator.retained_epochs())

    def _round(
        self, addresses: list[str], job_id: JobId, epoch: int, commit: EpochCommit, *, prepare: bool, upload: bool
    ) -> tuple[list[list[ChangeSetFile]], list[tuple[str, KeyedStateError]]]:
        """One round on every TaskManager in parallel: the answers, and the refusals by address."""

        def send(address: str) -> list[ChangeSetFile]:
            return self._commit_on(
                address,
                job_id=job_id,
                epoch=epoch,
                winners=commit.winners,
                routing_version=commit.routing_version,
                prepare=prepare,
                upload_change_set=upload,
            )

        futures = [(a, self._executor.submit(send, a)) for a in addresses]
        answers: list[list[ChangeSetFile]] = []
        errors: list[tuple[str, KeyedStateError]] = []
        for address, future in futures:
            try:
                answers.append(future.result())
            except KeyedStateError as exc:
                errors.append((address, exc))
            except Exception as exc:  # a bug in the gateway must not pass for a commit
                errors.append((address, KeyedStateError(repr(exc))))
        return answers, errors

    def _apply(self, job: Job, addresses: list[str], epoch: int, commit: EpochCommit) -> None:
        """Prepare on every TaskManager, then apply on every one, then record the epoch.

        The caller holds ``job.epoch_lock`` (no checkpoint is cut meanwhile) but not ``job.lock``:
        a TaskManager that hangs holds up this commit, never a failover. Each step re-checks that
        the job was not redeployed meanwhile.
        """
        version = commit.routing_version
        _, refused = self._round(addresses, job.job_id, epoch, commit, prepare=True, upload=False)
        with job.lock:
            self._still_current(job, epoch, version)
            if refused:
                self._refused_prepare(job, epoch, refused)
        crash_point("jobmanager.epoch.before-commit")
        _, failed = self._round(addresses, job.job_id, epoch, commit, prepare=False, upload=False)
        with job.lock:
            if failed:
                # Some TaskManagers may have applied the epoch and others not. The failover starts
                # before the epoch lock is released, so no checkpoint can cut this state.
                address, error = failed[0]
                cause = f"commit of epoch {epoch} failed on TaskManager {address}: {error.message}"
                if job.status is JobStatus.RUNNING and job.routing_version == version:
                    self._fail_over_now(job, cause)
                raise JobStateError(
                    f"job {job.job_id!r}: {cause}; the job restarts from its latest checkpoint and the batch runs again"
                ) from error
            self._still_current(job, epoch, version)
            job.set_epochs(epoch, job.lineage.bind(commit.query_id, commit.batch_id, epoch))
            crash_point("jobmanager.epoch.committed")
        logger.info(
            "job=%s epoch=%d committed (batch %d, %d partitions, routing v%d)",
            job.job_id,
            epoch,
            commit.batch_id,
            len(commit.winners),
            version,
        )

    @staticmethod
    def _still_current(job: Job, epoch: int, version: int) -> None:
        """Raise when the job was redeployed (or stopped) since the commit read it (caller holds ``job.lock``)."""
        if job.routing_version != version or job.status is not JobStatus.RUNNING:
            raise EpochConflictError(
                f"job {job.job_id!r} is {job.status.value} under routing v{job.routing_version} since the commit of epoch "
                f"{epoch} began (v{version}): {job.failure_cause or 'redeployed'}; run the batch again"
            )

    # -- durability --------------------------------------------------------------------------
    def ensure_durable(
        self, job: Job, epoch: int, query_id: str, batch_id: int, trigger: bool, timeout_ms: int
    ) -> CompletedCheckpoint:
        """Return a completed checkpoint holding ``epoch``; trigger one (``trigger``) or wait for a periodic one.

        Raises EpochConflictError when the job rolled back below the epoch meanwhile (the batch
        must run again), JobStateError when it stopped, and CheckpointError (retryable, the epoch
        stays committed) when the deadline passes first.
        """
        deadline = self._clock.monotonic_ms() + timeout_ms
        last_failure = "none yet"
        while True:
            latest, running, coordinator = self._durable_so_far(job, epoch, query_id, batch_id)
            if latest is not None:
                return latest
            remaining = deadline - self._clock.monotonic_ms()
            coordinator = self._check_still_waiting(
                job, epoch, coordinator, trigger, remaining, timeout_ms, last_failure
            )
            if not running or not trigger:
                self._closed.wait(_POLL_S)
                continue

            def wanted(run: CheckpointCoordinator = coordinator) -> bool:
                # Back to the checks above when the job stops running, rolls back below the epoch,
                # or an operator restore replaces its run.
                with job.lock:
                    return job.status is JobStatus.RUNNING and job.committed_epoch >= epoch and job.coordinator is run

            waited = coordinator.checkpoint_holding(
                epoch,
                self._closed,
                wanted=wanted,
                holds=lambda c: _holds(c, epoch, query_id, batch_id),
                timeout_ms=remaining,
            )
            if waited.checkpoint is not None:
                return waited.checkpoint
            last_failure = waited.last_failure or last_failure

    @staticmethod
    def _durable_so_far(
        job: Job, epoch: int, query_id: str, batch_id: int
    ) -> tuple[CompletedCheckpoint | None, bool, CheckpointCoordinator | None]:
        """The latest completed checkpoint if it holds the epoch, whether the job runs, and its coordinator.

        Raises JobStateError when the job stopped, EpochConflictError when it rolled back below the epoch.
        """
        with job.lock:
            if job.status.terminal:
                raise JobStateError(f"job {job.job_id!r} is {job.status.value}: {job.failure_cause}")
            if job.committed_epoch < epoch or job.lineage.epoch_of(query_id, batch_id, job.committed_epoch) != epoch:
                raise EpochConflictError(
                    f"job {job.job_id!r} restored a checkpoint that holds epoch {job.committed_epoch}, from before "
                    f"epoch {epoch} was durable ({job.failure_cause or 'failover'}); run the batch again"
                )
            latest = job.coordinator.latest_completed() if job.coordinator is not None else None
            if latest is not None and _holds(latest, epoch, query_id, batch_id):
                return latest, True, job.coordinator
            return None, job.status is JobStatus.RUNNING, job.coordinator

    def _check_still_waiting(
        self,
        job: Job,
        epoch: int,
        coordinator: CheckpointCoordinator | None,
        trigger: bool,
        remaining: int,
        timeout_ms: int,
        last_failure: str,
    ) -> CheckpointCoordinator:
        """The coordinator to wait on; raises when the deadline passed or no checkpoint can ever hold the epoch."""
        if remaining <= 0 or self._closed.is_set():
            raise CheckpointError(
                f"job {job.job_id!r}: epoch {epoch} is committed but no checkpoint holding it completed within "
                f"{timeout_ms} ms (last failure: {last_failure}); call again to keep waiting"
            )
        if coordinator is None:
            raise InvalidArgumentError(f"job {job.job_id!r} has no checkpoint storage; set state.checkpoints.dir")
        if not trigger and not coordinator.settings.periodic:
            raise InvalidArgumentError(
                f"job {job.job_id!r} takes no periodic checkpoints, so a batch committed without a checkpoint of its "
                "own never becomes durable: set execution.checkpointing.interval, or let each batch take its checkpoint"
            )
        return coordinator

    def _trigger_quietly(self, job: Job, coordinator: CheckpointCoordinator) -> None:
        try:
            coordinator.trigger()
        except CheckpointException as exc:
            logger.info("job=%s checkpoint after commit not triggered: %s", job.job_id, exc.detail)


def _holds(checkpoint: CompletedCheckpoint, epoch: int, query_id: str, batch_id: int) -> bool:
    """Whether ``checkpoint`` holds ``epoch`` as batch ``batch_id`` of ``query_id``."""
    meta = checkpoint.metadata
    if meta.epoch < epoch:
        return False
    try:
        return meta.lineage.epoch_of(query_id, batch_id, meta.epoch) == epoch
    except EpochGapError:
        return False


def _require_running(job: Job) -> None:
    if job.status is JobStatus.RUNNING:
        return
    if job.status.terminal:
        raise JobStateError(f"job {job.job_id!r} is {job.status.value}: {job.failure_cause or 'no cause recorded'}")
    raise JobStateError(
        f"job {job.job_id!r} is {job.status.value} ({job.failure_cause or 'starting'}); run the batch again once it "
        f"is RUNNING (it will hold epoch {job.committed_epoch} or the epoch of the checkpoint it restores)"
    )


def _predecessor_hint(job: Job) -> str:
    if not job.predecessor:
        return ""
    return f". {job.predecessor}"
