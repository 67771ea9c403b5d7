"""Resuming jobs after a JobManager restart (high availability).

The restarted JobManager knows its jobs and their completed checkpoints from the HA store
before it serves any call. TaskManagers find it again by themselves (their heartbeats fail,
they register anew) and report the slots they still host; those are released, because a job
restarts from its latest completed checkpoint as a whole, just as after a TaskManager loss.
Each recovered job waits for enough free slots (``slot.request.timeout``), deletes what
crashed checkpoints left behind, and redeploys. If it cannot, the job's restart strategy
takes over, as for any other failure.
"""

from __future__ import annotations

import logging

from keyedstate.common.clock import Clock
from keyedstate.common.errors import KeyedStateError
from keyedstate.common.lifecycle import JobStatus
from keyedstate.jobmanager.checkpointing import Checkpointing
from keyedstate.jobmanager.failover import Deployments, restart
from keyedstate.jobmanager.jobs import Job

logger = logging.getLogger(__name__)


def resume(dispatcher: Deployments, checkpointing: Checkpointing, job: Job, clock: Clock) -> None:
    """Bring one recovered job back to RUNNING (runs on the dispatcher's pool).

    The restart waits, within ``slot.request.timeout``, for free slots and for every
    TaskManager that hosted the job's last deployment to be fenced: re-registered with this
    JobManager, or past the end of any lease an earlier leader could have granted it.
    """
    started_ms = clock.monotonic_ms()
    try:
        checkpointing.sweep_orphans(job)
    except (KeyedStateError, OSError) as exc:
        # Garbage is not a reason to keep a job down; `statectl checkpoint gc` can finish the job.
        logger.warning("job %s: cleaning up after crashed checkpoints failed: %s", job.job_id, exc)
    with job.lock:
        if job.status is not JobStatus.RESTARTING or job.failing_over:
            return  # canceled or resubmitted meanwhile, or a failover owns it already
        job.failing_over = True  # a TaskManager loss meanwhile only updates the cause
    try:
        resumed = restart(dispatcher, checkpointing, job)
    except KeyedStateError as exc:
        cause = f"resuming after the JobManager restart failed: {exc.message}"
    else:
        if resumed:
            with job.lock:
                job.failure_cause = ""
                checkpointing.persist(job)
            logger.info(
                "job %s resumed after the JobManager restart in %.2f s (routing v%d, epoch %d)",
                job.job_id,
                (clock.monotonic_ms() - started_ms) / 1000.0,
                job.routing_version,
                job.committed_epoch,
            )
        return
    finally:
        with job.lock:
            job.failing_over = False
    dispatcher.fail_over(job.job_id, cause)
