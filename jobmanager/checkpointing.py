"""Wires the checkpoint coordinator into the JobManager: one coordinator per job.

The Dispatcher calls this layer at the points of a job's life that involve state: submission
(restore planning), running (periodic checkpoints), acknowledgements from TaskManagers,
triggers from statectl and Spark drivers, rescaling and failover.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from keyedstate.common.claim_mode import RecoveryClaimMode
from keyedstate.common.clock import Clock, Scheduler
from keyedstate.common.config import Configuration
from keyedstate.common.config import options as o
from keyedstate.common.errors import (
    CheckpointError,
    CorruptCheckpointError,
    InvalidArgumentError,
    KeyedStateError,
    UnavailableError,
)
from keyedstate.common.handles import CheckpointBarrier, SlotRestore, SubtaskStateHandle
from keyedstate.common.ids import CheckpointId, JobId, SubtaskId, TaskManagerId
from keyedstate.common.lifecycle import JobStatus
from keyedstate.common.storage import CheckpointStorage, FileInfo, StorageCache, scheme_of
from keyedstate.jobmanager.checkpoint import (
    AckOutcome,
    CheckpointCoordinator,
    CheckpointException,
    CheckpointFailureReason,
    CheckpointingSettings,
    CheckpointStatsTracker,
    CheckpointStatus,
    CheckpointSummary,
    CompletedCheckpoint,
    CoordinatorConfig,
    CoordinatorServices,
    DeclineReason,
    EpochCut,
    RestoreOwnership,
    _paths,
    decide_ownership,
    find_latest_checkpoint,
    load_completed_checkpoint,
    plan_restore,
    references_restored,
    verify_checksums,
    verify_files_exist,
)
from keyedstate.jobmanager.checkpoint.decisions import DecisionLog, next_generation
from keyedstate.jobmanager.ha import HighAvailabilityServices, create_ha_services
from keyedstate.jobmanager.ha.checkpoint_store import CheckpointPointer
from keyedstate.jobmanager.ha.job_store import JobRecord
from keyedstate.jobmanager.jobs import EMPTY_PLAN, Job, JobRun, JobSpec, RestorePlan
from keyedstate.jobmanager.status_times import JobStatusTimes
from keyedstate.jobmanager.taskmanager_gateway import TaskManagerGateways

FailOver = Callable[[str, str], None]
"""``fail_over(job_id, cause)``: what a job's coordinator calls when too many checkpoints failed (the
Dispatcher's failover, passed in by whoever attaches the coordinator)."""

logger = logging.getLogger(__name__)


def overlapped_commits(job: Job) -> bool:
    """Whether ``job`` commits its epochs overlapped (``execution.checkpointing.commit-mode``)."""
    return bool(job.config.get(o.CHECKPOINT_COMMIT_MODE) == "overlapped")


@dataclass(frozen=True)
class CheckpointTrigger:
    """A request to take a checkpoint or savepoint now (statectl, a Spark driver, the client)."""

    savepoint: bool = False
    target_dir: str | None = None
    """Where a savepoint goes (None: ``state.savepoints.dir``); checkpoints always go to the job directory."""
    wait: bool = False
    """Answer only once it completed or failed (or ``timeout_ms`` ran out)."""
    timeout_ms: int = 0
    """How long to wait for a turn and for the outcome; 0: the job's checkpoint timeout for the turn, no limit after."""


@dataclass(frozen=True)
class CheckpointDecline:
    """A subtask's refusal to take a checkpoint, with the TaskManager's cause."""

    checkpoint_id: CheckpointId
    subtask: SubtaskId
    message: str
    reason: DeclineReason = DeclineReason.UNSPECIFIED


class _JobGateway:
    """The coordinator's view of the TaskManagers hosting one job."""

    def __init__(self, taskmanagers: TaskManagerGateways, executor: Executor, job: Job) -> None:
        self._taskmanagers = taskmanagers
        self._executor = executor
        self._job = job
        # The TaskManagers of the deployment the current cut saw (set and used under the epoch lock).
        self._cut_addresses: dict[str, int] = {}

    def _addresses(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        with self._job.lock:
            assignments = list(self._job.assignments.values())
        for a in assignments:
            counts[a.address] = counts.get(a.address, 0) + 1
        return counts

    @contextmanager
    def cut(self) -> Iterator[EpochCut]:
        """The job's committed epoch and running subtasks, with epoch commits held back (see CheckpointGateway.cut)."""
        # The epoch lock keeps epoch commits out while the coordinator records the epoch and
        # sends the barrier, so every slot of one checkpoint holds exactly that epoch (and a
        # slot that does not refuses the barrier). The deployment is read with the epoch: a job
        # that is not RUNNING has nothing to checkpoint, and the barrier goes to exactly the
        # TaskManagers whose subtasks the coordinator counted.
        with self._job.epoch_lock:
            with self._job.lock:
                job = self._job
                running = job.status is JobStatus.RUNNING
                assignments = list(job.assignments.values()) if running else []
                cut = EpochCut(job.committed_epoch, job.lineage, frozenset(a.subtask for a in assignments))
            counts: dict[str, int] = {}
            for a in assignments:
                counts[a.address] = counts.get(a.address, 0) + 1
            self._cut_addresses = counts
            try:
                yield cut
            finally:
                self._cut_addresses = {}

    def send_barrier(self, barrier: CheckpointBarrier) -> None:
        """The barrier to every TaskManager the cut counted; UnavailableError if one takes it in fewer slots."""
        targets = self._cut_addresses
        if not targets:
            raise UnavailableError(f"job {self._job.job_id} runs no subtask to take checkpoint {barrier.checkpoint_id}")
        for address, expected in targets.items():
            slots = self._taskmanagers.trigger_checkpoint(address, barrier)
            if slots != expected:
                raise UnavailableError(
                    f"TaskManager {address} took the barrier of checkpoint {barrier.checkpoint_id} in "
                    f"{slots} slots, but hosts {expected} subtasks of job {self._job.job_id}"
                )

    def notify(self, job_id: JobId, checkpoint_id: CheckpointId, completed: bool) -> None:
        # Best effort. A completion is told before anyone learns of it (the next incremental
        # checkpoint builds on it); an abort goes out in the background, because a failover
        # aborts checkpoints while it holds the job's lock and a TaskManager may be unreachable.
        if completed:
            self._notify_all(job_id, checkpoint_id, completed)
        else:
            self._executor.submit(self._notify_all, job_id, checkpoint_id, completed)

    def _notify_all(self, job_id: JobId, checkpoint_id: CheckpointId, completed: bool) -> None:
        for address in self._addresses():
            try:
                self._taskmanagers.notify_checkpoint(address, job_id, checkpoint_id, completed)
            except KeyedStateError as exc:
                logger.info("notify checkpoint %d to %s: %s", checkpoint_id, address, exc.message)


class Checkpointing:
    """The checkpoint side of every job: coordinators, storage, restore planning and the HA store.

    Below the Dispatcher: it is handed the jobs it works on and never looks them up, so it knows
    nothing of the job table, failover or the RPC layer.
    """

    def __init__(
        self,
        conf: Configuration,
        clock: Clock,
        scheduler: Scheduler,
        metrics_registry: CollectorRegistry,
        taskmanagers: TaskManagerGateways,
        executor: Executor,
    ) -> None:
        self._conf = conf
        self._clock = clock
        self._scheduler = scheduler
        self._metrics_registry = metrics_registry
        self._taskmanagers = taskmanagers
        self._executor = executor
        self._stop = threading.Event()
        self._storages = StorageCache(conf, self._stop)
        self.ha: HighAvailabilityServices = create_ha_services(conf, self._storages.for_url)
        # Where this JobManager keeps checkpoints in memory (execution.checkpointing.storage: jobmanager):
        # its own name, so a checkpoint path never resolves in another JobManager, even in this process.
        self._memory_root = f"jobmanager://{uuid.uuid4().hex[:12]}"

    # -- storage -----------------------------------------------------------------------------
    def storage(self, url: str, job: Job | None = None) -> CheckpointStorage:
        """The (cached) checkpoint storage for ``url``, with the job's storage options when ``job`` is given."""
        return self._storages.for_url(url, job.config if job is not None else None)

    def _checkpoints_dir(self, job: Job) -> str | None:
        if job.config.get(o.CHECKPOINT_STORAGE) == "jobmanager":
            return self._memory_root
        directory: str | None = job.config.get(o.CHECKPOINTS_DIR)
        return directory

    def job_dir(self, job: Job) -> str:
        """Where the job's ``chk-<n>`` directories go (``state.checkpoints.dir``/job id, or
        ``jobmanager://<this JobManager>/<job id>`` in memory); "" without checkpoint storage."""
        base = self._checkpoints_dir(job)
        return _paths.join(_paths.normalize(base), job.job_id) if base else ""

    # -- job lifecycle -----------------------------------------------------------------------
    def attach(self, job: Job, fail_over: FailOver, recovering: bool = False) -> None:
        """Give ``job`` its checkpoint coordinator (none without ``state.checkpoints.dir``).

        A fresh submission under a job id used before starts with no completed checkpoints of
        its own (the old job's checkpoints stay in storage, restorable by path), but its ids
        continue after every ``chk-<n>`` already in the job directory.
        """
        base = self._checkpoints_dir(job)
        if not base:
            return
        job_dir = self.job_dir(job)
        settings = CheckpointingSettings.from_config(job.config)
        storage: CheckpointStorage = self.storage(job_dir, job)
        if settings.inline_max_state_size:
            # Checkpoints in memory, savepoints in their directory: each path to its own storage.
            storage = _StorageByUrl(lambda url: self.storage(url, job))
        store = self.ha.completed_checkpoint_store(job.job_id, settings.num_retained)
        if not recovering:
            for pointer in self.ha.checkpoint_pointers(job.job_id):
                self.ha.remove_checkpoint_pointer(job.job_id, pointer.checkpoint_id)
        id_counter = self.ha.checkpoint_id_counter(job.job_id, floor=_next_unused_checkpoint_id(storage, job_dir))
        if not recovering:
            job.checkpoints_from = id_counter.get()
            if overlapped_commits(job):
                # A new job: decisions made on top of the state of an earlier job under this id stay in
                # their generation and are never replayed.
                job.changelog_generation = next_generation(storage, job_dir, above=job.changelog_generation)
        config = CoordinatorConfig(
            JobId(job.job_id),
            job_dir,
            job.spec.max_parallelism,
            settings,
            savepoints_dir=job.config.get(o.SAVEPOINTS_DIR),
        )
        services = CoordinatorServices(
            storage,
            _JobGateway(self._taskmanagers, self._executor, job),
            self._clock,
            self._scheduler,
            id_counter=id_counter,
            store=store,
            stats=CheckpointStatsTracker(
                JobId(job.job_id), self._metrics_registry, history_size=job.config.get(o.WEB_CHECKPOINTS_HISTORY)
            ),
        )
        coordinator = CheckpointCoordinator(
            config,
            services,
            operators=lambda: job.spec.operators,
            tasks=lambda: set(job.assignments),
            on_failover=lambda reason, message: fail_over(
                job.job_id, f"too many failed checkpoints ({reason.name}): {message}"
            ),
        )
        try:
            coordinator.initialize_locations()
        except BaseException:
            coordinator.shutdown()
            raise
        job.coordinator = coordinator

    def detach(self, job: Job) -> None:
        """Stop ``job``'s coordinator (cancel, failure, shutdown); its store still answers job info."""
        if job.coordinator is not None:
            job.coordinator.shutdown()

    def job_running(self, job: Job, plan: RestorePlan = EMPTY_PLAN) -> None:
        """``job`` runs (again), deployed from ``plan``: periodic checkpoints start and the failure count
        starts over (caller holds ``job.lock``).

        A ``plan`` that replayed decided epochs (overlapped commits) is followed by a checkpoint at the
        replayed epoch, taken in the background (:meth:`_checkpoint_replay`): without it an idle job keeps
        depending on the replayed change sets and decisions, and a second failure replays them again.
        """
        coordinator = job.coordinator
        if coordinator is None:
            return
        coordinator.reset_failure_counter()
        coordinator.start_periodic()
        log = self.decision_log(job)
        if plan.replayed_epochs and log is not None:
            # Not here: the cut takes the epoch lock, which is taken before the job's lock held here.
            self._executor.submit(self._checkpoint_replay, job, coordinator, plan.epoch, log)

    def _checkpoint_replay(self, job: Job, coordinator: CheckpointCoordinator, epoch: int, log: DecisionLog) -> None:
        """A checkpoint of ``job`` at (or above) the replayed ``epoch``, then the changelog it covers is deleted.

        An ordinary checkpoint (barrier, acks, ``_metadata`` last), uncounted: failing it must not fail
        over the job whose restore just succeeded. If none completes within the checkpoint timeout, the
        replayed changelog stays: the next periodic or after-batch checkpoint covers it.
        """
        try:
            latest = coordinator.checkpoint_holding(
                epoch,
                self._stop,
                counted=False,
                # Not once the job restarts again (its next restore checkpoints for itself), nor after
                # an operator restore replaced the run (its changelog is not this log's).
                wanted=lambda: job.status is JobStatus.RUNNING and job.coordinator is coordinator,
            ).checkpoint
            if latest is None:
                return
            deleted = log.collect_after_checkpoint(coordinator.retained_epochs())
        except Exception:  # a bug: logged here, since nothing waits for this background task's outcome
            logger.exception("job %s: checkpointing the replayed epochs through %d failed", job.job_id, epoch)
            return
        logger.info(
            "job %s: checkpoint %d holds the replayed epochs through %d; %d changelog directories deleted",
            job.job_id,
            latest.checkpoint_id,
            epoch,
            deleted,
        )

    def _coordinator(self, job: Job) -> CheckpointCoordinator:
        job_id = job.job_id
        if job.coordinator is None:
            raise InvalidArgumentError(
                f"job {job_id!r} has no checkpoint storage; set state.checkpoints.dir (for example file:///var/checkpoints "
                "or s3://bucket/checkpoints) on the JobManager or in the job's config"
            )
        return job.coordinator

    # -- restore -----------------------------------------------------------------------------
    def plan_restore(self, job: Job, path: str, *, recovery: bool = False) -> RestorePlan:
        """What deploying ``job`` from the checkpoint or savepoint at ``path`` needs (loaded and verified).

        ``recovery``: ``path`` is the job's own latest retained checkpoint (failover, a new leader),
        which it owns whatever claim mode it was first restored in; otherwise ``job.claim_mode``
        decides who owns the files.
        """
        storage = self.storage(path, job)
        checkpoint = load_completed_checkpoint(storage, path)
        verify_files_exist(storage, checkpoint.metadata, checkpoint.external_path)
        ownership = self.ownership(job, checkpoint, recovery=recovery)
        plan = self.restore_plan(job, checkpoint, ownership)
        self._restored_from(job, checkpoint, ownership)
        return plan

    def ownership(
        self,
        job: Job,
        checkpoint: CompletedCheckpoint,
        mode: RecoveryClaimMode | None = None,
        *,
        recovery: bool = False,
    ) -> RestoreOwnership:
        """Who owns ``checkpoint``'s files once ``job`` restores from it (``mode``: the job's claim mode).

        A job without checkpoint storage never deletes nor references anything, so its restores
        leave the files to the user.
        """
        if job.coordinator is None:
            return RestoreOwnership.USER
        return decide_ownership(mode or job.claim_mode, checkpoint, self.job_dir(job), recovery=recovery)

    def verify_restore(self, job: Job, path: str) -> CompletedCheckpoint:
        """Everything a restore of ``job`` from ``path`` can check before it changes anything.

        ``_metadata`` loads and validates, the checkpoint fits the job (max parallelism,
        operators, states), and every file exists with its recorded size and SHA-256 (each is
        read once). Raises the CheckpointError that names what is wrong.
        """
        storage = self.storage(path, job)
        checkpoint = load_completed_checkpoint(storage, path)
        self.restore_plan(job, checkpoint)  # compatibility: cheap, so before reading every file
        verify_files_exist(storage, checkpoint.metadata, checkpoint.external_path)
        verify_checksums(
            storage, checkpoint.metadata, checkpoint.external_path, threads=job.config.get(o.ROCKSDB_TRANSFER_THREADS)
        )
        return checkpoint

    def next_run(self, job: Job, checkpoint: CompletedCheckpoint, claim_mode: RecoveryClaimMode) -> JobRun:
        """The run an operator restore of ``job`` from ``checkpoint`` starts (nothing is changed or written).

        Its checkpoint ids start at the next unused one, and (overlapped commits) its decisions go to a
        changelog generation above every one in storage and the job's own, so that neither a decision
        of the replaced state nor one of an earlier run still in flight is ever replayed over ``checkpoint``.
        """
        job_dir = self.job_dir(job)
        storage = self.storage(job_dir, job)
        id_counter = self.ha.checkpoint_id_counter(job.job_id, floor=_next_unused_checkpoint_id(storage, job_dir))
        generation = job.changelog_generation
        if self.decision_log(job) is not None:  # overlapped commits with decisions in checkpoint storage
            generation = next_generation(storage, job_dir, above=generation)
        return JobRun(checkpoint.external_path, claim_mode, id_counter.get(), generation)

    def adopt_restore(
        self, job: Job, checkpoint: CompletedCheckpoint, ownership: RestoreOwnership, fail_over: FailOver
    ) -> None:
        """After ``job`` was redeployed from ``checkpoint`` in place: its checkpoints start over from it.

        The job gets a new coordinator for the run the restore recorded before it deployed
        (:meth:`next_run`): the checkpoints taken before the restore stay in storage but are no
        longer the job's (``Job.checkpoints_from`` is past them), so a later failover, even a new
        leader's, restores ``checkpoint`` or a newer one, never the state the restore replaced.
        """
        self.detach(job)
        job.coordinator = None
        self.attach(job, fail_over, recovering=True)  # the run is recorded already: keep it
        self._drop_earlier_runs(job)
        self._restored_from(job, checkpoint, ownership)

    def _of_current_run(self, job: Job, pointer: CheckpointPointer) -> bool:
        """Whether an HA pointer names a checkpoint of ``job``'s current run (or the source it claimed)."""
        claimed_source = job.claim_mode is RecoveryClaimMode.CLAIM and pointer.external_path == job.restore_path
        return pointer.checkpoint_id >= job.checkpoints_from or claimed_source

    def _drop_earlier_runs(self, job: Job) -> None:
        """Remove the HA pointers of checkpoints that hold state an operator restore replaced."""
        for pointer in self.ha.checkpoint_pointers(job.job_id):
            if not self._of_current_run(job, pointer):
                self.ha.remove_checkpoint_pointer(job.job_id, pointer.checkpoint_id)

    def _restored_from(self, job: Job, checkpoint: CompletedCheckpoint, ownership: RestoreOwnership) -> None:
        # CLAIMED joins the store and the shared-state registry (deleted once subsumed); OWNED is there
        # already; USER stays out of both, so nothing of it is ever deleted by this job.
        if job.coordinator is not None:
            job.coordinator.restore_from(checkpoint, claim=ownership is RestoreOwnership.CLAIMED)
            referenced = ownership.job_owns_files and references_restored(checkpoint, self.job_dir(job))
            logger.info(
                "job %s restored from %s: files %s (claim mode %s); the next checkpoint %s",
                job.job_id,
                checkpoint.external_path,
                ownership.value,
                job.claim_mode.value,
                "references its shared files" if referenced else "uploads the whole state",
            )

    def restore_plan(
        self, job: Job, checkpoint: CompletedCheckpoint, ownership: RestoreOwnership = RestoreOwnership.USER
    ) -> RestorePlan:
        """Which subtask of ``job`` restores what from ``checkpoint``; IncompatibleCheckpointError if it does not fit."""
        plan = plan_restore(
            checkpoint.metadata,
            list(job.spec.operators),
            job.spec.max_parallelism,
            checkpoint_dir=checkpoint.external_path,
            job_id=JobId(job.job_id),
        )
        if scheme_of(checkpoint.external_path) == "jobmanager":
            # Held in this JobManager's memory, out of the TaskManagers' reach: the bytes go with the restore.
            storage = self.storage(checkpoint.external_path, job)
            plan = {subtask: [_with_bytes(storage, h) for h in handles] for subtask, handles in plan.items()}
        slots = {
            subtask: SlotRestore(
                checkpoint_id=CheckpointId(checkpoint.checkpoint_id),
                handles=tuple(handles),
                checkpoint_path=checkpoint.external_path,
                owned=ownership.job_owns_files,
            )
            for subtask, handles in plan.items()
        }
        # The job's state will be exactly what the checkpoint holds: epochs after it run again.
        return RestorePlan(slots, checkpoint.metadata.epoch, checkpoint.metadata.lineage, checkpoint.external_path)

    def plan_latest(self, job: Job) -> RestorePlan:
        """A restart's plan: the latest completed checkpoint; before the first one, what the job was
        submitted from; else empty state. With overlapped commits, continued by the decided epochs above it."""
        latest = job.coordinator.latest_completed() if job.coordinator is not None else None
        if latest is not None:
            plan = self.plan_restore(job, latest.external_path, recovery=True)
        else:
            plan = self.plan_restore(job, job.restore_path) if job.restore_path else EMPTY_PLAN
        return self._continue_with_decisions(job, plan)

    def decision_log(self, job: Job) -> DecisionLog | None:
        """The job's decisions (overlapped commits with filesystem checkpoint storage), else None."""
        job_dir = self.job_dir(job)
        if not overlapped_commits(job) or not job_dir or job.config.get(o.CHECKPOINT_STORAGE) == "jobmanager":
            return None
        return DecisionLog(self.storage(job_dir, job), job_dir, job.changelog_generation)

    def _continue_with_decisions(self, job: Job, plan: RestorePlan) -> RestorePlan:
        """``plan`` followed by the decided epochs above it; the epoch after the last is sealed (see DecisionLog)."""
        log = self.decision_log(job)
        if log is None:
            return plan
        # The seal carries the version this restore deploys under (the deploy moves it by one);
        # every decision of an older deployment is below it.
        decisions = log.continuation(plan.epoch, routing_version=job.routing_version + 1)
        if not decisions:
            return plan
        lineage = plan.lineage
        for d in decisions:
            lineage = lineage.bind(d.query_id, d.batch_id, d.epoch)
        logger.info(
            "job %s: the restore at epoch %d replays decided epochs %d..%d",
            job.job_id,
            plan.epoch,
            decisions[0].epoch,
            decisions[-1].epoch,
        )
        return dataclasses.replace(
            plan,
            epoch=decisions[-1].epoch,
            lineage=lineage,
            replay=tuple(f for d in decisions for f in d.change_sets),
            replayed_epochs=len(decisions),
        )

    # -- RPC entry points --------------------------------------------------------------------
    def trigger_request(self, job: Job, request: CheckpointTrigger) -> CheckpointSummary:
        """Trigger a checkpoint or savepoint of ``job``; waits for the outcome when ``request.wait``.

        A refusal or a failure is an answer (status FAILED with its reason), not an error: the
        caller decides whether to retry.
        """
        coordinator = self._coordinator(job)
        try:
            # A checkpoint in flight or the minimum pause is waited out rather than refused.
            turn_ms = request.timeout_ms or coordinator.settings.timeout_ms
            pending = coordinator.trigger_waiting(
                turn_ms,
                savepoint=request.savepoint,
                target_dir=request.target_dir,
                closed=self._stop,
            )
        except CheckpointException as exc:
            return CheckpointSummary(CheckpointId(0), CheckpointStatus.FAILED, failure_reason=_failure(exc))
        if not request.wait:
            return CheckpointSummary(
                pending.checkpoint_id,
                CheckpointStatus.IN_PROGRESS,
                path=pending.target_path,
                savepoint=request.savepoint,
            )
        return self._wait(
            coordinator,
            pending.checkpoint_id,
            request.timeout_ms / 1000.0 if request.timeout_ms else None,
            request.savepoint,
        )

    def _wait(
        self, coordinator: CheckpointCoordinator, checkpoint_id: CheckpointId, timeout: float | None, savepoint: bool
    ) -> CheckpointSummary:
        try:
            completed = coordinator.wait_for(checkpoint_id, timeout)
        except CheckpointException as exc:
            return CheckpointSummary(
                checkpoint_id, CheckpointStatus.FAILED, failure_reason=_failure(exc), savepoint=savepoint
            )
        except CheckpointError as exc:
            return CheckpointSummary(checkpoint_id, CheckpointStatus.IN_PROGRESS, failure_reason=exc.message)
        return CheckpointSummary.of_completed(completed)

    def acknowledge(self, job: Job, checkpoint_id: CheckpointId, handle: SubtaskStateHandle) -> AckOutcome:
        """A subtask's snapshot of ``job`` is uploaded; what the coordinator did with it (UNKNOWN without one)."""
        if job.coordinator is None:
            return AckOutcome.UNKNOWN
        return job.coordinator.acknowledge(checkpoint_id, handle)

    def decline(self, job: Job, decline: CheckpointDecline) -> AckOutcome:
        """A subtask of ``job`` cannot take the checkpoint: abort it; what the coordinator did."""
        if job.coordinator is None:
            return AckOutcome.UNKNOWN
        # A state too large for the JobManager's memory has its own reason (the fix differs);
        # every other decline aborts as CHECKPOINT_DECLINED, the message saying what failed.
        reason = (
            CheckpointFailureReason.STATE_SIZE_LIMIT_EXCEEDED
            if decline.reason is DeclineReason.STATE_SIZE_LIMIT_EXCEEDED
            else CheckpointFailureReason.CHECKPOINT_DECLINED
        )
        return job.coordinator.decline(decline.checkpoint_id, decline.subtask, decline.message, reason)

    def list_checkpoints(self, job: Job) -> list[CheckpointSummary]:
        """The checkpoint history of ``job`` (in flight, completed and failed), newest first."""
        coordinator = self._coordinator(job)
        return [e.summary() for e in coordinator.stats.history()]

    def checkpoint_now(self, job: Job) -> CompletedCheckpoint:
        """A completed checkpoint taken now (before a rescale or a restore redeploys the job), waiting
        for one in flight instead of being refused."""
        coordinator = self._coordinator(job)
        timeout_ms = coordinator.settings.timeout_ms
        pending = coordinator.trigger_waiting(timeout_ms, closed=self._stop)
        return coordinator.wait_for(pending.checkpoint_id, timeout_ms / 1000.0)

    # -- high availability ---------------------------------------------------------------------
    def persist(self, job: Job, *, strict: bool = False) -> None:
        """Write the job's record to the HA store (no-op without high availability).

        ``strict`` (submission, cancel, rescale) raises when the record cannot be written, so
        the caller's change fails visibly; during failover a storage outage is logged instead,
        because blocking a restart on it would make the outage worse.
        """
        if not self.ha.enabled:
            return
        record = JobRecord(
            spec=job.spec.to_dict(),
            status=job.status.value,
            routing_version=job.routing_version,
            restarts=job.restarts,
            failure_cause=job.failure_cause,
            restore_path=job.restore_path,
            taskmanagers=sorted(job.last_taskmanagers),
            checkpoints_from=job.checkpoints_from,
            claim_mode=job.claim_mode.value,
            changelog_generation=job.changelog_generation,
        )
        try:
            self.ha.put_job(record)
        except KeyedStateError as exc:
            if strict:
                raise
            logger.error("job %s: could not write its high-availability record: %s", job.job_id, exc.message)
        except OSError as exc:
            if strict:
                raise UnavailableError(f"job {job.job_id}: high-availability store unreachable: {exc}") from exc
            logger.error("job %s: could not write its high-availability record: %s", job.job_id, exc)

    def recover_jobs(self, address: str, on_leadership_lost: Callable[[str], None], fail_over: FailOver) -> list[Job]:
        """After a JobManager restart: take leadership, load every job and its completed checkpoints.

        Runs before the server accepts calls, so a Spark driver resubmitting its job finds it.
        Redeployment waits for TaskManagers and runs in the background (:func:`recovery.resume`).
        """
        self.ha.start(address, on_leadership_lost)
        jobs = []
        for record in self.ha.job_records():
            try:
                jobs.append(self._recover_job(record, fail_over))
            except KeyedStateError as exc:
                logger.error("job %s could not be recovered: %s", record.job_id, exc.message)
        return jobs

    def _recover_job(self, record: JobRecord, fail_over: FailOver) -> Job:
        spec = JobSpec.from_dict(record.spec)
        job = Job(spec, self._conf.with_values(dict(spec.config)), times=JobStatusTimes(self._clock))
        job.restore_path = record.restore_path
        job.claim_mode = RecoveryClaimMode.parse(record.claim_mode, f"the high-availability record of job {job.job_id}")
        job.checkpoints_from = record.checkpoints_from
        job.changelog_generation = record.changelog_generation
        job.restarts = record.restarts
        job.last_taskmanagers = frozenset(TaskManagerId(t) for t in record.taskmanagers)
        # Clients keep the newest routing version they saw, and slots refuse calls of another
        # version: the recovered job's versions continue above every version an earlier leader
        # could have handed out, even one it deployed but never recorded.
        job.routing_version = max(record.routing_version + 1, self.ha.leader_session << 32)
        status = JobStatus(record.status)
        if status.terminal:
            job.status, job.failure_cause = status, record.failure_cause
            # Its completed checkpoints are still what job info, the checkpoint list and a resubmission's
            # refusal name, as before the restart: the operator restores a FAILED job from them.
            self.attach(job, fail_over, recovering=True)
            if job.coordinator is not None:
                job.coordinator.recover(self._completed_checkpoints(job))
                self.detach(job)  # no checkpoints of a finished job; the store still answers
            return job
        job.move_to(JobStatus.RESTARTING)
        job.failure_cause = "the JobManager restarted; the job resumes from its latest completed checkpoint"
        self.attach(job, fail_over, recovering=True)
        if job.coordinator is not None:
            job.coordinator.recover(self._completed_checkpoints(job))
            latest = job.coordinator.latest_completed()
            logger.info(
                "job %s recovered: latest completed checkpoint %s",
                job.job_id,
                latest.external_path if latest is not None else "none",
            )
        self.persist(job)
        return job

    def _completed_checkpoints(self, job: Job) -> list[CompletedCheckpoint]:
        """The checkpoints the HA pointers name, plus one whose ``_metadata`` beat its pointer.

        A JobManager can die after writing ``_metadata`` and before writing the pointer: that
        checkpoint is complete (``_metadata`` is written only after every acknowledgement), so it
        is taken back instead of being orphaned. Pointers whose checkpoint no longer loads and
        verifies are dropped, newest first, so recovery falls back to an older checkpoint.
        """
        loaded = []
        for pointer in self.ha.checkpoint_pointers(job.job_id):
            if not self._of_current_run(job, pointer):
                # An operator restore recorded its run, then its JobManager died before it dropped
                # the replaced run's pointers: their state is not the job's any more.
                logger.info(
                    "job %s: checkpoint %d (%s) is of a run an operator restore replaced; not taken back",
                    job.job_id,
                    pointer.checkpoint_id,
                    pointer.external_path,
                )
                self.ha.remove_checkpoint_pointer(job.job_id, pointer.checkpoint_id)
                continue
            try:
                checkpoint = load_completed_checkpoint(self.storage(pointer.external_path, job), pointer.external_path)
                # A savepoint the job claimed is one of its checkpoints: its pointer says so, its _metadata cannot.
                loaded.append(checkpoint if pointer.savepoint else checkpoint.taken_over())
            except (CheckpointError, OSError) as exc:
                logger.error(
                    "job %s: checkpoint %d (%s) cannot be loaded, falling back: %s",
                    job.job_id,
                    pointer.checkpoint_id,
                    pointer.external_path,
                    getattr(exc, "message", exc),
                )
                self.ha.remove_checkpoint_pointer(job.job_id, pointer.checkpoint_id)
        storage = self.storage(self.job_dir(job), job)
        newest = find_latest_checkpoint(storage, self.job_dir(job))
        # Only one of the job's current run: an older one holds state the job replaced since.
        if (
            newest is not None
            and newest.checkpoint_id >= job.checkpoints_from
            and all(newest.checkpoint_id > c.checkpoint_id for c in loaded)
        ):
            logger.warning(
                "job %s: checkpoint %d has _metadata but no pointer (the JobManager died in between); taking it back",
                job.job_id,
                newest.checkpoint_id,
            )
            loaded.append(newest)
        # The newest must be restorable as a whole; an older one is only a fallback.
        loaded.sort(key=lambda c: c.checkpoint_id)
        while loaded:
            latest = loaded[-1]
            try:
                verify_files_exist(self.storage(latest.external_path, job), latest.metadata, latest.external_path)
                break
            except (CorruptCheckpointError, OSError) as exc:
                logger.error(
                    "job %s: checkpoint %d is missing files, falling back: %s",
                    job.job_id,
                    latest.checkpoint_id,
                    getattr(exc, "message", exc),
                )
                self.ha.remove_checkpoint_pointer(job.job_id, latest.checkpoint_id)
                loaded.pop()
        return loaded

    def sweep_orphans(self, job: Job) -> list[str]:
        """Delete what crashed checkpoints left in the job directory (after a JobManager restart)."""
        from keyedstate.jobmanager.checkpoint.gc import execute, plan_gc

        if job.coordinator is None:
            return []
        storage = self.storage(self.job_dir(job), job)
        # A checkpoint restored under NO_CLAIM is the user's, even once the job's own checkpoints subsume it.
        users = [job.restore_path] if job.restore_path and job.claim_mode is RecoveryClaimMode.NO_CLAIM else []
        plan = plan_gc(
            storage,
            self.job_dir(job),
            job.coordinator.store.all(),
            job.coordinator.in_progress_ids(),
            protected=users,
        )
        if not plan.remove:
            return []
        logger.info(
            "job %s: deleting %d leftovers of checkpoints an earlier JobManager never completed",
            job.job_id,
            len(plan.remove),
        )
        return execute(storage, plan)

    def shutdown(self, jobs: Iterable[Job]) -> None:
        """Stop every coordinator of ``jobs`` and close the HA store (the JobManager stops)."""
        self._stop.set()
        for job in jobs:
            self.detach(job)
        self.ha.close()


def _next_unused_checkpoint_id(storage: CheckpointStorage, job_dir: str) -> int:
    """One past the newest ``chk-<n>`` in ``job_dir``: ids never reuse a directory, whatever the counter says."""
    newest = 0
    for info in storage.list(job_dir):
        cid = _paths.parse_checkpoint_dir_name(_paths.name(info.path))
        if info.is_dir and cid is not None:
            newest = max(newest, cid)
    return newest + 1


def _failure(exc: CheckpointException) -> str:
    # The checkpoint's own reason (CHECKPOINT_DECLINED, ...), not the error class's CHECKPOINT_FAILED.
    return f"{exc.failure_reason.name}: {exc.detail}"


def _with_bytes(storage: CheckpointStorage, handle: SubtaskStateHandle) -> SubtaskStateHandle:
    """``handle`` with each file's bytes, read from the JobManager's memory (paths are absolute in a restore plan)."""
    files = [dataclasses.replace(f, data=storage.read_bytes(f.path)) for f in handle.files]
    return dataclasses.replace(handle, files=files)


class _StorageByUrl:
    """Each call on the storage its URL names: checkpoints in the JobManager's memory, savepoints in files."""

    def __init__(self, resolve: Callable[[str], CheckpointStorage]) -> None:
        self._resolve = resolve

    def join(self, base: str, *parts: str) -> str:
        return self._resolve(base).join(base, *parts)

    def exists(self, path: str) -> bool:
        return self._resolve(path).exists(path)

    def read_bytes(self, path: str) -> bytes:
        return self._resolve(path).read_bytes(path)

    def write_bytes(self, path: str, data: bytes) -> None:
        self._resolve(path).write_bytes(path, data)

    def create_exclusive(self, path: str, data: bytes) -> None:
        self._resolve(path).create_exclusive(path, data)

    def put_file(self, local_path: str, path: str) -> None:
        self._resolve(path).put_file(local_path, path)

    def get_file(self, path: str, local_path: str) -> None:
        self._resolve(path).get_file(path, local_path)

    def size(self, path: str) -> int:
        return self._resolve(path).size(path)

    def list(self, path: str, recursive: bool = False) -> Iterator[FileInfo]:
        return self._resolve(path).list(path, recursive)

    def makedirs(self, path: str) -> None:
        self._resolve(path).makedirs(path)

    def delete(self, path: str) -> None:
        self._resolve(path).delete(path)

    def delete_dir(self, path: str) -> None:
        self._resolve(path).delete_dir(path)
