"""Why a checkpoint failed (Flink's ``CheckpointFailureReason``) and the errors that carry it."""

from __future__ import annotations

import enum
import logging

from keyedstate.common.errors import CheckpointError, Reason
from keyedstate.common.handles import DeclineReason

__all__ = [
    "CheckpointException",
    "CheckpointFailureReason",
    "CheckpointInProgressError",
    "CheckpointNotFoundError",
    "DeclineReason",
]

logger = logging.getLogger(__name__)


class CheckpointFailureReason(enum.Enum):
    """A typed failure cause; metrics and logs use its name.

    ``pre_flight`` reasons reject a trigger before a checkpoint exists. ``counts`` says whether
    the failure counts toward ``execution.checkpointing.tolerable-failed-checkpoints``; as in
    Flink, rejections, shutdowns and failures caused by a task or job failover do not.
    """

    PERIODIC_SCHEDULER_SHUTDOWN = (
        "PERIODIC_SCHEDULER_SHUTDOWN",
        True,
        False,
        "Periodic checkpoint scheduler is shut down.",
    )
    TOO_MANY_CHECKPOINT_REQUESTS = (
        "TOO_MANY_CHECKPOINT_REQUESTS",
        True,
        False,
        "The maximum number of concurrent checkpoints is exceeded.",
    )
    MINIMUM_TIME_BETWEEN_CHECKPOINTS = (
        "MINIMUM_TIME_BETWEEN_CHECKPOINTS",
        True,
        False,
        "The minimum time between checkpoints is still pending.",
    )
    NOT_ALL_REQUIRED_TASKS_RUNNING = (
        "NOT_ALL_REQUIRED_TASKS_RUNNING",
        True,
        False,
        "Not all required tasks are currently running.",
    )
    IO_EXCEPTION = ("IO_EXCEPTION", True, True, "An I/O problem occurred while triggering the checkpoint.")
    TRIGGER_CHECKPOINT_FAILURE = ("TRIGGER_CHECKPOINT_FAILURE", False, False, "Sending the checkpoint barrier failed.")
    CHECKPOINT_ASYNC_EXCEPTION = ("CHECKPOINT_ASYNC_EXCEPTION", False, True, "Asynchronous task checkpoint failed.")
    CHECKPOINT_EXPIRED = ("CHECKPOINT_EXPIRED", False, True, "Checkpoint expired before completing.")
    CHECKPOINT_SUBSUMED = (
        "CHECKPOINT_SUBSUMED",
        False,
        False,
        "Checkpoint has been subsumed by a newer completed checkpoint.",
    )
    CHECKPOINT_DECLINED = ("CHECKPOINT_DECLINED", False, True, "Checkpoint was declined.")
    # Not one of Flink's (there the declining task's exception says it): its own reason here, since
    # the fix is a configuration change (filesystem storage), not a retry.
    STATE_SIZE_LIMIT_EXCEEDED = (
        "STATE_SIZE_LIMIT_EXCEEDED",
        False,
        True,
        "A subtask's state is larger than the JobManager checkpoint storage takes; use filesystem checkpoint storage.",
    )
    CHECKPOINT_COORDINATOR_SHUTDOWN = (
        "CHECKPOINT_COORDINATOR_SHUTDOWN",
        False,
        False,
        "CheckpointCoordinator shutdown.",
    )
    CHECKPOINT_COORDINATOR_SUSPEND = (
        "CHECKPOINT_COORDINATOR_SUSPEND",
        False,
        False,
        "Checkpoint Coordinator is suspending.",
    )
    FINALIZE_CHECKPOINT_FAILURE = ("FINALIZE_CHECKPOINT_FAILURE", False, True, "Failure to finalize checkpoint.")
    JOB_FAILOVER_REGION = ("JOB_FAILOVER_REGION", False, False, "The job is failing over.")
    TASK_FAILURE = ("TASK_FAILURE", False, False, "Task has failed.")

    pre_flight: bool
    counts: bool
    description: str

    def __new__(cls, value: str, pre_flight: bool, counts: bool, description: str) -> CheckpointFailureReason:
        member = object.__new__(cls)
        member._value_ = value
        member.pre_flight = pre_flight
        member.counts = counts
        member.description = description
        return member


class CheckpointException(CheckpointError):
    """A checkpoint was not triggered or did not complete; ``failure_reason`` says why."""

    def __init__(self, failure_reason: CheckpointFailureReason, message: str | None = None) -> None:
        super().__init__(f"{failure_reason.name}: {message or failure_reason.description}")
        self.failure_reason = failure_reason
        self.detail = message or failure_reason.description


class CheckpointNotFoundError(CheckpointError):
    """A path or id does not name a completed checkpoint or savepoint."""

    reason = Reason.INVALID_ARGUMENT


class CheckpointInProgressError(CheckpointError):
    """Waiting for a checkpoint timed out while it is still in progress; wait again to keep waiting."""

    reason = Reason.UNAVAILABLE
