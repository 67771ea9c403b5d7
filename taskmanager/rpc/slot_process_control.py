"""The wire between a TaskManager and its slot processes: the SlotProcess service and its client.

A slot process serves :class:`SlotProcessServicer` (and TaskExecutor) on a Unix socket that only
its TaskManager uses; the TaskManager reaches both through a :class:`SlotProcessChannel`.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common._proto.v1 import slotprocess_pb2 as sp_pb
from keyedstate.common._proto.v1 import slotprocess_pb2_grpc as sp_grpc
from keyedstate.common._proto.v1 import taskmanager_pb2_grpc as tm_grpc
from keyedstate.common.ids import JobId, SubtaskId
from keyedstate.common.rpc.channels import channel_options
from keyedstate.common.rpc.status import from_rpc_error, rpc_method
from keyedstate.taskmanager.rpc.wire import slot_reports
from keyedstate.taskmanager.slots import SlotTable

_CONTROL_TIMEOUT_S = 10.0

Retain = Callable[[set[SubtaskId], dict[JobId, int]], None]


class SlotProcessServicer(sp_grpc.SlotProcessServicer):
    """The TaskManager's private calls to a slot process: what it hosts, which slots to keep, its metrics."""

    def __init__(self, slots: SlotTable, retain: Retain, exposition: Callable[[], bytes]) -> None:
        self._slots = slots
        self._retain = retain
        self._exposition = exposition

    def add_to(self, server: grpc.Server) -> None:
        """Serve this service on ``server`` (the slot process's Unix socket)."""
        sp_grpc.add_SlotProcessServicer_to_server(self, server)

    @rpc_method
    def Reports(self, request: sp_pb.SlotReportsRequest, context: grpc.ServicerContext) -> sp_pb.SlotReportsResponse:
        """The slots this process hosts, as heartbeats report them."""
        return sp_pb.SlotReportsResponse(slots=slot_reports(self._slots))

    @rpc_method
    def RetainSlots(
        self, request: sp_pb.RetainSlotsRequest, context: grpc.ServicerContext
    ) -> sp_pb.RetainSlotsResponse:
        """Release every slot the JobManager's registration answer does not keep."""
        kept = {SubtaskId(s.job_id, s.operator_id, s.subtask_index) for s in request.kept}
        self._retain(kept, {JobId(job): version for job, version in request.routing_versions.items()})
        return sp_pb.RetainSlotsResponse()

    @rpc_method
    def Metrics(self, request: sp_pb.SlotMetricsRequest, context: grpc.ServicerContext) -> sp_pb.SlotMetricsResponse:
        """This process's metrics in the Prometheus text format (the TaskManager's endpoint merges them)."""
        return sp_pb.SlotMetricsResponse(exposition=self._exposition())


class SlotProcessChannel:
    """The TaskManager's channel to one slot process: its TaskExecutor and its SlotProcess service."""

    def __init__(self, socket_path: str) -> None:
        # A private subchannel pool: a replacement process listens on the same path, and must not
        # inherit the reconnect backoff of the channel to the dead one.
        self._channel = grpc.insecure_channel(
            f"unix:{socket_path}", options=[*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
        )
        self.executor = tm_grpc.TaskExecutorStub(self._channel)
        self._control = sp_grpc.SlotProcessStub(self._channel)

    def reports(self) -> list[jm_pb.SlotReport]:
        """What the process hosts; raises a KeyedStateError when it does not answer."""
        try:
            return list(self._control.Reports(sp_pb.SlotReportsRequest(), timeout=_CONTROL_TIMEOUT_S).slots)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, "asking a slot process for its slots") from exc

    def hosts_job(self, job_id: str) -> bool:
        """Whether the process hosts a slot of ``job_id``."""
        return any(s.job_id == job_id for s in self.reports())

    def retain(self, kept: set[SubtaskId], routing_versions: dict[JobId, int]) -> None:
        """Release every slot not in ``kept``; the versions are the floors for later deploys."""
        request = sp_pb.RetainSlotsRequest(
            kept=[
                jm_pb.SlotReport(job_id=s.job_id, operator_id=s.operator_id, subtask_index=s.subtask_index)
                for s in kept
            ],
            routing_versions={str(job): version for job, version in routing_versions.items()},
        )
        try:
            self._control.RetainSlots(request, timeout=_CONTROL_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, "a slot process releasing the slots it may not keep") from exc

    def metrics(self) -> bytes:
        """The process's metrics (Prometheus text format); raises a KeyedStateError when it does not answer."""
        try:
            return self._control.Metrics(sp_pb.SlotMetricsRequest(), timeout=_CONTROL_TIMEOUT_S).exposition
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, "asking a slot process for its metrics") from exc

    def close(self) -> None:
        self._channel.close()


__all__ = ["SlotProcessChannel", "SlotProcessServicer"]
