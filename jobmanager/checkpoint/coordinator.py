"""The CheckpointCoordinator: triggers checkpoints of one job, collects acks, commits ``_metadata``.

The life of a checkpoint, as in Flink::

    trigger ─► PendingCheckpoint ─► (every subtask acked) ─► _metadata written ─► CompletedCheckpoint
                 │                                                                   │
                 └─► aborted (declined, expired, barrier undeliverable, shutdown)    └─► subsumes older ones

Storage layout under ``job_dir`` (``<state.checkpoints.dir>/<job-id>``)::

    chk-<n>/_metadata   the commit record, written last with one create-only write
    chk-<n>/…           files only checkpoint n uses (deleted when it is subsumed or aborted)
    shared/…            incremental files, reference-counted across retained checkpoints
    taskowned/…         files TaskManagers own; never deleted by the coordinator, retention or gc

Both directories are created when the job's checkpointing starts (:meth:`CheckpointCoordinator.initialize_locations`).

A savepoint goes to ``<target dir>/savepoint-<job8>-<n>/``, holds all its files, and belongs to
the user: retention never deletes it.

What TaskManagers must do: acknowledge with file paths relative to the barrier's target path
(``shared/<name>`` or ``../shared/<name>`` for shared files, or absolute URLs inside those
directories), report the key-group range they own, and reuse a shared file in a new snapshot
only after a checkpoint referencing it was confirmed by ``notify(completed=True)``. Files an
aborted checkpoint uploaded are deleted, so they must never be reused.

Thread model: acks and declines arrive on gRPC threads, timeouts and periodic triggers on the
scheduler. One lock guards the coordinator's state; storage I/O, gateway calls and callbacks
run outside it. Finalizations are serialized by a second lock so checkpoints complete in order.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from keyedstate.common.clock import Cancellable, Clock, Scheduler
from keyedstate.common.config import options as o
from keyedstate.common.descriptors import OperatorSpec
from keyedstate.common.errors import CheckpointError, InvalidArgumentError, UnavailableError
from keyedstate.common.faults import crash_point
from keyedstate.common.handles import CheckpointBarrier, StateFileHandle, SubtaskStateHandle
from keyedstate.common.ids import CheckpointId, JobId, SubtaskId, validate_id
from keyedstate.common.keygroups import check_parallelism
from keyedstate.common.storage import CheckpointStorage
from keyedstate.jobmanager.checkpoint import _paths
from keyedstate.jobmanager.checkpoint.cleaner import CheckpointsCleaner
from keyedstate.jobmanager.checkpoint.completed import (
    CompletedCheckpoint,
    CompletedCheckpointStore,
    StandaloneCompletedCheckpointStore,
)
from keyedstate.jobmanager.checkpoint.failure import (
    CheckpointException,
    CheckpointFailureReason,
    CheckpointInProgressError,
    CheckpointNotFoundError,
)
from keyedstate.jobmanager.checkpoint.gateway import CheckpointGateway, EpochCut
from keyedstate.jobmanager.checkpoint.id_counter import CheckpointIDCounter, StandaloneCheckpointIDCounter
from keyedstate.jobmanager.checkpoint.metadata import CheckpointMetadata
from keyedstate.jobmanager.checkpoint.pending import AckOutcome, PendingCheckpoint, PendingStatus
from keyedstate.jobmanager.checkpoint.settings import CheckpointingSettings
from keyedstate.jobmanager.checkpoint.shared_registry import SharedStateRegistry
from keyedstate.jobmanager.checkpoint.stats import CheckpointStatsTracker, SubtaskAckStats

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointBarrier",
    "CheckpointCoordinator",
    "CheckpointGateway",
    "CheckpointingSettings",
    "CoordinatorConfig",
    "CoordinatorServices",
]

R = CheckpointFailureReason
_RECENT = 128  # finished checkpoints remembered for late acks and wait_for
_RETRY_PAUSE_MS = 200  # checkpoint_holding: after a refused or failed checkpoint, before the next try


class _Finished(NamedTuple):
    """A finished checkpoint as remembered for late acks, declines and :meth:`CheckpointCoordinator.wait_for`."""

    status: PendingStatus
    pending: Callable[[], PendingCheckpoint | None]
    """The checkpoint: held for an aborted one, weakly for a completed one (None once nothing else holds it)."""


@dataclass(frozen=True)
class CheckpointWait:
    """What :meth:`CheckpointCoordinator.checkpoint_holding` found."""

    checkpoint: CompletedCheckpoint | None
    """The completed checkpoint holding the epoch; None when none did before the wait ended."""
    last_failure: str | None = None
    """Why the last checkpoint tried was refused or failed (``REASON: detail``); None if none was."""


@dataclass(frozen=True)
class CoordinatorConfig:
    """What one job's checkpoints are: whose, where they go, over how many key groups, and how they are taken."""

    job_id: JobId
    job_checkpoint_dir: str
    """The job's own directory (``chk-<n>``, ``shared``, ``taskowned`` live under it)."""
    max_parallelism: int
    settings: CheckpointingSettings = field(default_factory=CheckpointingSettings)
    savepoints_dir: str | None = None
    """Where a savepoint without a target goes (None: a savepoint needs a target)."""


@dataclass(frozen=True)
class CoordinatorServices:
    """The coordinator's collaborators; the optional ones default to standalone (one JobManager, no HA) parts."""

    storage: CheckpointStorage
    gateway: CheckpointGateway
    clock: Clock
    scheduler: Scheduler
    id_counter: CheckpointIDCounter | None = None
    store: CompletedCheckpointStore | None = None
    stats: CheckpointStatsTracker | None = None
    cleaner: CheckpointsCleaner | None = None
    """Deletes discarded checkpoints' files (default: one of its own, shut down with the coordinator)."""
    shared_registry: SharedStateRegistry | None = None


class CheckpointCoordinator:
    """Coordinates the checkpoints and savepoints of one job (see the module docstring)."""

    def __init__(
        self,
        config: CoordinatorConfig,
        services: CoordinatorServices,
        *,
        operators: Sequence[OperatorSpec] | Callable[[], Sequence[OperatorSpec]],
        tasks: Iterable[SubtaskId] | Callable[[], Iterable[SubtaskId]] | None = None,
        on_failover: Callable[[CheckpointFailureReason, str], None] | None = None,
    ) -> None:
        """``operators`` (or a callable returning them) are the job's operators now; every subtask
        they imply must acknowledge. ``tasks`` returns the subtasks currently running; a trigger is
        refused with NOT_ALL_REQUIRED_TASKS_RUNNING while one is missing (default: all running).
        ``on_failover`` is called once the tolerable checkpoint failures are exceeded.
        """
        self.job_id = JobId(validate_id("job id", config.job_id))
        check_parallelism(1, config.max_parallelism)
        self.settings = config.settings
        self.max_parallelism = config.max_parallelism
        self.job_dir = _paths.normalize(config.job_checkpoint_dir)
        self.shared_dir = _paths.join(self.job_dir, _paths.SHARED_DIR)
        self.taskowned_dir = _paths.join(self.job_dir, _paths.TASKOWNED_DIR)
        self.savepoints_dir = config.savepoints_dir
        self._storage = services.storage
        self._gateway = services.gateway
        self._clock = services.clock
        self._scheduler = services.scheduler
        self._operators = operators if callable(operators) else (lambda ops=tuple(operators): ops)
        if tasks is None:
            self._tasks: Callable[[], Iterable[SubtaskId]] | None = None
        else:
            self._tasks = tasks if callable(tasks) else (lambda ts=frozenset(tasks): ts)
        self._ids = services.id_counter or StandaloneCheckpointIDCounter()
        self._store = services.store or StandaloneCompletedCheckpointStore(config.settings.num_retained)
        self.stats = services.stats or CheckpointStatsTracker(config.job_id)
        self._on_failover = on_failover
        self._owns_cleaner = services.cleaner is None
        self._cleaner = services.cleaner or CheckpointsCleaner(services.storage)
        self._registry = services.shared_registry or SharedStateRegistry()
        self._init_state()

    def _init_state(self) -> None:
        self._lock = threading.Lock()
        self._finalize_lock = threading.Lock()
        self._pending: dict[CheckpointId, PendingCheckpoint] = {}
        self._recent: OrderedDict[CheckpointId, _Finished] = OrderedDict()
        # The subtasks of the last operators triggered: one set shared by every checkpoint of an unchanged job.
        self._required: tuple[tuple[OperatorSpec, ...], frozenset[SubtaskId]] = ((), frozenset())
        self._deferred: list[tuple[CheckpointId, list[str]]] = []
        self._last_completion_ms: int | None = None  # monotonic; drives min-pause
        self._latest_checkpoint_id = 0  # newest completed non-savepoint id
        self._latest_success_id = 0
        self._consecutive_failures = 0
        self._failover_fired = False
        self._periodic_running = False
        self._periodic_handle: Cancellable | None = None
        self._shutdown = False
        # Checkpoints no deletion may touch while a restore reads them: directory -> the files they reference.
        self._protected: dict[str, frozenset[str]] = {}
        self._protected_lock = threading.Lock()  # not _lock: deletions may run inline under it

    def initialize_locations(self) -> None:
        """Create ``shared/`` and ``taskowned/`` under the job directory (Flink's layout from the first checkpoint on).

        Idempotent; on object stores, which have no directories, it does nothing. A storage
        failure is raised: a job whose checkpoint directory cannot be written should not start.
        """
        for directory in (self.shared_dir, self.taskowned_dir):
            self._storage.makedirs(directory)

    # -- queries -------------------------------------------------------------------------------
    @property
    def store(self) -> CompletedCheckpointStore:
        """The retained completed checkpoints (what job info lists and a failover restores from)."""
        return self._store

    @property
    def shared_registry(self) -> SharedStateRegistry:
        """Reference counts of the ``shared/`` files the retained checkpoints use."""
        return self._registry

    @property
    def cleaner(self) -> CheckpointsCleaner:
        """Deletes what aborted and subsumed checkpoints leave (flush it to wait for deletions)."""
        return self._cleaner

    def latest_completed(self) -> CompletedCheckpoint | None:
        """The newest completed checkpoint or savepoint still retained (what a failover restores)."""
        return self._store.latest()

    def retained_epochs(self) -> list[int]:
        """The epochs of the retained completed checkpoints (a changelog below the oldest is covered by all)."""
        return [c.metadata.epoch for c in self._store.all()]

    def pending_checkpoints(self) -> list[PendingCheckpoint]:
        """The checkpoints still collecting acknowledgements or being finalized."""
        with self._lock:
            return list(self._pending.values())

    def in_progress_ids(self) -> set[CheckpointId]:
        """Ids of checkpoints not yet completed or aborted (``statectl checkpoint gc`` keeps their files)."""
        with self._lock:
            return set(self._pending)

    @property
    def consecutive_failures(self) -> int:
        """Counted failures since the last completed checkpoint (compared with tolerable-failed-checkpoints)."""
        with self._lock:
            return self._consecutive_failures

    # -- triggering ----------------------------------------------------------------------------
    def trigger(
        self, savepoint: bool = False, target_dir: str | None = None, periodic: bool = False, counted: bool = True
    ) -> PendingCheckpoint:
        """Start a checkpoint (or savepoint) and send its barrier; returns it while in progress.

        The checkpoint is cut at the epoch the job holds while the barrier goes out (the
        gateway's :meth:`~.gateway.CheckpointGateway.cut`). Raises CheckpointException carrying
        the reason when the trigger is refused (too many in progress, min pause, tasks not
        running, shutdown) or the barrier cannot be delivered; the failed attempt is cleaned up
        first. Savepoints, as in Flink, ignore max-concurrent and min-pause. Use
        :meth:`wait_for` or ``pending.future`` to wait for the outcome, and
        :meth:`trigger_waiting` to wait for a free turn instead of being refused. ``counted=False``: a
        checkpoint the JobManager adds on its own (after a restore's replay), whose failure never counts
        toward ``execution.checkpointing.tolerable-failed-checkpoints`` (it would turn a restore that
        succeeded into another failover, in a loop while storage is slow).
        """
        target_dir = self._target_dir(savepoint, target_dir)
        # Callbacks into the job model run before taking the lock; they may take locks of their own.
        operators = tuple(self._operators())
        with self._gateway.cut() as cut:
            # What runs at the cut is what gets the barrier: read with the epoch, not before it.
            running = (
                cut.running
                if cut.running is not None
                else (frozenset(self._tasks()) if self._tasks is not None else None)
            )
            pending = self._start_pending(savepoint, target_dir, cut, periodic, operators, running, counted)
            self._report_triggered(pending, cut, periodic)
            self._send_barrier(pending, cut)
        return pending

    def _target_dir(self, savepoint: bool, target_dir: str | None) -> str | None:
        """Where a savepoint goes (its target or ``state.savepoints.dir``); a checkpoint takes none."""
        if savepoint:
            target_dir = target_dir or self.savepoints_dir
            if not target_dir:
                raise InvalidArgumentError("a savepoint needs a target directory: pass one or set state.savepoints.dir")
        elif target_dir is not None:
            raise InvalidArgumentError("target_dir applies to savepoints only; checkpoints go to state.checkpoints.dir")
        return target_dir

    def _start_pending(
        self,
        savepoint: bool,
        target_dir: str | None,
        cut: EpochCut,
        periodic: bool,
        operators: tuple[OperatorSpec, ...],
        running: frozenset[SubtaskId] | None,
        counted: bool = True,
    ) -> PendingCheckpoint:
        """:meth:`_create_pending`, recording a refusal (a periodic trigger's missed turn quietly)."""
        try:
            return self._create_pending(savepoint, target_dir, cut, periodic, operators, running, counted)
        except CheckpointException as exc:
            quiet = periodic and exc.failure_reason in (
                R.TOO_MANY_CHECKPOINT_REQUESTS,
                R.MINIMUM_TIME_BETWEEN_CHECKPOINTS,
            )
            if not quiet:
                self.stats.report_rejected(exc.failure_reason, exc.detail)
                logger.info("job=%s checkpoint not triggered: %s", self.job_id, exc.message)
            raise

    def _report_triggered(self, pending: PendingCheckpoint, cut: EpochCut, periodic: bool) -> None:
        self.stats.report_pending(
            pending.checkpoint_id,
            pending.trigger_timestamp_ms,
            savepoint=pending.savepoint,
            num_subtasks=len(pending.expected),
            path=pending.target_path,
            epoch=cut.epoch,
        )
        logger.info(
            "job=%s checkpoint=%d triggered (%s, %d subtasks, epoch %d, target %s)",
            self.job_id,
            pending.checkpoint_id,
            "savepoint" if pending.savepoint else "periodic" if periodic else "checkpoint",
            len(pending.expected),
            cut.epoch,
            pending.target_path,
        )

    def _send_barrier(self, pending: PendingCheckpoint, cut: EpochCut) -> None:
        """Deliver the barrier inside the cut; an undeliverable one aborts the checkpoint (raised unless already over)."""
        barrier = CheckpointBarrier(
            job_id=self.job_id,
            checkpoint_id=pending.checkpoint_id,
            target_path=pending.target_path,
            epoch=cut.epoch,
            savepoint=pending.savepoint,
            incremental=pending.incremental,
            timestamp_ms=pending.trigger_timestamp_ms,
            # Savepoints go to their directory whatever the storage, as in Flink.
            inline_max_state_size=0 if pending.savepoint else self.settings.inline_max_state_size,
        )
        try:
            self._gateway.send_barrier(barrier)
        except Exception as exc:
            unavailable = isinstance(exc, UnavailableError)
            reason = R.NOT_ALL_REQUIRED_TASKS_RUNNING if unavailable else R.TRIGGER_CHECKPOINT_FAILURE
            detail = getattr(exc, "message", None) or repr(exc)
            message = f"could not deliver the barrier of checkpoint {pending.checkpoint_id}: {detail}"
            if not unavailable:
                logger.warning("job=%s checkpoint=%d barrier failed", self.job_id, pending.checkpoint_id, exc_info=True)
            if self._abort(pending, reason, message):
                raise CheckpointException(reason, message) from exc

    def trigger_waiting(
        self,
        timeout_ms: int,
        savepoint: bool = False,
        target_dir: str | None = None,
        closed: threading.Event | None = None,
        counted: bool = True,
    ) -> PendingCheckpoint:
        """:meth:`trigger`, but wait for a free turn instead of being refused.

        A checkpoint already in flight (``TOO_MANY_CHECKPOINT_REQUESTS``) is waited for, and the
        minimum pause (``MINIMUM_TIME_BETWEEN_CHECKPOINTS``) waited out, for at most
        ``timeout_ms``; every other refusal is raised at once. ``closed`` ends the wait early
        (the JobManager shuts down).
        """
        deadline = self._clock.monotonic_ms() + timeout_ms
        while True:
            try:
                return self.trigger(savepoint=savepoint, target_dir=target_dir, counted=counted)
            except CheckpointException as exc:
                remaining = deadline - self._clock.monotonic_ms()
                if not self.wait_for_turn(exc, remaining, closed):
                    raise CheckpointException(
                        exc.failure_reason, f"{exc.detail} (waited {timeout_ms} ms for a turn)"
                    ) from exc

    def wait_for_turn(
        self, refused: CheckpointException, timeout_ms: int, closed: threading.Event | None = None
    ) -> bool:
        """After a trigger was refused for want of a turn, wait (at most ``timeout_ms``) until one may come.

        A checkpoint in flight is waited for until one finishes, the minimum pause until it
        passed. Returns False, without waiting, for any other refusal or when no time is left.
        """
        if refused.failure_reason not in (R.TOO_MANY_CHECKPOINT_REQUESTS, R.MINIMUM_TIME_BETWEEN_CHECKPOINTS):
            return False
        if timeout_ms <= 0 or (closed is not None and closed.is_set()):
            return False
        if refused.failure_reason is R.TOO_MANY_CHECKPOINT_REQUESTS:
            self._wait_for_a_finish(timeout_ms)
        else:
            with self._lock:
                pause = self._min_pause_remaining_locked()
            self._sleep(min(max(1, pause), timeout_ms), closed)
        return True

    def checkpoint_holding(
        self,
        epoch: int,
        closed: threading.Event,
        *,
        counted: bool = True,
        wanted: Callable[[], bool] = lambda: True,
        holds: Callable[[CompletedCheckpoint], bool] | None = None,
        timeout_ms: int | None = None,
    ) -> CheckpointWait:
        """A completed checkpoint holding ``epoch``: the latest retained one if it does, else one triggered.

        A checkpoint holds the epoch when ``holds(checkpoint)`` (by default: its epoch is at or above
        ``epoch``). Coalescing: a checkpoint in flight, or the minimum pause, is waited for (the one
        in flight may hold the epoch already), and a failed one is tried again after a short pause
        on the coordinator's scheduler, all within ``timeout_ms`` (by default the checkpoint
        timeout). The answer carries no checkpoint when that runs out, ``closed`` is set, or
        ``wanted()`` turns False (the caller's run was replaced, or a newer epoch checkpoints
        itself); it names the last failure either way. ``counted`` as for :meth:`trigger`.
        """
        holds = holds or (lambda c: c.metadata.epoch >= epoch)
        timeout_ms = self.settings.timeout_ms if timeout_ms is None else timeout_ms
        deadline = self._clock.monotonic_ms() + timeout_ms
        last_failure: str | None = None
        while not closed.is_set() and wanted():
            latest = self.latest_completed()
            if latest is not None and holds(latest):
                return CheckpointWait(latest, last_failure)
            remaining = deadline - self._clock.monotonic_ms()
            if remaining <= 0:
                logger.warning("job=%s no checkpoint holding epoch %d within %d ms", self.job_id, epoch, timeout_ms)
                break
            try:
                pending = self.trigger(counted=counted)
            except CheckpointException as exc:
                if not self.wait_for_turn(exc, remaining, closed):
                    last_failure = f"{exc.failure_reason.name}: {exc.detail}"
                    logger.info("job=%s checkpoint for epoch %d not triggered: %s", self.job_id, epoch, exc.detail)
                    self._retry_pause(wanted, closed)
                continue
            try:
                self.wait_for(pending.checkpoint_id, max(0.001, remaining / 1000.0))
            except CheckpointInProgressError:
                continue  # the deadline check decides
            except CheckpointException as exc:
                last_failure = f"{exc.failure_reason.name}: {exc.detail}"
                logger.warning(
                    "job=%s checkpoint %d for epoch %d failed (%s); trying again",
                    self.job_id,
                    pending.checkpoint_id,
                    epoch,
                    last_failure,
                )
                self._retry_pause(wanted, closed)
            except CheckpointError as exc:
                # Completed and subsumed already: the next look finds the newer one.
                logger.info("job=%s checkpoint %d for epoch %d: %s", self.job_id, pending.checkpoint_id, epoch, exc)
        return CheckpointWait(None, last_failure)

    def _retry_pause(self, wanted: Callable[[], bool], closed: threading.Event) -> None:
        """The pause before ``checkpoint_holding`` tries again, skipped when the caller no longer wants a checkpoint.

        An abort for a failover or rollback (or a refusal while one runs) then ends the wait at
        once instead of after the pause.
        """
        if wanted():
            self._sleep(_RETRY_PAUSE_MS, closed)

    def _wait_for_a_finish(self, timeout_ms: int) -> None:
        with self._lock:
            futures = [p.future for p in self._pending.values() if not p.savepoint]
        if futures:
            concurrent.futures.wait(
                futures, timeout=timeout_ms / 1000.0, return_when=concurrent.futures.FIRST_COMPLETED
            )

    def _sleep(self, delay_ms: int, closed: threading.Event | None) -> None:
        """Sleep on the injected scheduler (so tests advance a manual clock instead of waiting)."""
        woken = closed if closed is not None else threading.Event()
        done = threading.Event()
        handle = self._scheduler.schedule(delay_ms, done.set)
        try:
            while not done.is_set() and not woken.is_set() and not self._shutdown:
                done.wait(0.05)
        finally:
            handle.cancel()

    def _create_pending(
        self,
        savepoint: bool,
        target_dir: str | None,
        cut: EpochCut,
        periodic: bool,
        operators: tuple[OperatorSpec, ...],
        running: frozenset[SubtaskId] | None,
        counted: bool = True,
    ) -> PendingCheckpoint:
        """The new checkpoint, registered with its timeout; CheckpointException if this trigger is refused."""
        with self._lock:
            required = self._required_locked(operators)
            self._check_turn_locked(savepoint, periodic)
            _check_running(self.job_id, required, running)
            checkpoint_id = CheckpointId(self._ids.get_and_increment())
            if savepoint:
                assert target_dir is not None
                target = _paths.join(target_dir, _paths.savepoint_dir_name(self.job_id, checkpoint_id))
            else:
                target = _paths.join(self.job_dir, _paths.checkpoint_dir_name(checkpoint_id))
            pending = PendingCheckpoint(
                job_id=self.job_id,
                checkpoint_id=checkpoint_id,
                trigger_timestamp_ms=self._clock.now_ms(),
                trigger_monotonic_ms=self._clock.monotonic_ms(),
                operators=operators,
                max_parallelism=self.max_parallelism,
                target_path=target,
                shared_dir=self.shared_dir,
                savepoint=savepoint,
                epoch=cut.epoch,
                lineage=cut.lineage,
                incremental=self.settings.incremental and not savepoint,
                periodic=periodic,
                expected=required,
                counted=counted,
            )
            self._pending[checkpoint_id] = pending
            pending.timeout_handle = self._scheduler.schedule(
                self.settings.timeout_ms, functools.partial(self._on_timeout, checkpoint_id)
            )
            return pending

    def _required_locked(self, operators: tuple[OperatorSpec, ...]) -> frozenset[SubtaskId]:
        """Every subtask of ``operators``; the same set as the last trigger's while the operators are unchanged."""
        last, required = self._required
        if operators != last:
            required = frozenset(
                SubtaskId(self.job_id, op.operator_id, i) for op in operators for i in range(op.parallelism)
            )
            self._required = (operators, required)
        return required

    def _check_turn_locked(self, savepoint: bool, periodic: bool) -> None:
        """Refuse a trigger that comes at the wrong time: shut down, periodic stopped, or (checkpoints only)
        too many in flight or inside the minimum pause."""
        if self._shutdown:
            raise CheckpointException(
                R.CHECKPOINT_COORDINATOR_SHUTDOWN, f"the checkpoint coordinator of job {self.job_id} is shut down"
            )
        if periodic and not self._periodic_running:
            raise CheckpointException(R.PERIODIC_SCHEDULER_SHUTDOWN, "periodic checkpoints are stopped")
        if savepoint:
            return
        active = sorted(p.checkpoint_id for p in self._pending.values() if not p.savepoint)
        if len(active) >= self.settings.max_concurrent:
            raise CheckpointException(
                R.TOO_MANY_CHECKPOINT_REQUESTS,
                f"checkpoint(s) {active} already in progress and {o.CHECKPOINT_MAX_CONCURRENT.key} is "
                f"{self.settings.max_concurrent}; wait for them to finish or raise the limit",
            )
        remaining = self._min_pause_remaining_locked()
        if remaining > 0:
            raise CheckpointException(
                R.MINIMUM_TIME_BETWEEN_CHECKPOINTS,
                f"the last checkpoint completed {self.settings.min_pause_ms - remaining} ms ago and "
                f"{o.CHECKPOINT_MIN_PAUSE.key} is {self.settings.min_pause_ms} ms; retry in {remaining} ms",
            )

    def _min_pause_remaining_locked(self) -> int:
        if not self.settings.min_pause_ms or self._last_completion_ms is None:
            return 0
        elapsed = self._clock.monotonic_ms() - self._last_completion_ms
        return max(0, self.settings.min_pause_ms - elapsed)

    # -- periodic ------------------------------------------------------------------------------
    def start_periodic(self) -> bool:
        """Start periodic checkpoints every ``interval``; False if no interval is configured."""
        if not self.settings.periodic:
            logger.info("job=%s periodic checkpoints disabled (%s unset)", self.job_id, o.CHECKPOINT_INTERVAL.key)
            return False
        with self._lock:
            if self._shutdown:
                raise CheckpointException(R.CHECKPOINT_COORDINATOR_SHUTDOWN, "the checkpoint coordinator is shut down")
            if self._periodic_running:
                return True
            self._periodic_running = True
            assert self.settings.interval_ms is not None
            self._periodic_handle = self._scheduler.schedule(self.settings.interval_ms, self._periodic_tick)
        return True

    def stop(self, abort_pending: bool = True) -> None:
        """Stop periodic checkpoints; by default abort pending ones (CHECKPOINT_COORDINATOR_SUSPEND)."""
        with self._lock:
            self._periodic_running = False
            handle, self._periodic_handle = self._periodic_handle, None
        if handle is not None:
            handle.cancel()
        if abort_pending:
            self.abort_pending(R.CHECKPOINT_COORDINATOR_SUSPEND, "checkpointing of the job was stopped")

    def _periodic_tick(self) -> None:
        with self._lock:
            if not self._periodic_running or self._shutdown:
                return
            self._periodic_handle = None
        assert self.settings.interval_ms is not None
        delay = self.settings.interval_ms
        try:
            self.trigger(periodic=True)
        except CheckpointException as exc:
            if exc.failure_reason is R.MINIMUM_TIME_BETWEEN_CHECKPOINTS:
                with self._lock:
                    delay = max(1, self._min_pause_remaining_locked())
                logger.debug("job=%s periodic checkpoint postponed by %d ms (min pause)", self.job_id, delay)
            elif exc.failure_reason is R.TOO_MANY_CHECKPOINT_REQUESTS:
                logger.debug("job=%s periodic checkpoint skipped: %s", self.job_id, exc.detail)
        except Exception:
            logger.exception("job=%s periodic checkpoint trigger failed unexpectedly", self.job_id)
        with self._lock:
            if self._periodic_running and not self._shutdown and self._periodic_handle is None:
                self._periodic_handle = self._scheduler.schedule(delay, self._periodic_tick)

    # -- acknowledgements ----------------------------------------------------------------------
    def acknowledge(self, checkpoint_id: CheckpointId, handle: SubtaskStateHandle) -> AckOutcome:
        """Record a subtask's snapshot; the last ack completes the checkpoint on this thread.

        Files sent inline (JobManager checkpoint storage) are stored first, under the
        checkpoint's directory in this JobManager's memory, and the handle keeps only their paths.
        """
        subtask = SubtaskId(self.job_id, handle.operator_id, handle.subtask_index)
        if any(f.data is not None for f in handle.files):
            refused = self._store_inline(checkpoint_id, subtask, handle)
            if refused is not None:
                with self._lock:
                    pending = self._pending.get(checkpoint_id)
                logger.warning("job=%s checkpoint=%d %s", self.job_id, checkpoint_id, refused.detail)
                if pending is not None:
                    self._abort(pending, refused.failure_reason, refused.detail)
                return AckOutcome.DISCARDED
        invalid: CheckpointException | None = None
        finalize: PendingCheckpoint | None = None
        late: PendingCheckpoint | None = None
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            if pending is None:
                recent = self._recent.get(checkpoint_id)
                if recent is not None and recent.status is PendingStatus.COMPLETED:
                    outcome = AckOutcome.DUPLICATE
                elif recent is not None:
                    outcome, late = AckOutcome.DISCARDED, recent.pending()
                else:
                    outcome = AckOutcome.UNKNOWN
                    if checkpoint_id < self._ids.get() and checkpoint_id > self._latest_success_id:
                        # A checkpoint an earlier JobManager triggered and never completed (it died
                        # between barrier and _metadata): what the TaskManager uploaded is garbage.
                        outcome = AckOutcome.DISCARDED
            else:
                try:
                    outcome = pending.acknowledge(subtask, handle)
                except CheckpointException as exc:
                    outcome, invalid = AckOutcome.DISCARDED, exc
                else:
                    if outcome is AckOutcome.SUCCESS and pending.is_fully_acknowledged:
                        pending.start_finalizing()
                        finalize = pending
        if invalid is not None:
            assert pending is not None
            logger.warning("job=%s checkpoint=%d %s", self.job_id, checkpoint_id, invalid.detail)
            self._abort(pending, invalid.failure_reason, invalid.detail)
            self._discard_late_ack(pending, handle)
            return outcome
        if outcome is AckOutcome.SUCCESS:
            crash_point("jobmanager.checkpoint.acknowledged")
            self.stats.report_ack(checkpoint_id, self._ack_stats(handle))
        elif late is not None:
            logger.info(
                "job=%s checkpoint=%d late ack from %s for an aborted checkpoint; deleting its files",
                self.job_id,
                checkpoint_id,
                subtask,
            )
            self._discard_late_ack(late, handle)
        elif outcome is AckOutcome.DISCARDED:
            logger.info(
                "job=%s checkpoint=%d ack from %s for a checkpoint of an earlier JobManager; deleting its files",
                self.job_id,
                checkpoint_id,
                subtask,
            )
            self._discard_orphan_ack(checkpoint_id, handle)
        else:
            logger.debug("job=%s checkpoint=%d ack from %s: %s", self.job_id, checkpoint_id, subtask, outcome.value)
        if finalize is not None:
            self._finalize(finalize)
        return outcome

    def _store_inline(
        self, checkpoint_id: CheckpointId, subtask: SubtaskId, handle: SubtaskStateHandle
    ) -> CheckpointException | None:
        """Write the files ``handle`` carries inline into the checkpoint's directory and drop their bytes
        from it; the refusal when this checkpoint takes no inline files or the state is too large."""
        with self._lock:
            pending = self._pending.get(checkpoint_id)
        limit = self.settings.inline_max_state_size
        if pending is not None:
            if pending.savepoint or limit <= 0:
                return CheckpointException(
                    R.CHECKPOINT_DECLINED,
                    f"subtask {subtask} sent its files inline, but checkpoint {checkpoint_id} is written to "
                    f"{pending.target_path}; the TaskManager must upload them there",
                )
            size = sum(len(f.data) for f in handle.files if f.data is not None)
            if size > limit:
                return CheckpointException(
                    R.STATE_SIZE_LIMIT_EXCEEDED,
                    f"the state of subtask {subtask} is {size} bytes, more than the {limit} bytes of "
                    f"{o.JOBMANAGER_STORAGE_MAX_STATE_SIZE.key}; use {o.CHECKPOINT_STORAGE.key}: filesystem with "
                    f"{o.CHECKPOINTS_DIR.key} for state this large",
                )
            for f in handle.files:
                if f.data is None:
                    continue
                relative = pending.relative_path(f.path, f.shared)
                if f.shared or not _paths.is_inside_relative(relative):
                    return CheckpointException(
                        R.CHECKPOINT_DECLINED,
                        f"file {f.path!r} sent inline by subtask {subtask} is not inside the checkpoint directory",
                    )
                self._storage.write_bytes(_paths.join(pending.target_path, relative), f.data)
        # Not pending (late, duplicate, unknown): the usual answer follows, and a discard deletes
        # what may have been stored for an aborted checkpoint meanwhile.
        handle.files = [dataclasses.replace(f, data=None) for f in handle.files]
        return None

    def _ack_stats(self, handle: SubtaskStateHandle) -> SubtaskAckStats:
        """What the history keeps of one ack: who, when, its sync and async phases and its sizes."""
        return SubtaskAckStats(
            operator_id=handle.operator_id,
            subtask_index=handle.subtask_index,
            ack_timestamp_ms=self._clock.now_ms(),
            sync_duration_ms=handle.sync_duration_ms,
            async_duration_ms=handle.async_duration_ms,
            full_size=handle.full_size,
            incremental_size=handle.incremental_size,
        )

    def decline(
        self,
        checkpoint_id: CheckpointId,
        subtask: SubtaskId,
        message: str,
        reason: CheckpointFailureReason = R.CHECKPOINT_DECLINED,
    ) -> AckOutcome:
        """A subtask cannot take the checkpoint: abort it. Unknown or finished ids change nothing."""
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            if pending is None:
                recent = self._recent.get(checkpoint_id)
                discarded = recent is not None and recent.status is PendingStatus.ABORTED
                outcome = AckOutcome.DISCARDED if discarded else AckOutcome.UNKNOWN
            elif subtask not in pending.expected:
                outcome = AckOutcome.UNKNOWN
            else:
                outcome = AckOutcome.SUCCESS
        if outcome is not AckOutcome.SUCCESS:
            logger.debug(
                "job=%s checkpoint=%d decline from %s ignored: %s", self.job_id, checkpoint_id, subtask, outcome.value
            )
            return outcome
        assert pending is not None
        aborted = self._abort(pending, reason, f"subtask {subtask} declined checkpoint {checkpoint_id}: {message}")
        return AckOutcome.SUCCESS if aborted else AckOutcome.DISCARDED

    def abort_pending(self, reason: CheckpointFailureReason, message: str) -> int:
        """Abort every checkpoint still collecting acks (a TaskManager was lost, the job fails over…)."""
        with self._lock:
            victims = [p for p in self._pending.values() if p.status is PendingStatus.IN_PROGRESS]
        return sum(1 for p in victims if self._abort(p, reason, message))

    def _on_timeout(self, checkpoint_id: CheckpointId) -> None:
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            if pending is None or pending.status is not PendingStatus.IN_PROGRESS:
                return
            missing = sorted(pending.not_yet_acknowledged())
        shown = ", ".join(str(s) for s in missing[:3]) + (", …" if len(missing) > 3 else "")
        self._abort(
            pending,
            R.CHECKPOINT_EXPIRED,
            f"checkpoint {checkpoint_id} expired after {self.settings.timeout_ms} ms: {len(missing)} of "
            f"{len(pending.expected)} subtasks did not acknowledge ({shown}); raise {o.CHECKPOINT_TIMEOUT.key} "
            "if snapshots are just slow",
        )

    # -- completion ----------------------------------------------------------------------------
    def _finalize(self, pending: PendingCheckpoint) -> None:
        """Every subtask acknowledged: write ``_metadata``, add to the store, then subsume, clean up and notify.

        Serialized by the finalize lock so checkpoints complete in id order; any failure before
        the store took the checkpoint aborts it (FINALIZE_CHECKPOINT_FAILURE or CHECKPOINT_SUBSUMED).
        """
        cid = pending.checkpoint_id
        with self._finalize_lock:
            if self._subsumed_before_finalizing(pending):
                return
            metadata = self._write_metadata(pending)
            if metadata is None:
                return
            completed = CompletedCheckpoint(metadata, pending.target_path, completion_timestamp_ms=self._clock.now_ms())
            subsumed = self._add_to_store(pending, completed)
            if subsumed is None:
                return
            # Register before unregistering: files the new checkpoint shares with a subsumed one
            # never drop to zero references.
            self._registry.register(completed)
            released: list[str] = []
            for old in subsumed:
                released.extend(self._registry.unregister(old))
            now = self._clock.monotonic_ms()
            to_subsume, released = self._mark_completed(pending, now, released)
        self._report_completed(pending, completed, now - pending.trigger_monotonic_ms)
        for p in to_subsume:
            self._abort(p, R.CHECKPOINT_SUBSUMED, f"checkpoint {cid} completed first")
        for old in subsumed:
            logger.info("job=%s checkpoint=%d subsumed by %d; deleting it", self.job_id, old.checkpoint_id, cid)
        self._cleaner.discard(
            directories=[s.external_path for s in subsumed],
            files=released,
            keep=self._keep,
            what=f"checkpoints subsumed by {cid} of job {self.job_id}",
        )
        self._cleaner.revisit(keep=self._keep)
        self._release_deferred()
        self._notify(cid, True)
        pending.release_acks()
        pending.future.set_result(completed)

    def _subsumed_before_finalizing(self, pending: PendingCheckpoint) -> bool:
        """True (and ``pending`` aborted) when a newer checkpoint completed while it collected acks."""
        with self._lock:
            newer = self._latest_checkpoint_id
        if not pending.savepoint and newer > pending.checkpoint_id:
            self._abort(pending, R.CHECKPOINT_SUBSUMED, f"checkpoint {newer} completed first", allow_finalizing=True)
            return True
        return False

    def _write_metadata(self, pending: PendingCheckpoint) -> CheckpointMetadata | None:
        """Write ``_metadata`` with one create-only write: the commit point. None (and aborted) if it fails."""
        metadata_path = _paths.join(pending.target_path, _paths.METADATA_FILE)
        try:
            metadata = pending.build_metadata()
            problems = metadata.structure_problems()  # each ack's files were checked as it arrived
            if problems:
                raise CheckpointException(R.FINALIZE_CHECKPOINT_FAILURE, "; ".join(problems[:3]))
            self._storage.create_exclusive(metadata_path, metadata.to_bytes())
            crash_point("jobmanager.checkpoint.metadata-written")
        except Exception as exc:
            # An existing _metadata is someone else's completed checkpoint: delete nothing then.
            self._abort(
                pending,
                R.FINALIZE_CHECKPOINT_FAILURE,
                _finalize_message(metadata_path, exc),
                allow_finalizing=True,
                cleanup=not isinstance(exc, FileExistsError),
            )
            return None
        return metadata

    def _add_to_store(
        self, pending: PendingCheckpoint, completed: CompletedCheckpoint
    ) -> list[CompletedCheckpoint] | None:
        """Add to the completed-checkpoint store; the checkpoints it subsumed, or None (and aborted) if refused."""
        try:
            return self._store.add_checkpoint(completed)
        except Exception as exc:
            cid = pending.checkpoint_id
            logger.exception(
                "job=%s checkpoint=%d could not be added to the completed-checkpoint store", self.job_id, cid
            )
            self._abort(
                pending,
                R.FINALIZE_CHECKPOINT_FAILURE,
                f"the completed-checkpoint store refused checkpoint {cid}: {exc}",
                allow_finalizing=True,
            )
            return None

    def _mark_completed(
        self, pending: PendingCheckpoint, now: int, released: list[str]
    ) -> tuple[list[PendingCheckpoint], list[str]]:
        """Record the completion; the older checkpoints in flight it subsumes, and the released files safe to delete now."""
        cid = pending.checkpoint_id
        with self._lock:
            pending.mark_completed()
            self._pending.pop(cid, None)
            self._remember(pending)
            if not pending.savepoint:
                self._last_completion_ms = now
                self._latest_checkpoint_id = max(self._latest_checkpoint_id, cid)
            self._latest_success_id = max(self._latest_success_id, cid)
            self._consecutive_failures = 0
            self._failover_fired = False
            to_subsume = (
                []
                if pending.savepoint
                else [
                    p
                    for p in self._pending.values()
                    if not p.savepoint and p.checkpoint_id < cid and p.status is PendingStatus.IN_PROGRESS
                ]
            )
            released = self._defer_locked(released, exclude={p.checkpoint_id for p in to_subsume})
        return to_subsume, released

    def _report_completed(self, pending: PendingCheckpoint, completed: CompletedCheckpoint, duration: int) -> None:
        metadata = completed.metadata
        logger.info(
            "job=%s checkpoint=%d completed in %d ms (%s, full %d B, incremental %d B)",
            self.job_id,
            pending.checkpoint_id,
            duration,
            completed.external_path,
            metadata.full_size,
            metadata.incremental_size,
        )
        self.stats.report_completed(
            pending.checkpoint_id,
            duration_ms=duration,
            full_size=metadata.full_size,
            incremental_size=metadata.incremental_size,
            path=completed.external_path,
            epoch=metadata.epoch,
        )

    # -- abort ---------------------------------------------------------------------------------
    def _abort(
        self,
        pending: PendingCheckpoint,
        reason: CheckpointFailureReason,
        message: str,
        *,
        allow_finalizing: bool = False,
        cleanup: bool = True,
    ) -> bool:
        """Abort ``pending`` once; delete what it wrote; count the failure. False if already finished."""
        marked = self._mark_aborted(pending, reason, message, allow_finalizing=allow_finalizing, cleanup=cleanup)
        if marked is None:
            return False
        candidates, fire, failures = marked
        duration = self._clock.monotonic_ms() - pending.trigger_monotonic_ms
        logger.warning("job=%s checkpoint=%d failed (%s): %s", self.job_id, pending.checkpoint_id, reason.name, message)
        self.stats.report_failed(pending.checkpoint_id, reason, message, duration_ms=duration)
        if cleanup:
            self._discard_aborted(pending, candidates)
        self._release_deferred()
        self._notify(pending.checkpoint_id, False)
        with self._lock:
            pending.release_acks()
        pending.future.set_exception(CheckpointException(reason, message))
        if fire:
            self._fail_over(pending, reason, message, failures)
        return True

    def _mark_aborted(
        self,
        pending: PendingCheckpoint,
        reason: CheckpointFailureReason,
        message: str,
        *,
        allow_finalizing: bool,
        cleanup: bool,
    ) -> tuple[list[str], bool, int] | None:
        """Mark ``pending`` aborted and count the failure; None if it already finished (or is finalizing,
        unless ``allow_finalizing``). Else the shared files to delete now, whether the job must fail over,
        and the consecutive failures so far."""
        fire = False
        with self._lock:
            if pending.status in (PendingStatus.ABORTED, PendingStatus.COMPLETED):
                return None
            if pending.status is PendingStatus.FINALIZING and not allow_finalizing:
                return None
            pending.mark_aborted(reason, message)
            self._pending.pop(pending.checkpoint_id, None)
            self._remember(pending)
            others = set().union(*(p.shared_files() for p in self._pending.values()))
            candidates = self._defer_locked(self._discardable(pending.shared_files() - others)) if cleanup else []
            if (
                reason.counts
                and pending.counted
                and not pending.savepoint
                and pending.checkpoint_id > self._latest_success_id
            ):
                self._consecutive_failures += 1
                if self._consecutive_failures > self.settings.tolerable_failures and not self._failover_fired:
                    fire = self._failover_fired = True
            return candidates, fire, self._consecutive_failures

    def _discard_aborted(self, pending: PendingCheckpoint, candidates: list[str]) -> None:
        self._cleaner.discard(
            files=self._registry.unreferenced(candidates),
            keep=self._keep,
            what=f"aborted checkpoint {pending.checkpoint_id} of job {self.job_id}",
            # shared/chk-<n>/ holds what TaskManagers uploaded for n, acknowledged or not (a dead one never acks);
            # no other checkpoint references it (files are reused only once n completed). Swept again later:
            # the last uploads of a dead TaskManager may still land.
            revisit=[
                pending.target_path,
                *(
                    []
                    if pending.savepoint
                    else [_paths.join(self.shared_dir, _paths.checkpoint_dir_name(pending.checkpoint_id))]
                ),
            ],
        )

    def _fail_over(
        self, pending: PendingCheckpoint, reason: CheckpointFailureReason, message: str, failures: int
    ) -> None:
        """Too many consecutive failures: hand the job to ``on_failover`` (once until a checkpoint completes)."""
        if self._on_failover is None:
            return
        cause = (
            f"{failures} consecutive checkpoints failed, more than {o.CHECKPOINT_TOLERABLE_FAILURES.key}="
            f"{self.settings.tolerable_failures}; the last: checkpoint {pending.checkpoint_id} {reason.name}: {message}"
        )
        logger.error("job=%s failing over: %s", self.job_id, cause)
        try:
            self._on_failover(reason, cause)
        except Exception:
            logger.exception("job=%s failover callback raised", self.job_id)

    def _discard_late_ack(self, pending: PendingCheckpoint, handle: SubtaskStateHandle) -> None:
        """Delete what an ack of an aborted checkpoint uploaded: its directory again, and its unreferenced shared files."""
        self._discard_ack(
            pending.target_path,
            lambda path: pending.relative_path(path, True),
            handle,
            f"late ack of aborted checkpoint {pending.checkpoint_id}",
        )

    def _discard_orphan_ack(self, checkpoint_id: CheckpointId, handle: SubtaskStateHandle) -> None:
        """Delete what an ack of a checkpoint this coordinator never knew uploaded (see :meth:`acknowledge`)."""
        prefix = _paths.SHARED_DIR + "/"
        self._discard_ack(
            _paths.join(self.job_dir, _paths.checkpoint_dir_name(checkpoint_id)),
            lambda path: "../" + path if path.startswith(prefix) else path,
            handle,
            f"ack of checkpoint {checkpoint_id} from an earlier JobManager",
        )

    def _discard_ack(self, target: str, relative: Callable[[str], str], handle: SubtaskStateHandle, what: str) -> None:
        """Delete ``target`` and the shared files ``handle`` names that nothing references.

        ``relative`` maps a path as the TaskManager sent it to one relative to ``target`` (an
        absolute URL is taken as it is).
        """
        shared: set[str] = set()
        # Changelog segments are shared files too (uploaded under shared/ by the same ack).
        for f in [*handle.files, *(StateFileHandle(c.path, c.size, c.sha256, shared=True) for c in handle.changelog)]:
            if not f.shared:
                continue
            resolved = relative(f.path)
            path = _paths.normalize(resolved) if "://" in resolved else _paths.join(target, resolved)
            if _paths.relative_to(path, self.shared_dir) is not None:
                shared.add(path)
        with self._lock:
            others = set().union(*(p.shared_files() for p in self._pending.values()))
            candidates = self._defer_locked(self._discardable(shared - others))
        self._cleaner.discard(
            directories=[target], files=self._registry.unreferenced(candidates), keep=self._keep, what=what
        )

    # -- shared-file deletion guard ------------------------------------------------------------
    def _discardable(self, files: set[str]) -> list[str]:
        """The shared files an aborted checkpoint's acks named that it may delete, sorted.

        A changelog slot's materialization (``shared/mat-*/``) was uploaded before the checkpoint
        and is referenced again by the slot's next ones: it belongs to its TaskManager until a
        completed checkpoint references it (then the registry counts it), and to gc after that.
        """
        return sorted(f for f in files if not _is_materialization(self.shared_dir, f))

    def _defer_locked(
        self, files: list[str], exclude: frozenset[CheckpointId] | set[CheckpointId] = frozenset()
    ) -> list[str]:
        """Files safe to delete now; the rest wait until the checkpoints now pending finish.

        A checkpoint still collecting acks may reference a shared file that just lost its last
        retained reference (its TaskManager reused it), so such files are held back until every
        checkpoint pending now has completed or aborted.
        """
        blockers = [
            p.checkpoint_id for p in self._pending.values() if not p.savepoint and p.checkpoint_id not in exclude
        ]
        if not files or not blockers:
            return files
        self._deferred.append((max(blockers), list(files)))
        return []

    def _release_deferred(self) -> None:
        with self._lock:
            if not self._deferred:
                return
            lowest = min((p.checkpoint_id for p in self._pending.values() if not p.savepoint), default=None)
            ready = [e for e in self._deferred if lowest is None or e[0] < lowest]
            self._deferred = [e for e in self._deferred if e not in ready]
        files = [f for _, fs in ready for f in fs]
        if files:
            self._cleaner.discard(
                files=self._registry.unreferenced(files),
                keep=self._keep,
                what=f"released shared files of job {self.job_id}",
            )

    def _keep(self, path: str) -> bool:
        """True for anything a retained or protected checkpoint still needs (checked again just before deleting)."""
        path = _paths.normalize(path)
        if self._registry.is_referenced(path):
            return True
        with self._protected_lock:
            protected = list(self._protected.items())
        bases = [c.external_path for c in self._store.all()] + [base for base, _ in protected]
        for base in bases:
            if path == base or path.startswith(base + "/") or base.startswith(path + "/"):
                return True
        return any(path in files for _, files in protected)

    def protect(self, checkpoint: CompletedCheckpoint) -> Callable[[], None]:
        """Keep ``checkpoint`` (its directory and every file it references) from being deleted, even
        once newer checkpoints subsume it, until the returned function is called.

        A restore holds it from before the checkpoint it takes of the running job (which may
        subsume its source) until the job runs from the source.
        """
        base = _paths.normalize(checkpoint.external_path)
        files = frozenset(_paths.join(base, f.path) for _, _, f in checkpoint.metadata.files())
        with self._protected_lock:
            self._protected[base] = files

        def release() -> None:
            with self._protected_lock:
                self._protected.pop(base, None)

        return release

    # -- waiting, restore, shutdown ------------------------------------------------------------
    def wait_for(self, checkpoint_id: CheckpointId, timeout: float | None = None) -> CompletedCheckpoint:
        """Block until checkpoint ``checkpoint_id`` completes (returned) or fails (CheckpointException).

        ``timeout`` is in seconds; when it runs out first, CheckpointInProgressError is raised and
        the checkpoint carries on.
        """
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            recent = self._recent.get(checkpoint_id)
            if pending is None and recent is not None:
                pending = recent.pending()
        if pending is None:
            for c in self._store.all():
                if c.checkpoint_id == checkpoint_id:
                    return c
            if recent is not None:
                raise CheckpointNotFoundError(
                    f"checkpoint {checkpoint_id} of job {self.job_id} completed, and a newer checkpoint has "
                    "subsumed (deleted) it since; statectl checkpoint list shows the retained ones"
                )
            raise CheckpointNotFoundError(
                f"checkpoint {checkpoint_id} of job {self.job_id} is unknown (not in progress and not among the "
                "recently finished ones); statectl checkpoint list shows the known checkpoints"
            )
        try:
            return pending.future.result(timeout)
        except TimeoutError:
            raise CheckpointInProgressError(
                f"checkpoint {checkpoint_id} of job {self.job_id} is still in progress "
                f"({pending.num_acknowledged}/{len(pending.expected)} subtasks acknowledged); wait again"
            ) from None

    def restore_latest(self) -> CheckpointMetadata | None:
        """The metadata of the latest completed checkpoint (or savepoint), recorded as restored; None if none."""
        latest = self._store.latest()
        if latest is None:
            return None
        self.stats.report_restored(latest.checkpoint_id, self._clock.now_ms())
        return latest.metadata

    def restore_from(self, checkpoint: CompletedCheckpoint, *, claim: bool = False) -> None:
        """Record that the job was restored from ``checkpoint`` (loaded from storage).

        Checkpoint ids continue after it, so no ``chk-<n>`` is reused. With ``claim`` (claim mode
        CLAIM), it joins the store as one of the job's checkpoints, even a savepoint or another
        job's checkpoint, and its shared files are reference-counted: once subsumed it is deleted
        like any other (its directory, and the shared files no retained checkpoint uses). Without
        it the files stay untouched; TaskManagers must then not reference them from new checkpoints.
        """
        if claim:
            self.recover([checkpoint.taken_over()])
        elif self._ids.get() <= checkpoint.checkpoint_id:
            self._ids.set_count(checkpoint.checkpoint_id + 1)
        self.stats.report_restored(checkpoint.checkpoint_id, self._clock.now_ms())

    def recover(self, checkpoints: Sequence[CompletedCheckpoint]) -> None:
        """Take back the completed checkpoints a restarted JobManager found (high availability).

        They join the store in id order (its retention applies as usual) and their shared
        files are reference-counted again; checkpoint ids continue after every one of them.
        """
        for checkpoint in sorted(checkpoints, key=lambda c: c.checkpoint_id):
            if self._ids.get() <= checkpoint.checkpoint_id:
                self._ids.set_count(checkpoint.checkpoint_id + 1)
            subsumed = self._store.add_checkpoint(checkpoint)
            if checkpoint.savepoint:
                continue  # the user's files: never reference-counted, never deleted
            self._registry.register(checkpoint)
            released = [f for old in subsumed for f in self._registry.unregister(old)]
            with self._lock:
                self._latest_checkpoint_id = max(self._latest_checkpoint_id, checkpoint.checkpoint_id)
                self._latest_success_id = max(self._latest_success_id, checkpoint.checkpoint_id)
            if subsumed:
                self._cleaner.discard(
                    directories=[s.external_path for s in subsumed],
                    files=released,
                    keep=self._keep,
                    what=f"checkpoints subsumed by recovered {checkpoint.checkpoint_id}",
                )

    def reset_failure_counter(self) -> None:
        """Forget consecutive failures (after the job failed over and restarted)."""
        with self._lock:
            self._consecutive_failures = 0
            self._failover_fired = False

    def shutdown(self) -> None:
        """Stop periodic checkpoints, abort pending ones (CHECKPOINT_COORDINATOR_SHUTDOWN), finish deletions."""
        with self._lock:
            if self._shutdown:
                return
            self._shutdown = True
            self._periodic_running = False
            handle, self._periodic_handle = self._periodic_handle, None
        if handle is not None:
            handle.cancel()
        self.abort_pending(
            R.CHECKPOINT_COORDINATOR_SHUTDOWN, f"the checkpoint coordinator of job {self.job_id} shut down"
        )
        if self._owns_cleaner:
            self._cleaner.close()

    # -- helpers -------------------------------------------------------------------------------
    def _remember(self, pending: PendingCheckpoint) -> None:
        # A completed one only weakly: its future holds the CompletedCheckpoint, whose metadata lists
        # every file of the job. Holding 128 of them kept 128 checkpoints' file lists alive after
        # the store had let them go (memory, and garbage-collection scans, growing with the job).
        # Whoever triggered it holds the pending, so its wait_for still gets the result.
        if pending.status is PendingStatus.COMPLETED:
            ref: Callable[[], PendingCheckpoint | None] = weakref.ref(pending)
        else:
            ref = functools.partial(_same, pending)
        self._recent[pending.checkpoint_id] = _Finished(pending.status, ref)
        while len(self._recent) > _RECENT:
            self._recent.popitem(last=False)

    def _notify(self, checkpoint_id: CheckpointId, completed: bool) -> None:
        try:
            self._gateway.notify(self.job_id, checkpoint_id, completed)
        except Exception as exc:
            logger.info(
                "job=%s checkpoint=%d could not notify TaskManagers (%s): %s",
                self.job_id,
                checkpoint_id,
                "completed" if completed else "aborted",
                exc,
            )


def _same(pending: PendingCheckpoint) -> PendingCheckpoint:
    return pending


def _finalize_message(metadata_path: str, exc: BaseException) -> str:
    if isinstance(exc, CheckpointException):
        return exc.detail
    if isinstance(exc, FileExistsError):
        return (
            f"{metadata_path} already exists: another JobManager or an earlier run of this job id wrote it; "
            "checkpoint ids must not be reused (restore from that checkpoint, or use a new job id or checkpoint dir)"
        )
    detail = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return f"could not write {metadata_path}: {detail}"


def _check_running(job_id: JobId, required: frozenset[SubtaskId], running: frozenset[SubtaskId] | None) -> None:
    """Refuse a checkpoint of a job with no subtask, or while one it needs is not running."""
    if not required:
        raise CheckpointException(R.NOT_ALL_REQUIRED_TASKS_RUNNING, f"job {job_id} has no subtasks to checkpoint")
    if running is not None:
        missing = sorted(required - running)
        if missing:
            shown = ", ".join(str(s) for s in missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            raise CheckpointException(
                R.NOT_ALL_REQUIRED_TASKS_RUNNING, f"{len(missing)} subtask(s) are not running: {shown}"
            )


def _is_materialization(shared_dir: str, path: str) -> bool:
    """A file of a changelog slot's background materialization (``shared/mat-<id>/...``)."""
    relative = _paths.relative_to(path, shared_dir)
    return relative is not None and relative.startswith(_paths.MATERIALIZATION_GROUP_PREFIX)
