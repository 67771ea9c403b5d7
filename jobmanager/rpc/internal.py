"""The JobManager's internal-plane services: only TaskManagers call them.

ResourceManager (registration, heartbeats, a running subtask's failure) and CheckpointCoordinatorGateway (checkpoint
acknowledgements), named after Flink's gateways. They run on the internal server, which with
security.ssl.internal.enabled requires a certificate of the cluster's CA.
"""

from __future__ import annotations

import grpc

from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common._proto.v1 import jobmanager_pb2_grpc as jm_grpc
from keyedstate.common.ids import CheckpointId, JobId, SubtaskId, TaskManagerId
from keyedstate.common.rpc.convert import handle_from_proto
from keyedstate.common.rpc.status import rpc_method
from keyedstate.jobmanager.checkpointing import Checkpointing
from keyedstate.jobmanager.dispatcher import Dispatcher
from keyedstate.jobmanager.rpc.checkpoint_wire import ack_response, decline_from_proto
from keyedstate.jobmanager.rpc.job_wire import heartbeat_from_proto, kept_slots_to_proto, registration_from_proto


class ResourceManagerServicer(jm_grpc.ResourceManagerServicer):
    def __init__(self, dispatcher: Dispatcher) -> None:
        self._d = dispatcher

    @rpc_method
    def RegisterTaskManager(
        self, request: jm_pb.RegisterTaskManagerRequest, context: grpc.ServicerContext
    ) -> jm_pb.RegisterTaskManagerResponse:
        """Register (or re-register) a TaskManager; answers heartbeat settings, its lease and the slots it keeps."""
        registration = registration_from_proto(request)
        admission = self._d.register_taskmanager(registration)
        s = self._d.settings
        return jm_pb.RegisterTaskManagerResponse(
            heartbeat_interval_ms=s.heartbeat_interval_ms,
            heartbeat_timeout_ms=s.heartbeat_timeout_ms,
            jobmanager_session=self._d.registry.session,
            lease_duration_ms=s.lease_duration_ms,
            kept_slots=kept_slots_to_proto(admission.kept, registration.slots),
            routing_versions={str(job_id): v for job_id, v in admission.routing_versions.items()},
        )

    @rpc_method
    def Heartbeat(self, request: jm_pb.HeartbeatRequest, context: grpc.ServicerContext) -> jm_pb.HeartbeatResponse:
        """Renew a TaskManager's lease; ``known=false`` tells it to register again."""
        return jm_pb.HeartbeatResponse(known=self._d.heartbeat(heartbeat_from_proto(request)))

    @rpc_method
    def DeregisterTaskManager(
        self, request: jm_pb.DeregisterTaskManagerRequest, context: grpc.ServicerContext
    ) -> jm_pb.DeregisterTaskManagerResponse:
        """Forget a TaskManager that shut its slots down (it counts as fenced at once)."""
        self._d.registry.deregister(TaskManagerId(request.taskmanager_id))
        return jm_pb.DeregisterTaskManagerResponse()

    @rpc_method
    def ReportTaskFailure(
        self, request: jm_pb.ReportTaskFailureRequest, context: grpc.ServicerContext
    ) -> jm_pb.ReportTaskFailureResponse:
        """A subtask failed on its TaskManager (materializations failed past the limit): its job fails over."""
        self._d.task_failed(
            JobId(request.job_id),
            SubtaskId(request.job_id, request.operator_id, request.subtask_index),
            TaskManagerId(request.taskmanager_id),
            request.routing_version,
            request.cause,
        )
        return jm_pb.ReportTaskFailureResponse()


class CheckpointCoordinatorGatewayServicer(jm_grpc.CheckpointCoordinatorGatewayServicer):
    """TaskManagers' acknowledgements and declines, handed to the job's checkpoint coordinator."""

    def __init__(self, dispatcher: Dispatcher, checkpointing: Checkpointing) -> None:
        self._d = dispatcher
        self._checkpointing = checkpointing

    @rpc_method
    def AcknowledgeCheckpoint(
        self, request: jm_pb.AcknowledgeCheckpointRequest, context: grpc.ServicerContext
    ) -> jm_pb.AckResponse:
        """Take a subtask's snapshot handle for a pending checkpoint."""
        job = self._d.job(JobId(request.job_id))
        outcome = self._checkpointing.acknowledge(
            job, CheckpointId(request.checkpoint_id), handle_from_proto(request.state)
        )
        return ack_response(outcome)

    @rpc_method
    def DeclineCheckpoint(
        self, request: jm_pb.DeclineCheckpointRequest, context: grpc.ServicerContext
    ) -> jm_pb.AckResponse:
        """Take a subtask's refusal of a pending checkpoint (the checkpoint is aborted)."""
        outcome = self._checkpointing.decline(self._d.job(JobId(request.job_id)), decline_from_proto(request))
        return ack_response(outcome)
