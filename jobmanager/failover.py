"""Failover: restart a job from its latest completed checkpoint after a TaskManager loss.

The restart strategy (``restart-strategy.*``, as in Flink) decides whether and when; when
restarts are exhausted the job goes to FAILED with the cause kept for ``statectl``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from keyedstate.common.config import Configuration, options as o
from keyedstate.common.errors import KeyedStateError
from keyedstate.jobmanager.jobs import JobStatus
from keyedstate.jobmanager.scheduling import check_free_slots, plan_subtasks

if TYPE_CHECKING:
    from keyedstate.jobmanager.checkpointing import Checkpointing
    from keyedstate.jobmanager.dispatcher import Dispatcher
    from keyedstate.jobmanager.jobs import Job

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartStrategy:
    kind: str
    attempts: int
    delay_ms: int
    max_delay_ms: int
    multiplier: float

    @classmethod
    def from_config(cls, conf: Configuration) -> RestartStrategy:
        kind = conf.get(o.RESTART_STRATEGY)
        if kind in ("none", "disable", "off"):
            return cls("none", 0, 0, 0, 1.0)
        if kind == "fixed-delay":
            delay = conf.get(o.RESTART_FIXED_DELAY)
            return cls(kind, conf.get(o.RESTART_FIXED_ATTEMPTS), delay, delay, 1.0)
        return cls(kind, conf.get(o.RESTART_EXP_ATTEMPTS), conf.get(o.RESTART_EXP_INITIAL),
                   conf.get(o.RESTART_EXP_MAX), conf.get(o.RESTART_EXP_MULTIPLIER))

    def delay_for(self, restart_number: int) -> int:
        """Delay before restart number ``restart_number`` (1-based)."""
        return int(min(self.max_delay_ms, self.delay_ms * self.multiplier ** (restart_number - 1)))


def fail_over(dispatcher: Dispatcher, checkpointing: Checkpointing, job_id: str, cause: str,
              seen_version: int | None = None) -> None:
    """Restart ``job_id`` from its latest completed checkpoint, as the restart strategy allows.

    ``seen_version`` is the routing version the failure was seen under: if the job has been
    redeployed since (another report of the same loss already restarted it), nothing happens.
    While a failover of the job is under way, a further failure only updates the cause; the
    restart under way deploys on whatever TaskManagers are alive by then.
    """
    job = dispatcher.job(job_id)
    strategy = RestartStrategy.from_config(job.config)
    with job.lock:
        if job.status.terminal:
            return
        if seen_version is not None and job.routing_version != seen_version:
            logger.info("job %s: %s (already redeployed since; ignored)", job_id, cause)
            return
        if job.failing_over:
            # The loop under way has not redeployed yet (it clears the flag in the same locked
            # step that makes the job RUNNING), so its restart already covers this failure.
            job.failure_cause = cause
            return
        job.failing_over = True
    try:
        _fail_over(dispatcher, checkpointing, job, strategy, cause)
    finally:
        with job.lock:
            job.failing_over = False


def _fail_over(dispatcher: Dispatcher, checkpointing: Checkpointing, job: Job, strategy: RestartStrategy, cause: str) -> None:
    job_id = job.job_id
    with job.lock:
        logger.warning("job %s: failing over: %s", job_id, cause)
        job.status = JobStatus.RESTARTING
        job.failure_cause = cause
        job.routing_version += 1
        if job.coordinator is not None:
            job.coordinator.abort_pending(_task_failure(), cause)
        checkpointing.persist(job)
    while True:
        with job.lock:
            if job.status.terminal:
                return
            if job.restarts >= strategy.attempts:
                job.status = JobStatus.FAILED
                job.failure_cause = f"{cause} (restart strategy {strategy.kind}: {job.restarts} of {strategy.attempts} restarts used)"
                logger.error("job %s FAILED: %s", job_id, job.failure_cause)
                # A failed job gives its slots back, so that the job can be restored (or another run).
                dispatcher._release(job, list(job.assignments.values()), discard_local=False)  # noqa: SLF001
                job.assignments = {}
                checkpointing.persist(job)
                checkpointing.detach(job)  # no more checkpoints; the store still answers job info
                return
            job.restarts += 1
            number = job.restarts
        if dispatcher.closed.wait(strategy.delay_for(number) / 1000.0):
            logger.info("job %s: restart %d abandoned, the JobManager is shutting down", job_id, number)
            return
        with job.lock:
            if job.status.terminal:
                return
            try:
                restart(dispatcher, checkpointing, job)
                job.failing_over = False
                logger.info("job %s restarted (restart %d)", job_id, number)
                return
            except KeyedStateError as exc:
                cause = f"restart {number} failed: {exc.message}"
                logger.warning("job %s: %s", job_id, cause)
                job.failure_cause = cause
            except Exception as exc:  # a bug must not leave the job silently stuck in RESTARTING
                cause = f"restart {number} failed unexpectedly: {exc!r}"
                logger.exception("job %s: %s", job_id, cause)
                job.failure_cause = cause


def restart(dispatcher: Dispatcher, checkpointing: Checkpointing, job: Job) -> None:
    """Redeploy every subtask of ``job`` from its latest completed checkpoint (caller holds ``job.lock``).

    Before its first checkpoint, a job restores what it was submitted from (a savepoint or an
    older checkpoint), or starts empty if it was submitted without one.
    """
    previous = {s: a.taskmanager_id for s, a in job.assignments.items()}
    dispatcher._release(job, list(job.assignments.values()), discard_local=False)  # noqa: SLF001
    job.assignments = {}
    # Before reading the checkpoint: a restart that waits for TaskManagers retries every few
    # hundred ms, and each attempt would otherwise load and verify the checkpoint from storage.
    check_free_slots(dispatcher.registry, len(plan_subtasks(job.job_id, list(job.spec.operators), job.spec.max_parallelism)))
    latest = job.coordinator.latest_completed() if job.coordinator is not None else None
    path = latest.external_path if latest is not None else job.restore_path
    restores = checkpointing.plan_restore(job, path) if path else {}
    dispatcher._deploy_all(job, restores, prefer=previous)  # noqa: SLF001
    job.status = JobStatus.RUNNING
    checkpointing.persist(job)
    checkpointing.job_running(job)


def _task_failure():  # type: ignore[no-untyped-def]
    from keyedstate.jobmanager.checkpoint import CheckpointFailureReason

    return CheckpointFailureReason.TASK_FAILURE
