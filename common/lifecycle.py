"""The statuses every process names alike: a job's, a checkpoint's, and what a Spark batch must do.

The JobManager decides them, the wire carries them as proto enums (``JobStatus``,
``CheckpointStatus``, ``BatchAction``), and the client and the Spark helper read them back as
these same types, so a driver compares ``JobStatus.RUNNING`` whichever side it stands on.
The member values are the wire names without their prefix (``JOB_STATUS_RUNNING`` -> ``"RUNNING"``),
which is also what statectl prints and the HA store persists.
"""

from __future__ import annotations

import enum


class JobStatus(enum.Enum):
    """A job's lifecycle status (Flink's ``JobStatus``, narrowed to what a keyed-state job goes through)."""

    CREATED = "CREATED"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    FAILED = "FAILED"
    CANCELED = "CANCELED"

    @property
    def terminal(self) -> bool:
        """FAILED or CANCELED: the job never runs again (a resubmission under its id is a new job)."""
        return self in (JobStatus.FAILED, JobStatus.CANCELED)


class CheckpointStatus(enum.StrEnum):
    """Where a checkpoint stands (Flink's ``CheckpointStatsStatus``)."""

    IN_PROGRESS = "IN_PROGRESS"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"


class BatchAction(enum.Enum):
    """What the JobManager tells a driver to do with one Spark batch (docs/exactly-once.md)."""

    RUN = "RUN"
    """Run the batch as the returned epoch."""
    ALREADY_COMMITTED = "ALREADY_COMMITTED"
    """The state holds the batch already (a re-run after a driver restart); only make sure it is durable."""
    WAIT = "WAIT"
    """The job is restarting or waiting for slots; ask again."""
    STOP = "STOP"
    """The job is FAILED or CANCELED; the query must stop."""
