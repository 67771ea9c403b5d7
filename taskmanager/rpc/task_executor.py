"""The TaskExecutor service: the JobManager's control calls, translated onto domain objects."""

from __future__ import annotations

import grpc

from keyedstate.common._proto.v1 import taskmanager_pb2 as pb
from keyedstate.common._proto.v1 import taskmanager_pb2_grpc as pb_grpc
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.ids import CheckpointId, JobId, KeyGroupRange, SubtaskId
from keyedstate.common.lease import Lease
from keyedstate.common.rpc.convert import (
    barrier_from_proto,
    change_set_from_proto,
    change_set_to_proto,
    restore_from_proto,
    winners_from_proto,
)
from keyedstate.common.rpc.descriptors import operator_spec_from_proto
from keyedstate.common.rpc.status import rpc_method
from keyedstate.taskmanager.deployment import DeployRequest, SlotDeployer
from keyedstate.taskmanager.epochs import EpochManager
from keyedstate.taskmanager.snapshot.manager import SnapshotManager


def commit_epoch(epochs: EpochManager, request: pb.EpochCommitRequest) -> pb.EpochCommitResponse:
    """The ``CommitEpoch`` RPC: prepare, commit or (with ``abort``) discard an epoch on every slot of the job."""
    winners = winners_from_proto(request.winners)
    job_id = JobId(request.job_id)
    if request.prepare:
        written = epochs.prepare_epoch(
            job_id, request.epoch, winners, request.routing_version, upload_change_set=request.upload_change_set
        )
        return pb.EpochCommitResponse(
            committed_epoch=request.epoch - 1, change_sets=[change_set_to_proto(f) for f in written]
        )
    result = epochs.commit_epoch(
        job_id, request.epoch, winners, abort=request.abort, routing_version=request.routing_version
    )
    return pb.EpochCommitResponse(committed_epoch=result.committed_epoch, applied_entries=result.applied)


class TaskExecutorServicer(pb_grpc.TaskExecutorServicer):
    """The calls only the JobManager makes: deploy and release slots, checkpoints, epoch commits."""

    def __init__(
        self, deployer: SlotDeployer, lease: Lease, checkpoints: SnapshotManager, epochs: EpochManager
    ) -> None:
        self._deployer = deployer
        self._lease = lease
        self._checkpoints = checkpoints
        self._epochs = epochs

    def add_to(self, server: grpc.Server) -> None:
        """Serve this service on ``server`` (the internal plane's)."""
        pb_grpc.add_TaskExecutorServicer_to_server(self, server)

    @rpc_method
    def DeploySlot(self, request: pb.DeploySlotRequest, context: grpc.ServicerContext) -> pb.DeploySlotResponse:
        """Deploy a subtask into a slot, empty or restored; answers once the slot serves."""
        if not request.HasField("operator"):
            raise InvalidArgumentError("DeploySlot needs the operator spec")
        deploy = DeployRequest(
            subtask=SubtaskId(request.job_id, request.operator.operator_id, request.subtask_index),
            operator=operator_spec_from_proto(request.operator),
            key_groups=KeyGroupRange(request.key_groups.start, request.key_groups.end),
            max_parallelism=request.max_parallelism,
            slot_index=request.slot_index,
            routing_version=request.routing_version,
            checkpoint_base=request.checkpoint_base,
            incremental=request.incremental,
            changelog_materialize_interval_ms=request.changelog.materialize_interval_ms
            if request.changelog.enabled
            else None,
            # Absent (a JobManager that predates the key): Flink's default.
            changelog_max_failures_allowed=request.changelog.max_failures_allowed
            if request.changelog.HasField("max_failures_allowed")
            else 3,
            replay=tuple(change_set_from_proto(f) for f in request.replay),
        )
        restore = restore_from_proto(request.restore) if request.HasField("restore") else None
        result = self._deployer.deploy(deploy, restore)
        return pb.DeploySlotResponse(
            restore_duration_ms=result.restore_duration_ms,
            restored_bytes=result.restored_bytes,
            downloaded_bytes=result.downloaded_bytes,
            committed_epoch=result.committed_epoch,
        )

    @rpc_method
    def ReleaseSlot(self, request: pb.ReleaseSlotRequest, context: grpc.ServicerContext) -> pb.ReleaseSlotResponse:
        """Release a subtask's slot (only a deployment up to the routing version given, when one is)."""
        self._deployer.release(
            SubtaskId(request.job_id, request.operator_id, request.subtask_index),
            request.discard_local_state,
            up_to_version=request.routing_version or None,
        )
        return pb.ReleaseSlotResponse()

    @rpc_method
    def TriggerCheckpoint(self, request: pb.CheckpointBarrier, context: grpc.ServicerContext) -> pb.TriggerResponse:
        """Take the barrier on every slot of the job; answers how many slots took it (uploads go on after)."""
        self._lease.check(f"the barrier of checkpoint {request.checkpoint_id}")
        return pb.TriggerResponse(slots=self._checkpoints.trigger(barrier_from_proto(request)))

    @rpc_method
    def NotifyCheckpoint(
        self, request: pb.CheckpointNotification, context: grpc.ServicerContext
    ) -> pb.NotificationResponse:
        """A checkpoint completed (keep its files for the next one) or was aborted (delete them)."""
        self._checkpoints.notify(JobId(request.job_id), CheckpointId(request.checkpoint_id), request.completed)
        return pb.NotificationResponse()

    @rpc_method
    def CommitEpoch(self, request: pb.EpochCommitRequest, context: grpc.ServicerContext) -> pb.EpochCommitResponse:
        """Prepare, commit or abort an epoch on every slot of the job here (see :func:`commit_epoch`)."""
        self._lease.check(f"the commit of epoch {request.epoch}")
        return commit_epoch(self._epochs, request)


__all__ = ["TaskExecutorServicer", "commit_epoch"]
