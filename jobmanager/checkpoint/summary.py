"""One checkpoint as a caller sees it: what a trigger answers and what the checkpoint list shows.

A domain value (no protobuf): the RPC edge (``jobmanager.rpc.checkpoint_wire``) turns it into the
wire's ``CheckpointInfo``. Its fields mirror that message, so a refused trigger, one in flight, a
completed checkpoint and a history entry all read the same to statectl and Spark drivers.
"""

from __future__ import annotations

from dataclasses import dataclass

from keyedstate.common.ids import CheckpointId
from keyedstate.common.lifecycle import CheckpointStatus
from keyedstate.jobmanager.checkpoint.completed import CompletedCheckpoint


@dataclass(frozen=True)
class CheckpointSummary:
    """A checkpoint or savepoint: its id, status, where it is and, once known, its sizes or why it failed."""

    checkpoint_id: CheckpointId
    """0 for a trigger refused before any checkpoint existed."""
    status: CheckpointStatus
    path: str = ""
    failure_reason: str = ""
    """``<CheckpointFailureReason name>: <detail>`` for a failed checkpoint; empty otherwise."""
    epoch: int = 0
    trigger_timestamp_ms: int = 0
    duration_ms: int = 0
    full_size: int = 0
    incremental_size: int = 0
    savepoint: bool = False

    @classmethod
    def of_completed(cls, completed: CompletedCheckpoint) -> CheckpointSummary:
        """A completed checkpoint (status COMPLETED), with its trigger-to-completion duration."""
        meta = completed.metadata
        # Wall-clock trigger to completion; 0 for a checkpoint loaded from storage (no completion time).
        duration = (
            max(0, completed.completion_timestamp_ms - meta.timestamp_ms) if completed.completion_timestamp_ms else 0
        )
        return cls(
            checkpoint_id=CheckpointId(completed.checkpoint_id),
            path=completed.external_path,
            status=CheckpointStatus.COMPLETED,
            epoch=meta.epoch,
            trigger_timestamp_ms=meta.timestamp_ms,
            full_size=meta.full_size,
            incremental_size=meta.incremental_size,
            savepoint=meta.savepoint,
            duration_ms=duration,
        )
