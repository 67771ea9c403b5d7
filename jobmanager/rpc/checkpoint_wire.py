"""The checkpoint messages of the JobManager's RPC edge, converted to and from the checkpoint domain.

Servicers call these; below them ``Checkpointing`` and the coordinator see only domain values
(``CheckpointTrigger``, ``CheckpointDecline``, ``SubtaskStateHandle``, ``CheckpointSummary``,
``AckOutcome``). Statuses and outcomes travel as the wire's enums, named as in the domain.
"""

from __future__ import annotations

from collections.abc import Iterable

from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.ids import CheckpointId, SubtaskId
from keyedstate.common.rpc.enums import value_of
from keyedstate.jobmanager.checkpoint import (
    AckOutcome,
    CheckpointSummary,
    CompletedCheckpoint,
    DeclineReason,
)
from keyedstate.jobmanager.checkpointing import CheckpointDecline, CheckpointTrigger

_DECLINE_REASONS = {
    jm_pb.DECLINE_REASON_SNAPSHOT_FAILED: DeclineReason.SNAPSHOT_FAILED,
    jm_pb.DECLINE_REASON_STATE_SIZE_LIMIT_EXCEEDED: DeclineReason.STATE_SIZE_LIMIT_EXCEEDED,
}


def trigger_from_proto(request: jm_pb.TriggerCheckpointRequest) -> CheckpointTrigger:
    """A TriggerCheckpoint call as the domain takes it (an empty target directory means the default)."""
    return CheckpointTrigger(
        savepoint=request.savepoint,
        target_dir=request.target_directory or None,
        wait=request.wait,
        timeout_ms=request.timeout_ms,
    )


def decline_from_proto(request: jm_pb.DeclineCheckpointRequest) -> CheckpointDecline:
    """A DeclineCheckpoint call; a reason this JobManager does not know reads as UNSPECIFIED."""
    return CheckpointDecline(
        checkpoint_id=CheckpointId(request.checkpoint_id),
        subtask=SubtaskId(request.job_id, request.operator_id, request.subtask_index),
        message=request.message,
        reason=_DECLINE_REASONS.get(request.reason, DeclineReason.UNSPECIFIED),
    )


def ack_response(outcome: AckOutcome) -> jm_pb.AckResponse:
    """What an acknowledgement or a decline did, as the wire's AckOutcome."""
    return jm_pb.AckResponse(outcome=value_of(jm_pb.AckOutcome, outcome.value))


def summary_to_proto(summary: CheckpointSummary) -> jm_pb.CheckpointInfo:
    """A checkpoint as the wire's CheckpointInfo."""
    return jm_pb.CheckpointInfo(
        checkpoint_id=summary.checkpoint_id,
        path=summary.path,
        status=value_of(jm_pb.CheckpointStatus, summary.status.value),
        failure_reason=summary.failure_reason,
        epoch=summary.epoch,
        trigger_timestamp_ms=summary.trigger_timestamp_ms,
        duration_ms=summary.duration_ms,
        full_size=summary.full_size,
        incremental_size=summary.incremental_size,
        savepoint=summary.savepoint,
    )


def checkpoint_info(completed: CompletedCheckpoint) -> jm_pb.CheckpointInfo:
    """A completed checkpoint as the wire's CheckpointInfo (status COMPLETED)."""
    return summary_to_proto(CheckpointSummary.of_completed(completed))


def list_checkpoints_response(summaries: Iterable[CheckpointSummary]) -> jm_pb.ListCheckpointsResponse:
    """The checkpoint history, in the order given (newest first)."""
    return jm_pb.ListCheckpointsResponse(checkpoints=[summary_to_proto(s) for s in summaries])
