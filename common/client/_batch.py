"""The batch protocol as the client answers it: domain types for BeginBatch and CommitEpoch.

The Spark helper (and any driver written against the client) decides what to do with a
micro-batch from these values; the messages behind them stay in the client (``_wire``), the
one place in the executor package that reads the JobManager's responses.
"""

from __future__ import annotations

from dataclasses import dataclass

from keyedstate.common.client._routing import Routing
from keyedstate.common.lifecycle import BatchAction, CheckpointStatus, JobStatus


def status_name(status: JobStatus | CheckpointStatus | None) -> str:
    """The bare name people read ("RUNNING"); "" when the JobManager named none."""
    return status.value if status is not None else ""


@dataclass(frozen=True)
class CheckpointSummary:
    """One checkpoint as the JobManager reported it (with a commit, or on request)."""

    checkpoint_id: int
    path: str
    status: CheckpointStatus | None
    """None: the JobManager named no status."""
    failure_reason: str
    epoch: int
    """The job epoch the checkpoint holds."""
    trigger_timestamp_ms: int
    duration_ms: int
    full_size: int
    incremental_size: int
    savepoint: bool

    @property
    def completed(self) -> bool:
        """The checkpoint completed: what it holds survives any failover."""
        return self.status is CheckpointStatus.COMPLETED


@dataclass(frozen=True)
class BatchStart:
    """Where one Spark batch stands: the answer to BeginBatch."""

    action: BatchAction
    epoch: int
    """The job epoch the batch is (or was) applied as."""
    committed_epoch: int
    durable_epoch: int
    job_status: JobStatus | None
    failure_cause: str
    routing: Routing
    """The routing the batch runs under; its version pins every write of the batch's tasks."""


@dataclass(frozen=True)
class EpochCommitted:
    """The answer to CommitEpoch: the epoch the job's state now holds, and the checkpoint when one came back."""

    committed_epoch: int
    already_committed: bool
    """The state held the epoch before this call (a re-run): nothing was applied again."""
    checkpoint: CheckpointSummary | None
    """The checkpoint holding the epoch (None: the commit asked for none and waited for none)."""
    decided: bool = False
    """Overlapped commits: the epoch's decision is in checkpoint storage, so the epoch is durable without a checkpoint."""


@dataclass(frozen=True)
class JobProgress:
    """A job's status and epochs, the part of the JobManager's view a driver steers by."""

    job_id: str
    status: JobStatus | None
    committed_epoch: int
    """The epoch the job's state holds (-1: none)."""
    durable_epoch: int
    """The epoch of the latest completed checkpoint (-1: none)."""
    failure_cause: str
    restarts: int
    routing_version: int
    applied_epoch: int = -1
    """The epoch every slot has applied: reads outside an epoch see it (overlapped commits apply
    behind the driver, so it can trail ``committed_epoch`` by one for a moment)."""
