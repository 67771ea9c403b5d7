"""Failover: restart a job from its latest completed checkpoint after a TaskManager loss.

The restart strategy (``restart-strategy.*``, as in Flink) decides whether and when; when
restarts are exhausted the job goes to FAILED with the cause kept for ``statectl``.

One restart (docs/exactly-once.md, "Restarts"):

1. the job is RESTARTING, its routing version moved and its pending checkpoints aborted, all
   before the job's lock is released (:func:`begin_failover`);
2. its slots are released; a TaskManager that cannot be reached to release one is declared
   lost, because it may still serve the slot;
3. it waits, as part of the same restart and for at most ``slot.request.timeout``, for enough
   free slots and for every TaskManager that hosted the job to be fenced;
4. it restores the latest completed checkpoint (or what the job was submitted from, or empty
   state) and deploys, which also sets the job's committed epoch to what it restored.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from keyedstate.common.config import Configuration
from keyedstate.common.config import options as o
from keyedstate.common.errors import KeyedStateError
from keyedstate.common.ids import JobId, SubtaskId, TaskManagerId
from keyedstate.common.lifecycle import JobStatus
from keyedstate.jobmanager.checkpoint.failure import CheckpointFailureReason
from keyedstate.jobmanager.checkpointing import Checkpointing
from keyedstate.jobmanager.jobs import Job, RestorePlan
from keyedstate.jobmanager.scheduling import SlotAssignment, plan_subtasks

logger = logging.getLogger(__name__)


class Deployments(Protocol):
    """What a restart needs from the layer above (the Dispatcher, which owns jobs and slots)."""

    @property
    def closed(self) -> threading.Event:
        """Set when the JobManager shuts down: restart loops stop waiting."""

    def job(self, job_id: JobId) -> Job:
        """The job registered under ``job_id`` (NotFoundError if none)."""

    def release_slots(self, job: Job, assignments: list[SlotAssignment], discard_local: bool) -> None:
        """Release ``assignments`` on their TaskManagers; one that cannot be reached is declared lost."""

    def wait_for_resources(self, job: Job, needed: int, owners: set[TaskManagerId], timeout_ms: int) -> None:
        """Wait for ``needed`` free slots and every TaskManager in ``owners`` fenced (CapacityError at the timeout)."""

    def deploy(self, job: Job, plan: RestorePlan, prefer: Mapping[SubtaskId, TaskManagerId] | None = None) -> None:
        """Deploy every subtask of the job from ``plan`` under a new routing version (caller holds ``job.lock``)."""

    def run_in_background(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the JobManager's pool, off the caller's locks."""

    def fail_over(self, job_id: JobId, cause: str, seen_version: int | None = None) -> None:
        """Restart the job from its latest completed checkpoint, after the restart strategy's delay."""


@dataclass(frozen=True)
class RestartStrategy:
    kind: str
    attempts: int
    delay_ms: int
    max_delay_ms: int
    multiplier: float

    @classmethod
    def from_config(cls, conf: Configuration) -> RestartStrategy:
        """The ``restart-strategy`` of ``conf``: ``none``, ``fixed-delay`` or (otherwise) exponential delay."""
        kind = conf.get(o.RESTART_STRATEGY)
        if kind in ("none", "disable", "off"):
            return cls("none", 0, 0, 0, 1.0)
        if kind == "fixed-delay":
            delay = conf.get(o.RESTART_FIXED_DELAY)
            return cls(kind, conf.get(o.RESTART_FIXED_ATTEMPTS), delay, delay, 1.0)
        return cls(
            kind,
            conf.get(o.RESTART_EXP_ATTEMPTS),
            conf.get(o.RESTART_EXP_INITIAL),
            conf.get(o.RESTART_EXP_MAX),
            conf.get(o.RESTART_EXP_MULTIPLIER),
        )

    def delay_for(self, restart_number: int) -> int:
        """Delay before restart number ``restart_number`` (1-based)."""
        return int(min(self.max_delay_ms, self.delay_ms * self.multiplier ** (restart_number - 1)))


def fail_over(
    dispatcher: Deployments, checkpointing: Checkpointing, job_id: JobId, cause: str, seen_version: int | None = None
) -> None:
    """Restart ``job_id`` from its latest completed checkpoint, as the restart strategy allows.

    ``seen_version`` is the routing version the failure was seen under: if the job has been
    redeployed since (another report of the same loss already restarted it), nothing happens.
    While a failover of the job is under way, a further failure only updates the cause; the
    restart under way deploys on whatever TaskManagers are alive by then.
    """
    job = dispatcher.job(job_id)
    with job.lock:
        if not begin_failover(checkpointing, job, cause, seen_version):
            return
    run_restarts(dispatcher, checkpointing, job)


def fail_over_now(dispatcher: Deployments, checkpointing: Checkpointing, job: Job, cause: str) -> None:
    """Start a failover now; the caller holds ``job.lock``, and the restarts run in the background.

    The job is RESTARTING (so nothing commits or checkpoints it) before the caller releases the
    lock: an epoch applied on some TaskManagers and not on others is never cut by a checkpoint.
    """
    if begin_failover(checkpointing, job, cause):
        dispatcher.run_in_background(run_restarts, dispatcher, checkpointing, job)


def begin_failover(checkpointing: Checkpointing, job: Job, cause: str, seen_version: int | None = None) -> bool:
    """Move the job to RESTARTING (caller holds ``job.lock``); False if another failover already owns it."""
    if job.status.terminal:
        return False
    if seen_version is not None and job.routing_version != seen_version:
        logger.info("job %s: %s (already redeployed since; ignored)", job.job_id, cause)
        return False
    if job.failing_over:
        # The loop under way has not redeployed yet (it clears the flag in the same locked
        # step that makes the job RUNNING), so its restart already covers this failure.
        job.failure_cause = cause
        return False
    logger.warning("job %s: failing over: %s", job.job_id, cause)
    job.failing_over = True
    job.move_to(JobStatus.RESTARTING)
    job.failure_cause = cause
    job.routing_version += 1
    if job.coordinator is not None:
        job.coordinator.abort_pending(CheckpointFailureReason.TASK_FAILURE, cause)
    checkpointing.persist(job)
    return True


def run_restarts(dispatcher: Deployments, checkpointing: Checkpointing, job: Job) -> None:
    """Restart the job as its restart strategy allows, until it runs, fails, or is cancelled."""
    strategy = RestartStrategy.from_config(job.config)
    try:
        while True:
            with job.lock:
                if job.status is not JobStatus.RESTARTING:
                    return  # cancelled, or resubmitted, meanwhile
                if job.restarts >= strategy.attempts:
                    job.move_to(JobStatus.FAILED)
                    job.failure_cause = (
                        f"{job.failure_cause} (restart strategy {strategy.kind}: {job.restarts} of "
                        f"{strategy.attempts} restarts used)"
                    )
                    logger.error("job %s FAILED: %s", job.job_id, job.failure_cause)
                    failed_assignments = list(job.assignments.values())
                    job.assignments = {}
                else:
                    job.restarts += 1
                    number = job.restarts
                    failed_assignments = None
            if failed_assignments is not None:
                # A failed job gives its slots back, so that the job can be restored (or another run).
                dispatcher.release_slots(job, failed_assignments, discard_local=False)
                checkpointing.persist(job)
                checkpointing.detach(job)  # no more checkpoints; the store still answers job info
                return
            if dispatcher.closed.wait(strategy.delay_for(number) / 1000.0):
                logger.info("job %s: restart %d abandoned, the JobManager is shutting down", job.job_id, number)
                return
            try:
                if restart(dispatcher, checkpointing, job):
                    logger.info("job %s restarted (restart %d)", job.job_id, number)
                return
            except KeyedStateError as exc:
                cause = f"restart {number} failed: {exc.message}"
                logger.warning("job %s: %s", job.job_id, cause)
            except Exception as exc:  # a bug must not leave the job silently stuck in RESTARTING
                cause = f"restart {number} failed unexpectedly: {exc!r}"
                logger.exception("job %s: %s", job.job_id, cause)
            with job.lock:
                job.failure_cause = cause
    finally:
        with job.lock:
            job.failing_over = False


def restart(dispatcher: Deployments, checkpointing: Checkpointing, job: Job) -> bool:
    """One restart of a RESTARTING job (see the module docstring); False if the job stopped restarting meanwhile.

    The lock is held only to take the old deployment apart and to deploy the new one; releasing
    slots and waiting for resources happen without it, so routing and status queries go on.
    """
    with job.lock:
        if not _restarting(job):
            return False
        previous = dict(job.assignments)
        job.assignments = {}
        owners = set(job.last_taskmanagers) | {a.taskmanager_id for a in previous.values()}
        prefer = {s: a.taskmanager_id for s, a in previous.items()}
    dispatcher.release_slots(job, list(previous.values()), discard_local=False)
    needed = len(plan_subtasks(job.job_id, list(job.spec.operators), job.spec.max_parallelism))
    dispatcher.wait_for_resources(job, needed, owners, job.config.get(o.SLOT_REQUEST_TIMEOUT))
    with job.lock:
        if not _restarting(job):  # it may have been cancelled while the lock was not held
            return False
        plan = checkpointing.plan_latest(job)
        dispatcher.deploy(job, plan, prefer=prefer)
        job.move_to(JobStatus.RUNNING)
        job.failing_over = False
        checkpointing.persist(job)
        checkpointing.job_running(job, plan)
        return True


def _restarting(job: Job) -> bool:
    # A function, not an inline test: the status changes under other threads between two looks.
    return job.status is JobStatus.RESTARTING
