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
import time
from typing import TYPE_CHECKING

from keyedstate.common.config import options as o
from keyedstate.common.errors import KeyedStateError
from keyedstate.jobmanager.failover import restart
from keyedstate.jobmanager.jobs import Job, JobStatus
from keyedstate.jobmanager.scheduling import plan_subtasks

if TYPE_CHECKING:
    from keyedstate.jobmanager.checkpointing import Checkpointing
    from keyedstate.jobmanager.dispatcher import Dispatcher

logger = logging.getLogger(__name__)

_POLL_S = 0.1


def resume(dispatcher: Dispatcher, checkpointing: Checkpointing, job: Job) -> None:
    """Bring one recovered job back to RUNNING (runs on the dispatcher's pool)."""
    started = time.monotonic()
    try:
        checkpointing.sweep_orphans(job)
    except (KeyedStateError, OSError) as exc:
        # Garbage is not a reason to keep a job down; `statectl checkpoint gc` can finish the job.
        logger.warning("job %s: cleaning up after crashed checkpoints failed: %s", job.job_id, exc)
    needed = len(plan_subtasks(job.job_id, list(job.spec.operators), job.spec.max_parallelism))
    timeout_s = job.config.get(o.SLOT_REQUEST_TIMEOUT) / 1000.0
    while dispatcher.registry.free_slot_count() < needed or dispatcher.registry.hosts_job(job.job_id):
        if time.monotonic() - started > timeout_s:
            dispatcher.fail_over(job.job_id, (
                f"after the JobManager restart only {dispatcher.registry.free_slot_count()} of the {needed} slots the "
                f"job needs were free within slot.request.timeout ({timeout_s:.0f} s); start more TaskManagers"))
            return
        if dispatcher.closed.wait(_POLL_S):
            return
    with job.lock:
        if job.status is not JobStatus.RESTARTING:
            return  # canceled or resubmitted meanwhile
        try:
            restart(dispatcher, checkpointing, job)
        except KeyedStateError as exc:
            cause = f"resuming after the JobManager restart failed: {exc.message}"
        else:
            job.failure_cause = ""
            checkpointing.persist(job)
            logger.info("job %s resumed after the JobManager restart in %.2f s (routing v%d)",
                        job.job_id, time.monotonic() - started, job.routing_version)
            return
    dispatcher.fail_over(job.job_id, cause)
