"""The JobManager's domain core: jobs, slot deployment, routing, checkpoints and failover.

The gRPC servicer is a thin adapter over :class:`Dispatcher`; everything here is plain Python
and testable without a network.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from keyedstate.common.changesets import ChangeSetFile
from keyedstate.common.claim_mode import RecoveryClaimMode
from keyedstate.common.clock import Clock, Scheduler
from keyedstate.common.config import Configuration
from keyedstate.common.config import options as o
from keyedstate.common.errors import (
    AlreadyExistsError,
    CapacityError,
    ClusterMismatchError,
    CorruptCheckpointError,
    InvalidArgumentError,
    JobStateError,
    KeyedStateError,
    NotFoundError,
    Reason,
    StaleRoutingError,
)
from keyedstate.common.faults import crash_point
from keyedstate.common.ids import JobId, SubtaskId, TaskManagerId
from keyedstate.common.keygroups import past_max_parallelism
from keyedstate.common.lifecycle import JobStatus
from keyedstate.jobmanager import failover, recovery
from keyedstate.jobmanager.checkpoint.completed import CompletedCheckpoint
from keyedstate.jobmanager.checkpoint.coordinator import CheckpointCoordinator
from keyedstate.jobmanager.checkpoint.failure import CheckpointFailureReason
from keyedstate.jobmanager.checkpoint.ownership import RestoreOwnership
from keyedstate.jobmanager.checkpoint.settings import refuse_unavailable, validate_commit_mode
from keyedstate.jobmanager.checkpointing import Checkpointing
from keyedstate.jobmanager.jobs import EMPTY_PLAN, Job, JobInfo, JobSpec, RestorePlan, RoutingTable
from keyedstate.jobmanager.registry import (
    HeartbeatReport,
    SlotProcessReport,
    TaskManagerRecord,
    TaskManagerRegistration,
    TaskManagerRegistry,
    TaskManagerStatus,
    check_address,
)
from keyedstate.jobmanager.scheduling import SlotAssignment, allocate_slots, plan_subtasks, release_assignments
from keyedstate.jobmanager.settings import JobManagerSettings
from keyedstate.jobmanager.status_times import JobStatusTimes
from keyedstate.jobmanager.taskmanager_gateway import DeployedSlot, SlotDeployment, TaskManagerGateways

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskManagerSummary:
    """One registered TaskManager as statectl shows it: its slots' occupants and how long it has been silent."""

    taskmanager_id: TaskManagerId
    address: str
    num_slots: int
    free_slots: int
    status: TaskManagerStatus
    last_heartbeat_age_ms: int
    occupancy: tuple[SubtaskId | None, ...]
    """Slot index -> the subtask placed there (None: free)."""
    metrics_port: int
    slot_processes: tuple[SlotProcessReport, ...] = ()
    """Its slot processes (address and pid), as it last registered them; empty: none."""


@dataclass(frozen=True)
class Admission:
    """A registration's answer: the reported slots the TaskManager keeps, and every job's routing version.

    The versions are the TaskManager's deploy floors, read before its slots were offered: a slot it
    hosts under a newer version was deployed after this answer was decided, and it keeps it.
    """

    kept: list[SubtaskId]
    routing_versions: dict[JobId, int]


@dataclass(frozen=True)
class ClusterOverview:
    """Every registered TaskManager and every job the JobManager knows (GetClusterOverview)."""

    taskmanagers: tuple[TaskManagerSummary, ...]
    jobs: tuple[JobInfo, ...]
    total_slots: int
    free_slots: int


class Dispatcher:
    """Jobs and their slots: submission, deployment, cancel, restore, rescale, failover, TaskManager membership."""

    def __init__(
        self,
        settings: JobManagerSettings,
        conf: Configuration,
        registry: TaskManagerRegistry,
        gateways: TaskManagerGateways,
        checkpointing: Checkpointing,
        executor: ThreadPoolExecutor,
        clock: Clock,
        scheduler: Scheduler,
    ) -> None:
        self.settings = settings
        self.conf = conf
        self.registry = registry
        self.gateways = gateways
        self.clock = clock
        self.scheduler = scheduler
        self._jobs: dict[JobId, Job] = {}
        # The highest routing version a failed submission used, per job id: its deploys and
        # releases raised the TaskManagers' version floors, so the next submission must start above.
        self._abandoned_versions: dict[JobId, int] = {}
        self._deploying: set[tuple[TaskManagerId, int]] = set()  # (TaskManager, slot) of deployments under way
        self._lock = threading.RLock()
        self._pool = executor
        # Set by shutdown(); restart loops wait on it so that they end with the JobManager
        # (the interpreter joins pool threads at exit, so a sleeping loop would keep it alive).
        self.closed = threading.Event()
        self.checkpointing = checkpointing
        registry.add_lost_listener(self._on_taskmanager_lost)

    # -- queries -----------------------------------------------------------------------------
    def job(self, job_id: JobId) -> Job:
        """The job registered under ``job_id``; raises NotFoundError (UNKNOWN_JOB) naming the known jobs."""
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            known = ", ".join(sorted(self._jobs)) or "none"
            raise NotFoundError(
                f"unknown job {job_id!r} (known jobs: {known}); submit it first", reason=Reason.UNKNOWN_JOB
            )
        return job

    def adopt(self, job: Job) -> None:
        """Take over a job recovered from the high-availability store."""
        with self._lock:
            self._jobs[job.job_id] = job

    def recover(self, address: str, on_leadership_lost: Callable[[str], None]) -> list[Job]:
        """After a JobManager restart: take leadership and adopt every job of the HA store (see Checkpointing)."""
        recovered = self.checkpointing.recover_jobs(address, on_leadership_lost, self._fail_over_later)
        for job in recovered:
            self.adopt(job)
        return recovered

    def jobs(self) -> list[Job]:
        """Every job the JobManager knows, running or not."""
        with self._lock:
            return list(self._jobs.values())

    def routing_versions(self) -> dict[JobId, int]:
        """The newest routing version handed out per job id (a registering TaskManager's floors)."""
        with self._lock:
            versions = dict(self._abandoned_versions)
            versions.update(
                {job.job_id: max(job.routing_version, versions.get(job.job_id, 0)) for job in self._jobs.values()}
            )
            return versions

    def routing(self, job_id: JobId) -> RoutingTable:
        """The job's current routing table (read under the job's lock); raises NotFoundError for an unknown job."""
        job = self.job(job_id)
        with job.lock:
            return job.routing_table()

    def overview(self) -> ClusterOverview:
        """Every registered TaskManager with its slots' occupants and heartbeat age (for statectl)."""
        now = self.clock.monotonic_ms()
        taskmanagers = tuple(
            TaskManagerSummary(
                taskmanager_id=r.taskmanager_id,
                address=r.address,
                num_slots=r.num_slots,
                free_slots=len(r.free_slots()),
                status=r.status,
                last_heartbeat_age_ms=max(0, now - r.last_heartbeat_ms),
                occupancy=tuple(r.occupancy),
                metrics_port=r.metrics_port,
                slot_processes=r.slot_processes,
            )
            for r in self.registry.all()
        )
        return ClusterOverview(
            taskmanagers=taskmanagers,
            jobs=tuple(j.info() for j in self.jobs()),
            total_slots=self.registry.total_slot_count(),
            free_slots=self.registry.free_slot_count(),
        )

    def register_taskmanager(self, registration: TaskManagerRegistration) -> Admission:
        """Register (or re-register) a TaskManager; the slots it may keep serving and the jobs' versions.

        A TaskManager that comes back (a restart, a JobManager restart, a partition that healed)
        may still host slots. Those that match a current assignment are kept; every other one it
        releases itself before it serves anything (it is fenced while registering). A restarted
        process hosts nothing, so the jobs it hosted fail over.

        Its free slots are offered to deployments only after that decision, and the versions are
        read before: a job waiting for slots (a failover) deploys to it under a newer version than
        the answer names, so the TaskManager keeps that slot even when the deploy reaches it before
        the answer does, and this registration never judges a slot deployed after it was sent.

        A TaskManager of another cluster (``high-availability.cluster-id``) is refused before
        anything else: two clusters sharing a host on default ports must not mix.
        """
        self._check_cluster(registration)
        if registration.internal_address:
            check_address(
                f"TaskManager {registration.taskmanager_id}", "internal_address", registration.internal_address
            )
        record = self._admit(registration)
        reported = {s.subtask: s.slot_index for s in registration.slots if s.subtask is not None}
        kept = self._keep_assigned_slots(record, reported)
        self._hold_dropped_slots(record, reported, kept)
        admission = Admission(kept, self.routing_versions())
        self.registry.offer(record)
        return admission

    def _check_cluster(self, registration: TaskManagerRegistration) -> None:
        """Refuse a TaskManager of another cluster (ClusterMismatchError)."""
        theirs = registration.cluster_id or "default"
        if theirs == self.settings.cluster_id:
            return
        logger.warning(
            "refused TaskManager %s at %s: it belongs to cluster %r, this JobManager to %r",
            registration.taskmanager_id,
            registration.address,
            theirs,
            self.settings.cluster_id,
        )
        raise ClusterMismatchError(
            f"TaskManager {registration.taskmanager_id!r} belongs to cluster {theirs!r} but this JobManager runs "
            f"cluster {self.settings.cluster_id!r} (high-availability.cluster-id); point the TaskManager at its own "
            "cluster's JobManager (jobmanager.rpc.address / jobmanager.rpc.port) or give both the same cluster id"
        )

    def _admit(self, registration: TaskManagerRegistration) -> TaskManagerRecord:
        """Record the registration and route (and watch) the calls to its TaskManager; the new record."""
        record, previous = self.registry.register(
            registration.taskmanager_id,
            registration.address,
            registration.host,
            registration.num_slots,
            registration.backend,
            registration.metrics_port,
            limits=registration.limits,
            slot_addresses=registration.slot_addresses,
            slot_processes=registration.slot_processes,
            offered=False,
        )
        if previous is not None and previous.address != record.address:
            self.gateways.forget(previous.address)
        self.gateways.route(record.address, registration.internal_address)
        if self.settings.connection_loss_detection:
            self.gateways.watch(
                record.address, lambda cause: self.registry.mark_lost(record.taskmanager_id, cause, only=record)
            )
        return record

    def _keep_assigned_slots(self, record: TaskManagerRecord, reported: Mapping[SubtaskId, int]) -> list[SubtaskId]:
        """The reported slots that match a current assignment (marked occupied); jobs that lost one fail over."""
        kept: list[SubtaskId] = []
        for job in self.jobs():
            with job.lock:
                lost = False
                for a in job.assignments.values():
                    if a.taskmanager_id != record.taskmanager_id:
                        continue
                    if (
                        reported.get(a.subtask) == a.slot_index
                        and a.address == record.address
                        and (a.slot_address or a.address) == record.slot_address(a.slot_index)
                    ):
                        self.registry.occupy(record.taskmanager_id, a.slot_index, a.subtask)
                        kept.append(a.subtask)
                    else:
                        lost = True
                # A job already RESTARTING (the loss was seen when the connection broke) redeploys anyway.
                if lost and job.status is JobStatus.RUNNING:
                    self._pool.submit(
                        self.fail_over,
                        job.job_id,
                        f"TaskManager {record.taskmanager_id} restarted and lost its slots",
                        job.routing_version,
                    )
        return kept

    def _hold_dropped_slots(
        self, record: TaskManagerRecord, reported: Mapping[SubtaskId, int], kept: list[SubtaskId]
    ) -> None:
        """Mark the reported slots no job keeps as taken until the TaskManager's heartbeats show them released."""
        dropped = sorted(set(reported) - set(kept), key=str)
        if not dropped:
            return
        logger.info(
            "taskmanager %s re-registered; it releases %d slot(s) no job assigns to it any more: %s",
            record.taskmanager_id,
            len(dropped),
            ", ".join(str(d) for d in dropped),
        )
        # Taken until its heartbeats show them gone: nothing is deployed over a slot the
        # TaskManager has not released yet.
        for subtask in dropped:
            self.registry.occupy(record.taskmanager_id, reported[subtask], subtask)

    def heartbeat(self, report: HeartbeatReport) -> bool:
        """Record a heartbeat; False when the TaskManager must register again (unknown, or another session)."""
        known = self.registry.get(report.taskmanager_id)
        if known is not None:
            # Checked before anything is recorded: a negative index would address a slot from the end.
            bad = sorted({s.slot_index for s in report.slots if not 0 <= s.slot_index < known.num_slots})
            if bad:
                raise InvalidArgumentError(
                    f"TaskManager {report.taskmanager_id} reports slot index(es) {bad[:5]} but offers "
                    f"{known.num_slots} slots (0..{known.num_slots - 1}); report only the slots it offers"
                )
        if report.jobmanager_session != self.registry.session or not self.registry.heartbeat(report.taskmanager_id):
            return False
        reported = {s.slot_index: s.subtask for s in report.slots if s.subtask is not None}
        record = self.registry.get(report.taskmanager_id)
        if record is None:
            return True
        for index, subtask in enumerate(list(record.occupancy)):
            if subtask is None or reported.get(index) == subtask:
                continue
            # The slot is marked with a subtask this TaskManager no longer reports: a stale slot it
            # has released, unless the mark is a current assignment on its way (being deployed).
            if not self._assigned(subtask, report.taskmanager_id, index):
                self.registry.free_if(report.taskmanager_id, index, subtask)
        for index, subtask in reported.items():
            # A slot no job assigns here (a deploy whose answer was lost): it must not serve.
            if (
                0 <= index < len(record.occupancy)
                and record.occupancy[index] is None
                and not self._assigned(subtask, report.taskmanager_id, index)
            ):
                self.registry.occupy(report.taskmanager_id, index, subtask)
                self._pool.submit(self._release_orphan, record, index, subtask)
        return True

    def _release_orphan(self, record: TaskManagerRecord, slot_index: int, subtask: SubtaskId) -> None:
        logger.warning(
            "taskmanager %s hosts %s in slot %d, which no job assigns there; releasing it",
            record.taskmanager_id,
            subtask,
            slot_index,
        )
        try:
            self.gateways.release(record.address, subtask)
        except KeyedStateError as exc:
            # Marked until its heartbeats show it gone; a TaskManager that cannot be reached loses its lease.
            logger.info("releasing %s on %s: %s", subtask, record.taskmanager_id, exc.message)
            return
        self.registry.free_if(record.taskmanager_id, slot_index, subtask)

    def _assigned(self, subtask: SubtaskId, taskmanager_id: TaskManagerId, slot_index: int) -> bool:
        with self._lock:
            if (taskmanager_id, slot_index) in self._deploying:
                return True
            job = self._jobs.get(JobId(subtask.job_id))
        if job is None:
            return False
        a = job.assignments.get(subtask)
        return a is not None and a.taskmanager_id == taskmanager_id and a.slot_index == slot_index

    # -- job lifecycle -----------------------------------------------------------------------
    def submit(
        self, spec: JobSpec, restore_path: str = "", claim_mode: RecoveryClaimMode | None = None
    ) -> RoutingTable:
        """Deploy every subtask of ``spec`` to free slots (restoring from ``restore_path`` if given).

        ``claim_mode`` (default: the job's ``execution.state-recovery.claim-mode``) says who owns
        the restored checkpoint's files afterwards.

        Submitting a job that is already running is idempotent: a restarted Spark driver gets
        the routing of the job as it is, including a parallelism changed by a rescale since
        (the driver adopts the job's current definition). A different set of operators or
        states is refused.
        """
        job_conf = self.conf.with_values(dict(spec.config))
        job_conf.validate()
        o.checkpoints_in_jobmanager_memory(job_conf)
        refuse_unavailable(job_conf)
        validate_commit_mode(job_conf)
        restore_path = restore_path or (job_conf.get(o.STATE_RECOVERY_PATH) or "")
        with self._lock:
            existing = self._jobs.get(spec.job_id)
            if existing is not None and not existing.status.terminal:
                return self._resubmitted(existing, spec, restore_path)
            job = self._register_job(spec, job_conf, restore_path, existing)
            job.claim_mode = claim_mode or job_conf.get(o.CLAIM_MODE)
        try:
            with job.lock:
                return self._start_job(job, restore_path)
        except BaseException:
            self._abandon_submission(job, existing)
            raise

    def _resubmitted(self, existing: Job, spec: JobSpec, restore_path: str) -> RoutingTable:
        """A submission of a job that is not stopped: its routing if the definition matches (caller holds ``_lock``)."""
        if not restore_path and existing.spec.same_except_parallelism(spec):
            if existing.spec != spec:
                logger.info(
                    "job %s resubmitted with parallelism %s; it keeps its current definition %s",
                    spec.job_id,
                    spec.parallelism_summary(),
                    existing.spec.parallelism_summary(),
                )
            return self.routing(spec.job_id)
        raise AlreadyExistsError(
            f"job {spec.job_id!r} is already {existing.status.value} with a different definition "
            f"({existing.spec.difference(spec)}); cancel it first (statectl job cancel {spec.job_id}) or use "
            "another job id"
        )

    def _register_job(self, spec: JobSpec, job_conf: Configuration, restore_path: str, existing: Job | None) -> Job:
        """The new job, registered in place of a stopped one under its id if any (caller holds ``_lock``)."""
        job = Job(spec, job_conf, restore_path=restore_path, times=JobStatusTimes(self.clock))
        # Clients keep the newest routing version they saw and ignore older ones, and
        # TaskManagers refuse deploys below their floor, so a job resubmitted under the same
        # id continues the numbering instead of restarting at 1.
        job.routing_version = max(
            existing.routing_version if existing is not None else 0, self._abandoned_versions.get(spec.job_id, 0)
        )
        if existing is not None:
            job.predecessor = _predecessor(existing)
        self._jobs[spec.job_id] = job
        return job

    def _start_job(self, job: Job, restore_path: str) -> RoutingTable:
        """Attach checkpointing, deploy and persist a newly submitted job as RUNNING (caller holds ``job.lock``)."""
        self.checkpointing.attach(job, self._fail_over_later)
        plan = self.checkpointing.plan_restore(job, restore_path) if restore_path else EMPTY_PLAN
        self.deploy(job, plan)
        job.move_to(JobStatus.RUNNING)
        self.checkpointing.persist(job, strict=True)
        self.checkpointing.job_running(job)
        logger.info(
            "job %s running: %d subtasks on %d TaskManagers (routing v%d, epoch %d)%s",
            job.job_id,
            len(job.assignments),
            len({a.taskmanager_id for a in job.assignments.values()}),
            job.routing_version,
            job.committed_epoch,
            f", restored from {restore_path}" if restore_path else "",
        )
        return job.routing_table()

    def _abandon_submission(self, job: Job, existing: Job | None) -> None:
        """Undo a failed submission: release what was deployed and show the earlier job (if any) again."""
        if job.assignments:  # deployed, then a later step (the HA record) failed
            self.release_slots(job, list(job.assignments.values()), discard_local=True)
            job.assignments = {}
        with self._lock:
            if self._jobs.get(job.job_id) is job:
                self._abandoned_versions[job.job_id] = job.routing_version
                # A failed resubmission leaves the earlier (terminal) job visible, so that
                # `statectl job info` and `job restore` still find it.
                if existing is not None:
                    self._jobs[job.job_id] = existing
                else:
                    del self._jobs[job.job_id]
        self.checkpointing.detach(job)

    def deploy(self, job: Job, plan: RestorePlan, prefer: Mapping[SubtaskId, TaskManagerId] | None = None) -> None:
        """Deploy every subtask of ``job`` from ``plan`` under a new routing version (caller holds ``job.lock``).

        On success the job's assignments are the new slots and its committed epoch and lineage
        are what the plan restores; every slot must report that epoch back. On failure nothing
        stays deployed.
        """
        assignments = self._allocate(job, prefer)
        deploy_one = self._slot_deployer(job, plan)
        slots = {(a.taskmanager_id, a.slot_index) for a in assignments}
        with self._lock:
            self._deploying |= slots
        try:
            self._deploy_assignments(job, plan, assignments, deploy_one)
        finally:
            with self._lock:
                self._deploying -= slots

    def _allocate(self, job: Job, prefer: Mapping[SubtaskId, TaskManagerId] | None) -> list[SlotAssignment]:
        """Free slots for every subtask under the next routing version, persisted before anything is deployed."""
        subtasks = plan_subtasks(job.job_id, list(job.spec.operators), job.spec.max_parallelism)
        if job.coordinator is not None:
            # No checkpoint of an earlier deployment can complete any more (its slots are gone);
            # one still pending would only hold up the new deployment's checkpoints.
            job.coordinator.abort_pending(CheckpointFailureReason.TASK_FAILURE, "the job is being redeployed")
        # The version moves before slots are chosen: a loss reported under the old version was
        # removed from the registry first, so this deployment cannot include it (fail_over's
        # seen_version relies on that order).
        job.routing_version += 1
        assignments = [
            dataclasses.replace(a, routing_version=job.routing_version)
            for a in allocate_slots(self.registry, subtasks, prefer=prefer)
        ]
        # Recorded before any slot is deployed: after a JobManager crash, the next one knows
        # which TaskManagers may hold this deployment and waits until each is fenced.
        job.last_taskmanagers = frozenset(job.last_taskmanagers | {a.taskmanager_id for a in assignments})
        try:
            self.checkpointing.persist(job, strict=True)
        except BaseException:
            release_assignments(self.registry, assignments)
            raise
        return assignments

    def _slot_deployer(self, job: Job, plan: RestorePlan) -> Callable[[SlotAssignment], DeployedSlot]:
        """Deploys one assignment of ``job`` from ``plan`` and checks that the slot holds the plan's epoch."""
        checkpoint_base = self.checkpointing.job_dir(job)
        incremental = job.config.get(o.CHECKPOINT_INCREMENTAL)
        changelog = job.config.get(o.CHANGELOG_MATERIALIZE_INTERVAL) if job.config.get(o.CHANGELOG_ENABLED) else None
        changelog_failures = job.config.get(o.CHANGELOG_MAX_FAILURES)
        ops = {op.operator_id: op for op in job.spec.operators}

        def deploy_one(a: SlotAssignment) -> DeployedSlot:
            deployment = SlotDeployment(
                job_id=job.job_id,
                operator=ops[a.subtask.operator_id],
                subtask_index=a.subtask.subtask_index,
                key_groups=a.key_groups,
                max_parallelism=job.spec.max_parallelism,
                slot_index=a.slot_index,
                routing_version=job.routing_version,
                checkpoint_base=checkpoint_base,
                incremental=incremental,
                restore=plan.slots.get(a.subtask),
                changelog_materialize_interval_ms=changelog,
                changelog_max_failures_allowed=changelog_failures,
                replay=_replay_for(plan, a, ops[a.subtask.operator_id].parallelism),
            )
            response = self.gateways.deploy(a.address, deployment)
            if response.committed_epoch != plan.epoch:
                raise CorruptCheckpointError(
                    f"{a.subtask} on {a.taskmanager_id} holds epoch {response.committed_epoch} after its restore, but "
                    f"{plan.source or 'empty state'} holds epoch {plan.epoch}; restore another checkpoint"
                )
            return response

        return deploy_one

    def _deploy_assignments(
        self,
        job: Job,
        plan: RestorePlan,
        assignments: list[SlotAssignment],
        deploy_one: Callable[[SlotAssignment], DeployedSlot],
    ) -> None:
        futures = {a: self._pool.submit(deploy_one, a) for a in assignments}
        errors: list[tuple[SlotAssignment, BaseException]] = []
        deployed: list[SlotAssignment] = []
        results = []
        for a, fut in futures.items():
            try:
                results.append(fut.result())
                deployed.append(a)
            except BaseException as exc:
                errors.append((a, exc))
        if errors:
            self.release_slots(job, deployed, discard_local=False)
            release_assignments(self.registry, assignments)
            first_assignment, first = errors[0]
            if isinstance(first, KeyedStateError):
                raise first.with_message(
                    f"deploying {first_assignment.subtask} to {first_assignment.taskmanager_id} failed: {first.message}"
                ) from first
            raise first
        job.assignments = {a.subtask: a for a in assignments}
        job.last_taskmanagers = frozenset(a.taskmanager_id for a in assignments)
        job.set_epochs(plan.epoch, plan.lineage)
        if plan.slots:
            total = sum(r.restore_duration_ms for r in results)
            logger.info(
                "job %s restored %d subtasks from %s at epoch %d (sum of restore times %d ms)",
                job.job_id,
                len(results),
                plan.source,
                plan.epoch,
                total,
            )

    def release_slots(self, job: Job, assignments: list[SlotAssignment], discard_local: bool) -> None:
        """Release ``assignments`` on their TaskManagers.

        A registered TaskManager that cannot be reached to release a slot is declared lost: it
        may still serve that slot, so nothing it hosted may be deployed elsewhere until its
        lease is certainly over (see the registry).
        """

        def release(a: SlotAssignment) -> None:
            try:
                self.gateways.release(
                    a.address, a.subtask, discard_local_state=discard_local, routing_version=a.routing_version
                )
            except KeyedStateError as exc:
                logger.info("releasing %s on %s: %s", a.subtask, a.taskmanager_id, exc.message)
                # Only the registration the slot was deployed to: a TaskManager that registered again
                # elsewhere since (a restart on a new port) never hosted it and stays.
                current = self.registry.get(a.taskmanager_id)
                if current is not None and current.address == a.address:
                    self.registry.mark_lost(
                        a.taskmanager_id, f"could not release {a.subtask} ({exc.message})", only=current
                    )

        list(self._pool.map(release, assignments))
        release_assignments(self.registry, assignments)

    def wait_for_resources(self, job: Job, needed: int, owners: set[TaskManagerId], timeout_ms: int) -> None:
        """Wait until ``needed`` slots are free and every TaskManager in ``owners`` is fenced.

        Part of one restart: bounded by ``timeout_ms`` (``slot.request.timeout``), after which a
        CapacityError names what was missing.
        """
        deadline = self.clock.monotonic_ms() + timeout_ms
        while True:
            now = self.clock.monotonic_ms()
            free = self.registry.free_slot_count()
            unfenced = sorted(t for t in owners if self.registry.fenced_at_ms(t) > now)
            stale = self.registry.hosts_job(job.job_id)
            if free >= needed and not unfenced and not stale:
                return
            if now >= deadline or self.closed.is_set():
                missing = []
                if free < needed:
                    missing.append(
                        f"{needed} free slots (only {free} of {self.registry.total_slot_count()} are free; "
                        "start more TaskManagers or lower the parallelism)"
                    )
                if unfenced:
                    missing.append(
                        f"TaskManager(s) {', '.join(unfenced)} to come back or to reach the end of their "
                        "lease (heartbeat.timeout)"
                    )
                if stale:
                    missing.append("TaskManagers to release slots of the job's previous deployment")
                raise CapacityError(
                    f"job {job.job_id!r} waited {timeout_ms} ms (slot.request.timeout) for " + " and ".join(missing)
                )
            self.closed.wait(min(0.1, max(0.001, (deadline - now) / 1000.0)))

    def run_in_background(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the JobManager's pool (work that must not hold the caller's locks)."""
        self._pool.submit(fn, *args)

    def _fail_over_later(self, job_id: str, cause: str) -> None:
        # A checkpoint coordinator asks from its own locks and threads: the failover runs on the pool.
        self._pool.submit(self.fail_over, JobId(job_id), cause)

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The pool that runs calls to TaskManagers in parallel."""
        return self._pool

    def cancel(self, job_id: JobId) -> JobInfo:
        """Cancel the job: stop its checkpoints, release its slots with their local state, and persist it CANCELED.

        Holds the job's lock throughout and bumps the routing version; returns the job's final JobInfo.
        """
        job = self.job(job_id)
        with job.lock:
            self.checkpointing.detach(job)
            self.release_slots(job, list(job.assignments.values()), discard_local=True)
            job.assignments = {}
            job.move_to(JobStatus.CANCELED)
            job.routing_version += 1
            self.checkpointing.persist(job)
            logger.info("job %s canceled", job_id)
            return job.info()

    def restore(self, job_id: JobId, path: str, claim_mode: RecoveryClaimMode | None = None) -> RoutingTable:
        """Replace the state of job ``job_id`` with the checkpoint or savepoint at ``path``.

        ``claim_mode`` (default: the job's ``execution.state-recovery.claim-mode``): CLAIM takes
        the checkpoint over (incremental from the first checkpoint on, deleted once subsumed),
        NO_CLAIM leaves it to the user (never deleted; the first checkpoint after it is full).

        The source is verified in full first (``_metadata``, every file's size and SHA-256, and
        that it fits the job); until then nothing about the job changes, and a refused restore
        leaves it as it was. A FAILED or CANCELED job is then submitted again from ``path`` with
        its own definition. A RUNNING job is first checkpointed (so that it can come back), then
        redeployed from ``path`` in place. If that deploy fails, the job is redeployed from the
        checkpoint just taken, so it runs as it was before the restore; if even that fails, it
        fails over from that checkpoint as after any failure (its restart strategy applies).
        """
        if not path:
            raise InvalidArgumentError(f"restoring job {job_id!r} needs the path of a chk-<n> or savepoint directory")
        with self._lock:
            known = job_id in self._jobs
        if not known:
            raise NotFoundError(
                f"job {job_id!r} is unknown to the JobManager, so there is no job to restore; submit it with "
                f"restore_path / execution.state-recovery.path={path}",
                reason=Reason.UNKNOWN_JOB,
            )
        job = self.job(job_id)
        with job.lock:
            status, spec, coordinator, version = job.status, job.spec, job.coordinator, job.routing_version
        if status in (JobStatus.CREATED, JobStatus.RESTARTING):
            raise JobStateError(
                f"job {job_id!r} is {status.value} ({job.failure_cause or 'being deployed'}); restore it once it is "
                f"RUNNING, FAILED or CANCELED (statectl job info {job_id}), or cancel it first (statectl job cancel "
                f"{job_id}: its checkpoints stay) and restore then"
            )
        checkpoint = self.checkpointing.verify_restore(job, path)
        mode = claim_mode or job.config.get(o.CLAIM_MODE)
        ownership = self.checkpointing.ownership(job, checkpoint, mode)
        if status.terminal:
            # Nothing runs: a submission from the verified source, which leaves the stopped job as it was if it fails.
            return self.submit(spec, restore_path=checkpoint.external_path, claim_mode=mode)
        if coordinator is None:
            raise InvalidArgumentError(
                f"job {job_id!r} has no checkpoint storage (state.checkpoints.dir), so a failed restore could not bring "
                f"it back; set state.checkpoints.dir for the job, or cancel it first (its state is then lost) and restore"
            )
        # The checkpoint taken next may subsume the source (a checkpoint of this job): it must stay until deployed.
        release_source = coordinator.protect(checkpoint)
        try:
            return self._restore_running(job, path, checkpoint, coordinator, version, mode=mode, ownership=ownership)
        except BaseException:
            release_source()
            raise

    def _restore_running(
        self,
        job: Job,
        path: str,
        checkpoint: CompletedCheckpoint,
        coordinator: CheckpointCoordinator,
        version: int,
        *,
        mode: RecoveryClaimMode,
        ownership: RestoreOwnership,
    ) -> RoutingTable:
        """:meth:`restore` of a RUNNING job from a verified ``checkpoint``."""
        job_id = job.job_id
        try:
            before = self.checkpointing.checkpoint_now(job)
        except KeyedStateError as exc:
            raise exc.with_message(
                f"job {job_id!r} was not restored: the checkpoint a restore takes first (so that the job "
                f"can come back if the restore fails) did not complete: {exc.message}. The job keeps "
                "running as it was"
            ) from exc
        with job.lock:
            if (
                job.status is not JobStatus.RUNNING
                or job.coordinator is not coordinator
                or job.routing_version != version
            ):
                raise JobStateError(
                    f"job {job_id!r} changed while its restore was being prepared (it is {job.status.value} at routing "
                    f"v{job.routing_version}: a failover, rescale or another restore); nothing was restored, try again"
                )
            previous = list(job.assignments.values())
            job.move_to(JobStatus.RESTARTING)
            self.release_slots(job, previous, discard_local=False)
            job.assignments = {}
            replaced = job.run()
            try:
                unfenced = sorted(
                    a.taskmanager_id for a in previous if self.registry.fenced_at_ms(a.taskmanager_id) > 0
                )
                if unfenced:
                    raise CapacityError(f"TaskManager(s) {', '.join(unfenced)} did not release their slots")
                # The restored run (its source, checkpoint ids and changelog generation) is durable
                # before any TaskManager sees the source: a JobManager that dies from here on leaves
                # its successor the restored job, one that died before it the old one, never a mix
                # (the old run's decisions replayed over the source).
                crash_point("jobmanager.restore.before-record")
                job.switch_run(self.checkpointing.next_run(job, checkpoint, mode))
                self.checkpointing.persist(job, strict=True)
                crash_point("jobmanager.restore.recorded")
                self.deploy(
                    job,
                    self.checkpointing.restore_plan(job, checkpoint, ownership),
                    prefer={a.subtask: a.taskmanager_id for a in previous},
                )
                crash_point("jobmanager.restore.deployed")
            except Exception as exc:  # whatever failed, the job must not stay RESTARTING
                job.switch_run(replaced)  # recorded again by the redeploy, before it reaches a TaskManager
                error = exc if isinstance(exc, KeyedStateError) else KeyedStateError(f"unexpected error: {exc!r}")
                raise self._restore_failed(job, path, before.external_path, error) from exc
            self.checkpointing.adopt_restore(job, checkpoint, ownership, self._fail_over_later)
            crash_point("jobmanager.restore.adopted")
            job.restarts = 0
            job.failure_cause = ""
            job.predecessor = ""  # its state is the source's now, not a cancelled run's
            job.move_to(JobStatus.RUNNING)
            self.checkpointing.persist(job)
            self.checkpointing.job_running(job)
            logger.info(
                "job %s restored in place from %s (routing v%d, epoch %d)",
                job_id,
                checkpoint.external_path,
                job.routing_version,
                job.committed_epoch,
            )
            return job.routing_table()

    def _restore_failed(self, job: Job, path: str, before: str, exc: KeyedStateError) -> KeyedStateError:
        """Bring ``job`` back from ``before`` (the checkpoint its restore took first); the error to raise (caller holds ``job.lock``)."""
        try:
            plan = self.checkpointing.plan_latest(job)
            self.deploy(job, plan)
        except KeyedStateError as again:
            self.fail_over_now(
                job,
                f"restore from {path} failed ({exc.message}), and so did redeploying the job as it "
                f"was ({again.message})",
            )
            return exc.with_message(
                f"restoring job {job.job_id!r} from {path} failed: {exc.message}. Redeploying it as it "
                f"was failed too ({again.message}), so it fails over from {before}, the checkpoint taken "
                f"just before the restore (statectl job info {job.job_id} shows its progress)"
            )
        job.move_to(JobStatus.RUNNING)
        self.checkpointing.persist(job)
        self.checkpointing.job_running(job, plan)
        logger.warning(
            "job %s: restore from %s failed (%s); running again from %s", job.job_id, path, exc.message, before
        )
        return exc.with_message(
            f"restoring job {job.job_id!r} from {path} failed: {exc.message}. The job runs again as it "
            f"was before the restore (redeployed from {before}, the checkpoint taken just before it)"
        )

    def rescale(self, job_id: JobId, parallelism: dict[str, int]) -> RoutingTable:
        """Redeploy the job at new parallelism from a checkpoint taken for the purpose.

        A checkpoint in flight is waited for (bounded by the checkpoint timeout) rather than
        refused. The redeploy restores the job's latest completed checkpoint, so nothing that a
        driver saw made durable is lost; a batch committed after the cut runs again.
        """
        job = self.job(job_id)
        for op_id, p in parallelism.items():
            if op_id and job.spec.operator(op_id) is None:
                raise NotFoundError(f"job {job_id!r} has no operator {op_id!r}", reason=Reason.UNKNOWN_OPERATOR)
            if p > job.spec.max_parallelism:
                raise InvalidArgumentError(past_max_parallelism(job_id, p, job.spec.max_parallelism))
            if p < 1:
                raise InvalidArgumentError(f"job {job_id!r} cannot run at parallelism {p}: ask for at least 1")
        new_spec = job.spec.with_parallelism(parallelism)
        with job.lock:
            self._check_rescalable(job, new_spec)
        self.checkpointing.checkpoint_now(job)
        with job.lock:
            self._check_rescalable(job, new_spec)
            old_spec = job.spec
            previous = list(job.assignments.values())
            job.move_to(JobStatus.RESTARTING)
            self.release_slots(job, previous, discard_local=False)
            job.assignments = {}
            job.spec = new_spec
            try:
                unfenced = sorted(
                    a.taskmanager_id for a in previous if self.registry.fenced_at_ms(a.taskmanager_id) > 0
                )
                if unfenced:
                    raise CapacityError(f"TaskManager(s) {', '.join(unfenced)} did not release their slots")
                plan = self.checkpointing.plan_latest(job)
                self.deploy(job, plan)
            except KeyedStateError as exc:
                # Back to the old shape through the usual failover, which waits for what is missing.
                job.spec = old_spec
                cause = f"rescale to {parallelism} failed: {exc.message}"
                self.fail_over_now(job, cause)
                raise exc.with_message(
                    f"rescaling job {job_id!r} failed ({exc.message}); it restarts at its previous "
                    "parallelism from its latest checkpoint"
                ) from exc
            job.move_to(JobStatus.RUNNING)
            self.checkpointing.persist(job)
            self.checkpointing.job_running(job, plan)
            logger.info(
                "job %s rescaled to %s (routing v%d, epoch %d)",
                job_id,
                new_spec.parallelism_summary(),
                job.routing_version,
                job.committed_epoch,
            )
            return job.routing_table()

    def _check_rescalable(self, job: Job, new_spec: JobSpec) -> None:
        if job.status is not JobStatus.RUNNING:
            raise JobStateError(f"job {job.job_id!r} is {job.status.value}; it can be rescaled only while RUNNING")
        if job.coordinator is None:
            raise InvalidArgumentError("rescaling needs state.checkpoints.dir: state moves through a checkpoint")
        needed = len(plan_subtasks(job.job_id, list(new_spec.operators), new_spec.max_parallelism))
        available = self.registry.free_slot_count() + len(job.assignments)
        if needed > available:
            # Refused before anything is released: the job keeps running as it is.
            raise CapacityError(
                f"rescaling job {job.job_id!r} needs {needed} slots but at most {available} can be had (its own "
                f"{len(job.assignments)} plus {available - len(job.assignments)} free); start more TaskManagers "
                "or ask for a lower parallelism"
            )

    # -- failures ----------------------------------------------------------------------------
    def resume_recovered(self, job: Job) -> None:
        """Redeploy a job recovered after a JobManager restart, in the background."""
        self._pool.submit(recovery.resume, self, self.checkpointing, job, self.clock)

    def _on_taskmanager_lost(self, record: TaskManagerRecord, cause: str) -> None:
        self.gateways.forget(record.address)
        for job in self.jobs():
            if any(a.taskmanager_id == record.taskmanager_id for a in job.assignments.values()):
                self._pool.submit(
                    self.fail_over,
                    job.job_id,
                    f"TaskManager {record.taskmanager_id} lost: {cause}",
                    job.routing_version,
                )

    def fail_over(self, job_id: JobId, cause: str, seen_version: int | None = None) -> None:
        """Restart the job from its latest completed checkpoint (after the restart strategy's delay).

        ``seen_version``: the routing version the failure was observed under (see failover.fail_over).
        """
        job = self.job(job_id)
        if job.coordinator is None:
            with job.lock:
                if not job.status.terminal:
                    job.move_to(JobStatus.FAILED)
                    job.failure_cause = cause + " (no state.checkpoints.dir: the job cannot recover its state)"
            return
        failover.fail_over(self, self.checkpointing, job_id, cause, seen_version)

    def task_failed(
        self, job_id: JobId, subtask: SubtaskId, taskmanager_id: TaskManagerId, routing_version: int, cause: str
    ) -> None:
        """A subtask failed on its TaskManager while running: fail its job over, as Flink does for a failed task.

        The failover runs on the pool (the report's answer does not wait for the restart); a report
        about a deployment the job has replaced since changes nothing (``routing_version``).
        """
        job = self.job(job_id)  # NOT_FOUND for a job this JobManager does not know
        with job.lock:
            operator = job.spec.operator(subtask.operator_id)
            assignment = job.assignments.get(subtask)
            current = job.routing_version
        if operator is None:
            raise NotFoundError(
                f"job {job_id} has no operator {subtask.operator_id!r} "
                f"(its operators: {', '.join(op.operator_id for op in job.spec.operators)})",
                reason=Reason.UNKNOWN_OPERATOR,
            )
        if not 0 <= subtask.subtask_index < operator.parallelism:
            raise InvalidArgumentError(
                f"subtask index {subtask.subtask_index} is outside operator {subtask.operator_id}'s "
                f"parallelism {operator.parallelism} (job {job_id})"
            )
        # Only the TaskManager running the subtask under the current deployment can fail it over;
        # a report about an older deployment is answered and changes nothing (fail_over checks it).
        if routing_version > current or (
            routing_version == current and (assignment is None or assignment.taskmanager_id != taskmanager_id)
        ):
            raise StaleRoutingError(
                f"TaskManager {taskmanager_id} does not run {subtask.operator_id}[{subtask.subtask_index}] of job "
                f"{job_id} under routing version {routing_version} (current {current}): report failures only of "
                "subtasks deployed to this TaskManager",
                current_version=current,
            )
        what = f"{subtask.operator_id}[{subtask.subtask_index}] on TaskManager {taskmanager_id} failed: {cause}"
        self._pool.submit(self.fail_over, job_id, what, routing_version)

    def fail_over_now(self, job: Job, cause: str) -> None:
        """Start a failover before the caller (holding ``job.lock``) releases the lock (see failover.fail_over_now)."""
        if job.coordinator is None:
            job.move_to(JobStatus.FAILED)
            job.failure_cause = cause + " (no state.checkpoints.dir: the job cannot recover its state)"
            return
        failover.fail_over_now(self, self.checkpointing, job, cause)

    def shutdown(self) -> None:
        """Stop checkpointing and HA services, the background pool (queued work is dropped) and the channels.

        Jobs are not cancelled: under high availability the next leader recovers them.
        """
        self.closed.set()
        self.checkpointing.shutdown(self.jobs())
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.gateways.close()


def _predecessor(previous: Job) -> str:
    """Where the state of a cancelled or failed job went, for a job resubmitted under its id."""
    latest = previous.coordinator.latest_completed() if previous.coordinator is not None else None
    if latest is None:
        return (
            f"The previous run of job {previous.job_id!r} ({previous.status.value}) left no completed checkpoint "
            f"it still knows of (its committed epoch was {previous.committed_epoch})"
        )
    return (
        f"The previous run of job {previous.job_id!r} ({previous.status.value}) has its latest checkpoint at "
        f"{latest.external_path}, holding epoch {latest.metadata.epoch}: statectl job restore {previous.job_id} "
        f"--from {latest.external_path}"
    )


def _replay_for(plan: RestorePlan, a: SlotAssignment, parallelism: int) -> tuple[ChangeSetFile, ...]:
    """The decided epochs' change sets one slot folds in: its operator's, and only its own subtask's when the
    operator ran at the same parallelism in every replayed epoch (the same key groups); else all of them."""
    mine = [f for f in plan.replay if f.operator_id == a.subtask.operator_id]
    per_epoch: dict[int, set[int]] = {}
    for f in mine:
        per_epoch.setdefault(f.epoch, set()).add(f.subtask_index)
    if all(indices == set(range(parallelism)) for indices in per_epoch.values()):
        return tuple(f for f in mine if f.subtask_index == a.subtask.subtask_index)
    return tuple(mine)
