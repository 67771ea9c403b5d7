"""The JobManager's domain core: jobs, slot deployment, routing, checkpoints and failover.

The gRPC servicer is a thin adapter over :class:`Dispatcher`; everything here is plain Python
and testable without a network.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common._proto.v1 import taskmanager_pb2 as tm_pb
from keyedstate.common.clock import Clock, Scheduler
from keyedstate.common.config import Configuration, options as o
from keyedstate.common.errors import (
    AlreadyExistsError,
    CapacityError,
    InvalidArgumentError,
    JobStateError,
    KeyedStateError,
    NotFoundError,
    Reason,
)
from keyedstate.common.ids import SubtaskId
from keyedstate.jobmanager.jobs import Job, JobSpec, JobStatus
from keyedstate.jobmanager.registry import TaskManagerRecord, TaskManagerRegistry
from keyedstate.jobmanager.scheduling import SlotAssignment, allocate_slots, plan_subtasks, release_assignments
from keyedstate.jobmanager.settings import JobManagerSettings
from keyedstate.jobmanager.taskmanager_gateway import TaskManagerGateways

logger = logging.getLogger(__name__)

# Restore input for one subtask: (SlotRestore proto) or None; produced by the checkpoint layer.
RestorePlanner = Callable[[Job, str], dict[SubtaskId, tm_pb.SlotRestore]]


class Dispatcher:
    def __init__(
        self,
        settings: JobManagerSettings,
        conf: Configuration,
        registry: TaskManagerRegistry,
        gateways: TaskManagerGateways,
        clock: Clock,
        scheduler: Scheduler,
    ) -> None:
        self.settings = settings
        self.conf = conf
        self.registry = registry
        self.gateways = gateways
        self.clock = clock
        self.scheduler = scheduler
        self._jobs: dict[str, Job] = {}
        self._lock = threading.RLock()
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="jm-deploy")
        # Set by shutdown(); restart loops wait on it so that they end with the JobManager
        # (the interpreter joins pool threads at exit, so a sleeping loop would keep it alive).
        self.closed = threading.Event()
        # Installed by the checkpoint layer (keyedstate.jobmanager.checkpointing).
        self.checkpointing: Any = None
        registry.add_lost_listener(self._on_taskmanager_lost)

    # -- queries -----------------------------------------------------------------------------
    def job(self, job_id: str) -> Job:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            known = ", ".join(sorted(self._jobs)) or "none"
            raise NotFoundError(f"unknown job {job_id!r} (known jobs: {known}); submit it first", reason=Reason.UNKNOWN_JOB)
        return job

    def adopt(self, job: Job) -> None:
        """Take over a job recovered from the high-availability store."""
        with self._lock:
            self._jobs[job.job_id] = job

    def jobs(self) -> list[Job]:
        with self._lock:
            return list(self._jobs.values())

    def routing(self, job_id: str) -> pb.RoutingTable:
        job = self.job(job_id)
        with job.lock:
            return job.routing_table()

    def overview(self) -> jm_pb.ClusterOverview:
        tms = []
        now = self.clock.monotonic_ms()
        for r in self.registry.all():
            tms.append(jm_pb.TaskManagerInfo(
                taskmanager_id=r.taskmanager_id, address=r.address, num_slots=r.num_slots,
                free_slots=len(r.free_slots()), status=r.status.value,
                last_heartbeat_age_ms=max(0, now - r.last_heartbeat_ms),
                slots=[
                    jm_pb.SlotReport(slot_index=i, job_id=s.job_id, operator_id=s.operator_id, subtask_index=s.subtask_index)
                    if s is not None else jm_pb.SlotReport(slot_index=i)
                    for i, s in enumerate(r.occupancy)
                ],
                metrics_port=r.metrics_port,
            ))
        return jm_pb.ClusterOverview(
            taskmanagers=tms, jobs=[j.info() for j in self.jobs()],
            total_slots=self.registry.total_slot_count(), free_slots=self.registry.free_slot_count(),
        )

    def register_taskmanager(self, request: jm_pb.RegisterTaskManagerRequest) -> None:
        record, previous = self.registry.register(
            request.taskmanager_id, request.address, request.host, request.num_slots, request.backend, request.metrics_port
        )
        if previous is not None and previous.address != record.address:
            self.gateways.forget(previous.address)
        if self.settings.connection_loss_detection:
            self.gateways.watch(record.address, lambda cause: self.registry.mark_lost(record.taskmanager_id, cause, only=record))
        # A TaskManager that comes back (restart, or after a JobManager restart) may still host
        # slots. Keep those that match a current assignment; a restarted process hosts nothing,
        # so the jobs it hosted fail over.
        reported = {SubtaskId(s.job_id, s.operator_id, s.subtask_index): s.slot_index for s in request.slots if s.job_id}
        for job in self.jobs():
            lost = False
            for a in job.assignments.values():
                if a.taskmanager_id != record.taskmanager_id:
                    continue
                if reported.get(a.subtask) == a.slot_index and a.address == record.address:
                    self.registry.occupy(record.taskmanager_id, a.slot_index, a.subtask)
                else:
                    lost = True
            # A job already RESTARTING (the loss was seen when the connection broke) redeploys anyway.
            if lost and job.status is JobStatus.RUNNING:
                self._pool.submit(self.fail_over, job.job_id, f"TaskManager {record.taskmanager_id} restarted and lost its slots",
                                  job.routing_version)
        # Slots it still hosts that no job assigns to it any more (the job failed over while the
        # TaskManager was unreachable) are released, so they stop serving stale state.
        # Until the release is done the slot stays marked as taken, so that nothing is deployed
        # over it and a recovering job waits (registry.hosts_job) instead of deploying the same
        # subtask twice on one TaskManager.
        assigned = {
            a.subtask for job in self.jobs() for a in job.assignments.values() if a.taskmanager_id == record.taskmanager_id
        }
        for subtask, slot_index in reported.items():
            if subtask not in assigned:
                self.registry.occupy(record.taskmanager_id, slot_index, subtask)
                self._pool.submit(self._release_stale, record, slot_index, subtask)

    def _release_stale(self, record: TaskManagerRecord, slot_index: int, subtask: SubtaskId) -> None:
        try:
            self.gateways.release(record.address, tm_pb.ReleaseSlotRequest(
                job_id=subtask.job_id, operator_id=subtask.operator_id, subtask_index=subtask.subtask_index,
            ))
        except KeyedStateError as exc:
            # Unreachable again: the heartbeat timeout removes the TaskManager and its slots.
            logger.info("releasing stale %s on %s: %s", subtask, record.taskmanager_id, exc.message)
            return
        self.registry.free_if(record.taskmanager_id, slot_index, subtask)

    # -- job lifecycle -----------------------------------------------------------------------
    def submit(self, spec: JobSpec, restore_path: str = "") -> pb.RoutingTable:
        """Deploy every subtask of ``spec`` to free slots (restoring from ``restore_path`` if given)."""
        job_conf = self.conf.with_values(dict(spec.config))
        job_conf.validate()
        restore_path = restore_path or (job_conf.get(o.STATE_RECOVERY_PATH) or "")
        with self._lock:
            existing = self._jobs.get(spec.job_id)
            if existing is not None and not existing.status.terminal:
                if existing.spec == spec and not restore_path:
                    # Idempotent: a restarted Spark driver submits its job again and gets the routing.
                    return self.routing(spec.job_id)
                raise AlreadyExistsError(
                    f"job {spec.job_id!r} is already {existing.status.value} with a different definition; "
                    f"cancel it first (statectl job cancel {spec.job_id}) or use another job id"
                )
            job = Job(spec, job_conf, restore_path=restore_path)
            if existing is not None:
                # Clients keep the newest routing version they saw and ignore older ones, so a job
                # resubmitted under the same id continues the numbering instead of restarting at 1.
                job.routing_version = existing.routing_version
            self._jobs[spec.job_id] = job
        try:
            with job.lock:
                if self.checkpointing is not None:
                    self.checkpointing.attach(job)
                restores = self.checkpointing.plan_restore(job, restore_path) if restore_path else {}
                self._deploy_all(job, restores)
                job.status = JobStatus.RUNNING
                if self.checkpointing is not None:
                    self.checkpointing.persist(job, strict=True)
                    self.checkpointing.job_running(job)
                logger.info(
                    "job %s running: %d subtasks on %d TaskManagers (routing v%d)%s",
                    job.job_id, len(job.assignments), len({a.taskmanager_id for a in job.assignments.values()}),
                    job.routing_version, f", restored from {restore_path}" if restore_path else "",
                )
                return job.routing_table()
        except BaseException:
            if job.assignments:  # deployed, then a later step (the HA record) failed
                self._release(job, list(job.assignments.values()), discard_local=True)
                job.assignments = {}
            with self._lock:
                if self._jobs.get(spec.job_id) is job:
                    # A failed resubmission leaves the earlier (terminal) job visible, so that
                    # `statectl job info` and `job restore` still find it.
                    if existing is not None:
                        self._jobs[spec.job_id] = existing
                    else:
                        del self._jobs[spec.job_id]
            if self.checkpointing is not None:
                self.checkpointing.detach(job)
            raise

    def _deploy_all(
        self, job: Job, restores: dict[SubtaskId, tm_pb.SlotRestore], avoid: set[str] = frozenset(),  # type: ignore[assignment]
        prefer: dict[SubtaskId, str] | None = None,
    ) -> None:
        subtasks = plan_subtasks(job.job_id, list(job.spec.operators), job.spec.max_parallelism)
        # The version moves before slots are chosen: a loss reported under the old version was
        # removed from the registry first, so this deployment cannot include it (fail_over's
        # seen_version relies on that order).
        job.routing_version += 1
        assignments = allocate_slots(self.registry, subtasks, avoid, prefer)
        checkpoint_base = self.checkpointing.job_dir(job) if self.checkpointing is not None else ""
        incremental = job.config.get(o.CHECKPOINT_INCREMENTAL)
        ops = {op.operator_id: op for op in job.spec.operators}

        def deploy(a: SlotAssignment) -> tm_pb.DeploySlotResponse:
            request = tm_pb.DeploySlotRequest(
                job_id=job.job_id, operator=ops[a.subtask.operator_id].to_proto(), subtask_index=a.subtask.subtask_index,
                key_groups=pb.KeyGroupRange(start=a.key_groups.start, end=a.key_groups.end),
                max_parallelism=job.spec.max_parallelism, slot_index=a.slot_index, routing_version=job.routing_version,
                checkpoint_base=checkpoint_base, incremental=incremental,
            )
            restore = restores.get(a.subtask)
            if restore is not None:
                request.restore.CopyFrom(restore)
            return self.gateways.deploy(a.address, request)

        futures = {a: self._pool.submit(deploy, a) for a in assignments}
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
            self._release(job, deployed, discard_local=False)
            release_assignments(self.registry, assignments)
            first_assignment, first = errors[0]
            if isinstance(first, KeyedStateError):
                raise type(first)(f"deploying {first_assignment.subtask} to {first_assignment.taskmanager_id} failed: {first.message}", reason=first.reason) from first
            raise first
        job.assignments = {a.subtask: a for a in assignments}
        if restores and self.checkpointing is not None:
            self.checkpointing.restored(job, results)

    def _release(self, job: Job, assignments: list[SlotAssignment], discard_local: bool) -> None:
        def release(a: SlotAssignment) -> None:
            try:
                self.gateways.release(a.address, tm_pb.ReleaseSlotRequest(
                    job_id=job.job_id, operator_id=a.subtask.operator_id, subtask_index=a.subtask.subtask_index,
                    discard_local_state=discard_local,
                ))
            except KeyedStateError as exc:
                logger.info("releasing %s on %s: %s", a.subtask, a.taskmanager_id, exc.message)

        list(self._pool.map(release, assignments))
        release_assignments(self.registry, assignments)

    def cancel(self, job_id: str) -> jm_pb.JobInfo:
        job = self.job(job_id)
        with job.lock:
            if self.checkpointing is not None:
                self.checkpointing.detach(job)
            self._release(job, list(job.assignments.values()), discard_local=True)
            job.assignments = {}
            job.status = JobStatus.CANCELED
            job.routing_version += 1
            if self.checkpointing is not None:
                self.checkpointing.persist(job)
            logger.info("job %s canceled", job_id)
            return job.info()

    def rescale(self, job_id: str, parallelism: dict[str, int]) -> pb.RoutingTable:
        """Redeploy the job at new parallelism from a fresh savepoint-like checkpoint."""
        job = self.job(job_id)
        if self.checkpointing is None:
            raise InvalidArgumentError("rescaling needs state.checkpoints.dir: state moves through a checkpoint")
        for op_id in parallelism:
            if op_id and job.spec.operator(op_id) is None:
                raise NotFoundError(f"job {job_id!r} has no operator {op_id!r}", reason=Reason.UNKNOWN_OPERATOR)
        new_spec = job.spec.with_parallelism(parallelism)
        with job.lock:
            if job.status is not JobStatus.RUNNING:
                raise JobStateError(f"job {job_id!r} is {job.status.value}; it can be rescaled only while RUNNING")
            needed = len(plan_subtasks(job_id, list(new_spec.operators), new_spec.max_parallelism))
            available = self.registry.free_slot_count() + len(job.assignments)
            if needed > available:
                # Refused before anything is released: the job keeps running as it is.
                raise CapacityError(
                    f"rescaling job {job_id!r} needs {needed} slots but at most {available} can be had (its own "
                    f"{len(job.assignments)} plus {available - len(job.assignments)} free); start more TaskManagers "
                    "or ask for a lower parallelism"
                )
            path = self.checkpointing.checkpoint_for_rescale(job)
            old_spec = job.spec
            self._release(job, list(job.assignments.values()), discard_local=False)
            job.assignments = {}
            job.status = JobStatus.RESTARTING
            job.spec = new_spec
            try:
                restores = self.checkpointing.plan_restore(job, path)
                self._deploy_all(job, restores)
            except KeyedStateError as exc:
                # Back to the old shape, restored from the checkpoint just taken, by the usual failover.
                job.spec = old_spec
                self._pool.submit(self.fail_over, job_id, f"rescale to {parallelism} failed: {exc.message}")
                raise type(exc)(f"rescaling job {job_id!r} failed ({exc.message}); it restarts at its previous "
                                "parallelism from the checkpoint taken for the rescale", reason=exc.reason) from exc
            job.status = JobStatus.RUNNING
            self.checkpointing.persist(job)
            self.checkpointing.job_running(job)
            return job.routing_table()

    # -- failures ----------------------------------------------------------------------------
    def resume_recovered(self, job: Job) -> None:
        """Redeploy a job recovered after a JobManager restart, in the background."""
        from keyedstate.jobmanager.recovery import resume

        self._pool.submit(resume, self, self.checkpointing, job)

    def _on_taskmanager_lost(self, record: TaskManagerRecord, cause: str) -> None:
        self.gateways.forget(record.address)
        for job in self.jobs():
            if any(a.taskmanager_id == record.taskmanager_id for a in job.assignments.values()):
                self._pool.submit(self.fail_over, job.job_id, f"TaskManager {record.taskmanager_id} lost: {cause}",
                                  job.routing_version)

    def fail_over(self, job_id: str, cause: str, seen_version: int | None = None) -> None:
        """Restart the job from its latest completed checkpoint (after the restart strategy's delay).

        ``seen_version``: the routing version the failure was observed under (see failover.fail_over).
        """
        if self.checkpointing is None:
            job = self.job(job_id)
            with job.lock:
                job.status = JobStatus.FAILED
                job.failure_cause = cause + " (no state.checkpoints.dir: the job cannot recover its state)"
            return
        self.checkpointing.fail_over(job_id, cause, seen_version)

    def shutdown(self) -> None:
        self.closed.set()
        if self.checkpointing is not None:
            self.checkpointing.shutdown()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.gateways.close()
