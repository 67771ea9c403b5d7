"""Protobuf <-> domain conversions of the JobManager's job, cluster and epoch calls (the RPC edge).

The Dispatcher, the registry and the epoch coordinator take and return domain values (routing
tables, job infos, registrations, heartbeats, batch starts); the servicers translate with these
functions, so the messages' field names are known here and nowhere below.
"""

from __future__ import annotations

from collections.abc import Iterable

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.claim_mode import RecoveryClaimMode
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.ids import SubtaskId, TaskManagerId
from keyedstate.common.lifecycle import JobStatus
from keyedstate.common.rpc.descriptors import operator_spec_to_proto
from keyedstate.common.rpc.enums import name_of, value_of
from keyedstate.jobmanager.dispatcher import ClusterOverview, TaskManagerSummary
from keyedstate.jobmanager.epochs.coordinator import BatchStart
from keyedstate.jobmanager.jobs import JobInfo, RoutingTable
from keyedstate.jobmanager.registry import (
    HeartbeatReport,
    ReportedLimits,
    SlotProcessReport,
    SlotReport,
    TaskManagerRegistration,
)


def job_status_to_proto(status: JobStatus) -> pb.JobStatus.ValueType:
    """The wire's JobStatus enum value of a domain status."""
    return value_of(pb.JobStatus, status.value)


def claim_mode_from_proto(value: int) -> RecoveryClaimMode | None:
    """A request's claim mode; None when unspecified (the job's configured one applies)."""
    if value == 0:
        return None
    try:
        return RecoveryClaimMode(name_of(jm_pb.RecoveryClaimMode, value))
    except ValueError:
        raise InvalidArgumentError(
            f"claim_mode {value} is not a RecoveryClaimMode; send CLAIM, NO_CLAIM or leave it unset (the job's "
            "execution.state-recovery.claim-mode)"
        ) from None


def limits_to_proto(limits: ReportedLimits) -> pb.StateLimits:
    """The limits as routing tables carry them (0: not reported)."""
    return pb.StateLimits(
        max_key_bytes=limits.max_key_bytes,
        max_value_bytes=limits.max_value_bytes,
        max_list_elements=limits.max_list_elements,
    )


def limits_from_proto(message: pb.StateLimits) -> ReportedLimits:
    """What a registering TaskManager reports it enforces."""
    return ReportedLimits(
        max_key_bytes=message.max_key_bytes,
        max_value_bytes=message.max_value_bytes,
        max_list_elements=message.max_list_elements,
    )


def routing_to_proto(table: RoutingTable) -> pb.RoutingTable:
    """The routing table clients route by (limits always present: all zeros when no TaskManager reported any)."""
    return pb.RoutingTable(
        job_id=table.job_id,
        version=table.version,
        max_parallelism=table.max_parallelism,
        routes=[
            pb.Route(
                operator_id=a.subtask.operator_id,
                subtask_index=a.subtask.subtask_index,
                key_groups=pb.KeyGroupRange(start=a.key_groups.start, end=a.key_groups.end),
                taskmanager_id=a.taskmanager_id,
                address=a.slot_address or a.address,
                slot_index=a.slot_index,
            )
            for a in table.routes
        ],
        job_status=job_status_to_proto(table.job_status),
        limits=limits_to_proto(table.limits),
    )


def job_info_to_proto(info: JobInfo) -> jm_pb.JobInfo:
    """The GetJob / CancelJob answer (and each job of the cluster overview)."""
    return jm_pb.JobInfo(
        job_id=info.job_id,
        status=job_status_to_proto(info.status),
        max_parallelism=info.max_parallelism,
        operators=[operator_spec_to_proto(o) for o in info.operators],
        latest_checkpoint_id=info.latest_checkpoint_id,
        latest_checkpoint_path=info.latest_checkpoint_path,
        committed_epoch=info.committed_epoch,
        failure_cause=info.failure_cause,
        restarts=info.restarts,
        routing_version=info.routing_version,
        durable_epoch=info.durable_epoch,
        applied_epoch=info.applied_epoch,
        lineage=[
            pb.LineageEntry(query_id=e.query_id, offset=e.offset, first_epoch=e.first_epoch) for e in info.lineage
        ],
    )


def _slot_to_proto(slot_index: int, subtask: SubtaskId | None) -> jm_pb.SlotReport:
    if subtask is None:
        return jm_pb.SlotReport(slot_index=slot_index)
    return jm_pb.SlotReport(
        slot_index=slot_index,
        job_id=subtask.job_id,
        operator_id=subtask.operator_id,
        subtask_index=subtask.subtask_index,
    )


def _taskmanager_to_proto(tm: TaskManagerSummary) -> jm_pb.TaskManagerInfo:
    return jm_pb.TaskManagerInfo(
        taskmanager_id=tm.taskmanager_id,
        address=tm.address,
        num_slots=tm.num_slots,
        free_slots=tm.free_slots,
        status=value_of(jm_pb.TaskManagerStatus, tm.status.value),
        last_heartbeat_age_ms=tm.last_heartbeat_age_ms,
        slots=[_slot_to_proto(i, s) for i, s in enumerate(tm.occupancy)],
        metrics_port=tm.metrics_port,
        slot_processes=[jm_pb.SlotProcessInfo(index=p.index, address=p.address, pid=p.pid) for p in tm.slot_processes],
    )


def overview_to_proto(overview: ClusterOverview) -> jm_pb.ClusterOverview:
    """The GetClusterOverview answer: every slot of every TaskManager, free ones with only their index."""
    return jm_pb.ClusterOverview(
        taskmanagers=[_taskmanager_to_proto(tm) for tm in overview.taskmanagers],
        jobs=[job_info_to_proto(j) for j in overview.jobs],
        total_slots=overview.total_slots,
        free_slots=overview.free_slots,
    )


def slot_reports_from_proto(slots: Iterable[jm_pb.SlotReport]) -> tuple[SlotReport, ...]:
    """Every reported slot, in order; one without a job id is free."""
    return tuple(
        SlotReport(s.slot_index, SubtaskId(s.job_id, s.operator_id, s.subtask_index) if s.job_id else None)
        for s in slots
    )


def kept_slots_to_proto(kept: Iterable[SubtaskId], slots: Iterable[SlotReport]) -> list[jm_pb.SlotReport]:
    """The slots a registering TaskManager keeps, with the slot index it reported for each."""
    index = {s.subtask: s.slot_index for s in slots if s.subtask is not None}
    return [_slot_to_proto(index[k], k) for k in kept]


def registration_from_proto(request: jm_pb.RegisterTaskManagerRequest) -> TaskManagerRegistration:
    """A registration; ``limits`` None when the TaskManager sent none (an absent field, not zeros)."""
    return TaskManagerRegistration(
        taskmanager_id=TaskManagerId(request.taskmanager_id),
        address=request.address,
        host=request.host,
        num_slots=request.num_slots,
        backend=request.backend,
        metrics_port=request.metrics_port,
        limits=limits_from_proto(request.limits) if request.HasField("limits") else None,
        internal_address=request.internal_address,
        cluster_id=request.cluster_id,
        slots=slot_reports_from_proto(request.slots),
        slot_addresses=tuple(request.slot_addresses),
        slot_processes=tuple(SlotProcessReport(p.index, p.address, p.pid) for p in request.slot_processes),
    )


def heartbeat_from_proto(request: jm_pb.HeartbeatRequest) -> HeartbeatReport:
    """A heartbeat with every slot it reports, free ones included (their indexes are checked too)."""
    return HeartbeatReport(
        taskmanager_id=TaskManagerId(request.taskmanager_id),
        jobmanager_session=request.jobmanager_session,
        slots=slot_reports_from_proto(request.slots),
    )


def batch_start_to_proto(start: BatchStart) -> jm_pb.BeginBatchResponse:
    """The BeginBatch answer."""
    return jm_pb.BeginBatchResponse(
        action=jm_pb.BatchAction.Value(start.action.value),
        epoch=start.epoch,
        committed_epoch=start.committed_epoch,
        durable_epoch=start.durable_epoch,
        job_status=job_status_to_proto(start.job_status),
        failure_cause=start.failure_cause,
        routing=routing_to_proto(start.routing),
    )
