"""The TaskExecutor service: the JobManager's control calls, translated onto domain objects."""

from __future__ import annotations

import grpc

from keyedstate.common._proto.v1 import taskmanager_pb2 as pb
from keyedstate.common._proto.v1 import taskmanager_pb2_grpc as pb_grpc
from keyedstate.common.descriptors import OperatorSpec
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.ids import KeyGroupRange, SubtaskId
from keyedstate.common.lease import Lease
from keyedstate.common.rpc.status import rpc_method
from keyedstate.taskmanager.deployment import DeployRequest, SlotDeployer


class TaskExecutorServicer(pb_grpc.TaskExecutorServicer):
    def __init__(
        self, deployer: SlotDeployer, lease: Lease, checkpoints: object | None = None, epochs: object | None = None
    ) -> None:
        self._deployer = deployer
        self._lease = lease
        self._checkpoints = checkpoints
        self._epochs = epochs

    @rpc_method
    def DeploySlot(self, request: pb.DeploySlotRequest, context: grpc.ServicerContext) -> pb.DeploySlotResponse:
        if not request.HasField("operator"):
            raise InvalidArgumentError("DeploySlot needs the operator spec")
        deploy = DeployRequest(
            subtask=SubtaskId(request.job_id, request.operator.operator_id, request.subtask_index),
            operator=OperatorSpec.from_proto(request.operator),
            key_groups=KeyGroupRange(request.key_groups.start, request.key_groups.end),
            max_parallelism=request.max_parallelism,
            slot_index=request.slot_index,
            routing_version=request.routing_version,
            checkpoint_base=request.checkpoint_base,
            incremental=request.incremental,
        )
        result = self._deployer.deploy(deploy, request.restore if request.HasField("restore") else None)
        return pb.DeploySlotResponse(
            restore_duration_ms=result.restore_duration_ms,
            restored_bytes=result.restored_bytes,
            downloaded_bytes=result.downloaded_bytes,
            committed_epoch=result.committed_epoch,
        )

    @rpc_method
    def ReleaseSlot(self, request: pb.ReleaseSlotRequest, context: grpc.ServicerContext) -> pb.ReleaseSlotResponse:
        self._deployer.release(
            SubtaskId(request.job_id, request.operator_id, request.subtask_index),
            request.discard_local_state,
            up_to_version=request.routing_version or None,
        )
        return pb.ReleaseSlotResponse()

    @rpc_method
    def TriggerCheckpoint(self, request: pb.CheckpointBarrier, context: grpc.ServicerContext) -> pb.TriggerResponse:
        if self._checkpoints is None:
            raise InvalidArgumentError("checkpointing is not configured on this TaskManager")
        self._lease.check(f"the barrier of checkpoint {request.checkpoint_id}")
        return pb.TriggerResponse(slots=self._checkpoints.trigger(request))  # type: ignore[attr-defined]

    @rpc_method
    def NotifyCheckpoint(
        self, request: pb.CheckpointNotification, context: grpc.ServicerContext
    ) -> pb.NotificationResponse:
        if self._checkpoints is not None:
            self._checkpoints.notify(request.job_id, request.checkpoint_id, request.completed)  # type: ignore[attr-defined]
        return pb.NotificationResponse()

    @rpc_method
    def CommitEpoch(self, request: pb.EpochCommitRequest, context: grpc.ServicerContext) -> pb.EpochCommitResponse:
        if self._epochs is None:
            raise InvalidArgumentError("epoch transactions are not available on this TaskManager")
        self._lease.check(f"the commit of epoch {request.epoch}")
        return self._epochs.commit(request)  # type: ignore[attr-defined]
