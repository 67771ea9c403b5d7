"""The client's messages: keyed requests built and answers read in either wire version, and the
JobManager's batch-protocol messages read into the client's domain types (``_batch``).

Only the client calls these: BeginBatch, CommitEpoch and GetJob answers become values a driver
can act on without knowing a message's field names or an enum's wire prefix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common._proto.v1 import taskmanager_pb2 as tm_pb
from keyedstate.common.client._batch import BatchStart, CheckpointSummary, EpochCommitted, JobProgress
from keyedstate.common.client._routing import Routing
from keyedstate.common.errors import KeyedStateError, Reason, UnavailableError
from keyedstate.common.lifecycle import BatchAction, CheckpointStatus, JobStatus
from keyedstate.common.rpc.enums import name_of
from keyedstate.common.rpc.packed import pack, unpack

COLUMNAR = tm_pb.WIRE_VERSION_COLUMNAR
_PACKED_FIELDS = {"values": "packed_values", "user_keys": "packed_user_keys", "namespaces": "packed_namespaces"}


def keyed_request(
    target: tm_pb.StateTarget,
    keys: Sequence[bytes],
    columns: Mapping[str, Sequence[bytes]],
    namespace: bytes,
    *,
    return_values: bool = False,
    packed: bool,
) -> tm_pb.KeyedRequest:
    """One request carrying ``keys`` and ``columns`` (``values``, ``user_keys``, ``namespaces``, already
    picked for this request): packed (wire version 2) or as repeated fields (version 1)."""
    request = tm_pb.KeyedRequest(target=target, namespace=namespace, return_values=return_values)
    if not packed:
        request.keys.extend(keys)
        for name, column in columns.items():
            getattr(request, name).extend(column)
        return request
    offsets, data = pack(keys)
    request.packed_keys.offsets, request.packed_keys.data = offsets, data
    for name, column in columns.items():
        target_column: tm_pb.PackedBytes = getattr(request, _PACKED_FIELDS[name])
        target_column.offsets, target_column.data = pack(column)
    return request


def answered_values(response: Any) -> list[bytes]:
    """The values of a ValuesResponse (empty bytes where not found), whichever wire version it came in."""
    if response.HasField("packed_values"):
        return unpack(response.packed_values.offsets, response.packed_values.data, "packed_values of the answer")
    return list(response.values)


def answered_lists(response: Any) -> list[list[bytes]]:
    """The lists of a ListsResponse, whichever wire version it came in."""
    if not response.HasField("packed_elements"):
        return [list(value.elements) for value in response.lists]
    elements = unpack(response.packed_elements.offsets, response.packed_elements.data, "packed_elements of the answer")
    ends = np.cumsum(np.frombuffer(response.list_lengths, dtype=np.dtype("<i4")), dtype=np.int64).tolist()
    if (ends[-1] if ends else 0) != len(elements):
        raise KeyedStateError(
            f"a TaskManager answered {len(elements)} list elements but list lengths summing to {ends[-1] if ends else 0}",
            reason=Reason.INTERNAL,
        )
    return [elements[a:b] for a, b in zip([0, *ends], ends)]


def answered_found(response: Any) -> list[bool]:
    """Whether each key of a ValuesResponse was found, whichever wire version it came in."""
    if response.found_mask:
        found: list[bool] = (np.frombuffer(response.found_mask, dtype=np.uint8) != 0).tolist()
        return found
    return list(response.found)


def job_status_from_proto(value: pb.JobStatus.ValueType) -> JobStatus | None:
    """None for an unspecified status."""
    name = name_of(pb.JobStatus, value)
    return JobStatus(name) if name else None


def checkpoint_status_from_proto(value: jm_pb.CheckpointStatus.ValueType) -> CheckpointStatus | None:
    """None for an unspecified status."""
    name = name_of(jm_pb.CheckpointStatus, value)
    return CheckpointStatus(name) if name else None


def checkpoint_from_proto(message: jm_pb.CheckpointInfo) -> CheckpointSummary:
    return CheckpointSummary(
        checkpoint_id=message.checkpoint_id,
        path=message.path,
        status=checkpoint_status_from_proto(message.status),
        failure_reason=message.failure_reason,
        epoch=message.epoch,
        trigger_timestamp_ms=message.trigger_timestamp_ms,
        duration_ms=message.duration_ms,
        full_size=message.full_size,
        incremental_size=message.incremental_size,
        savepoint=message.savepoint,
    )


def batch_start_from_proto(message: jm_pb.BeginBatchResponse, routing: Routing) -> BatchStart:
    """``routing``: the response's own table, read by the caller."""
    if message.action == jm_pb.BATCH_ACTION_UNSPECIFIED:
        # Every JobManager names one; an answer without is not one the batch can act on.
        raise UnavailableError(f"job {message.routing.job_id!r}: the JobManager answered BeginBatch without an action")
    return BatchStart(
        action=BatchAction(jm_pb.BatchAction.Name(message.action)),
        epoch=message.epoch,
        committed_epoch=message.committed_epoch,
        durable_epoch=message.durable_epoch,
        job_status=job_status_from_proto(message.job_status),
        failure_cause=message.failure_cause,
        routing=routing,
    )


def epoch_committed_from_proto(message: jm_pb.CommitEpochResponse) -> EpochCommitted:
    return EpochCommitted(
        committed_epoch=message.committed_epoch,
        already_committed=message.already_committed,
        checkpoint=checkpoint_from_proto(message.checkpoint) if message.HasField("checkpoint") else None,
        decided=message.decided,
    )


def job_progress_from_proto(message: jm_pb.JobInfo) -> JobProgress:
    return JobProgress(
        job_id=message.job_id,
        status=job_status_from_proto(message.status),
        committed_epoch=message.committed_epoch,
        durable_epoch=message.durable_epoch,
        failure_cause=message.failure_cause,
        restarts=message.restarts,
        routing_version=message.routing_version,
        applied_epoch=message.applied_epoch,
    )
