"""The JobManager's client-plane service (jobs, routing, checkpoints, epochs), translated onto the Dispatcher."""

from __future__ import annotations

import grpc

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common._proto.v1 import jobmanager_pb2_grpc as jm_grpc
from keyedstate.common.config import is_secret_key
from keyedstate.common.config import options as o
from keyedstate.common.config._secrets import declared_secret_keys
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.ids import JobId
from keyedstate.common.rpc.convert import winners_from_proto
from keyedstate.common.rpc.descriptors import operator_spec_from_proto
from keyedstate.common.rpc.status import rpc_method
from keyedstate.jobmanager.checkpointing import Checkpointing
from keyedstate.jobmanager.dispatcher import Dispatcher
from keyedstate.jobmanager.epochs.coordinator import EpochCommit, EpochCoordinator
from keyedstate.jobmanager.jobs import JobSpec
from keyedstate.jobmanager.rpc.checkpoint_wire import (
    checkpoint_info,
    list_checkpoints_response,
    summary_to_proto,
    trigger_from_proto,
)
from keyedstate.jobmanager.rpc.job_wire import (
    batch_start_to_proto,
    claim_mode_from_proto,
    job_info_to_proto,
    overview_to_proto,
    routing_to_proto,
)

MAX_WAIT_MS = 86_400_000
"""The longest wait a call may ask for (a day): waits use the OS clock, which overflows far below int64."""


def _check_timeout_ms(method: str, timeout_ms: int) -> None:
    if not 0 <= timeout_ms <= MAX_WAIT_MS:
        raise InvalidArgumentError(
            f"{method}: timeout_ms must be between 0 (the server's default) and {MAX_WAIT_MS} (a day), got {timeout_ms}"
        )


class JobManagerServicer(jm_grpc.JobManagerServicer):
    """Clients' and statectl's calls, translated onto the Dispatcher, Checkpointing and the EpochCoordinator."""

    def __init__(self, dispatcher: Dispatcher, checkpointing: Checkpointing, epochs: EpochCoordinator) -> None:
        self._d = dispatcher
        self._checkpointing = checkpointing
        self._epochs = epochs

    # -- jobs --------------------------------------------------------------------------------
    @rpc_method
    def SubmitJob(self, request: jm_pb.SubmitJobRequest, context: grpc.ServicerContext) -> pb.RoutingTable:
        """Submit a job (optionally restoring from a checkpoint or savepoint); rejects a config carrying secrets."""
        secrets = sorted(k for k in request.config if is_secret_key(k, declared_secret_keys()))
        if secrets:
            # A job's config is stored with the job (high-availability job records) and shown by
            # job tools; a credential must stay in the daemons' own configuration.
            raise InvalidArgumentError(
                f"job {request.job_id!r}: the job config must not carry secrets ({', '.join(secrets)}); set them in the "
                "JobManager's and TaskManagers' config files (chmod 600) or their environment (AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY for S3)"
            )
        spec = JobSpec(
            job_id=JobId(request.job_id),
            operators=tuple(operator_spec_from_proto(op) for op in request.operators),
            max_parallelism=request.max_parallelism or self._d.conf.get(o.MAX_PARALLELISM),
            config=tuple(sorted(request.config.items())),
        )
        return routing_to_proto(self._d.submit(spec, request.restore_path))

    @rpc_method
    def CancelJob(self, request: jm_pb.JobRequest, context: grpc.ServicerContext) -> jm_pb.JobInfo:
        """Cancel a job: release its slots and discard their local state."""
        return job_info_to_proto(self._d.cancel(JobId(request.job_id)))

    @rpc_method
    def GetJob(self, request: jm_pb.JobRequest, context: grpc.ServicerContext) -> jm_pb.JobInfo:
        """Describe a job: status, operators, latest checkpoint, epochs and lineage."""
        return job_info_to_proto(self._d.job(JobId(request.job_id)).info())

    @rpc_method
    def GetRouting(self, request: jm_pb.GetRoutingRequest, context: grpc.ServicerContext) -> pb.RoutingTable:
        """Answer the job's current routing table (which TaskManager serves which key groups)."""
        return routing_to_proto(self._d.routing(JobId(request.job_id)))

    @rpc_method
    def GetClusterOverview(
        self, request: jm_pb.ClusterOverviewRequest, context: grpc.ServicerContext
    ) -> jm_pb.ClusterOverview:
        """Describe the registered TaskManagers and what runs in their slots."""
        return overview_to_proto(self._d.overview())

    @rpc_method
    def RescaleJob(self, request: jm_pb.RescaleJobRequest, context: grpc.ServicerContext) -> pb.RoutingTable:
        """Change operators' parallelism, redistributing key groups from a checkpoint."""
        if not request.parallelism:
            raise InvalidArgumentError("RescaleJob needs the new parallelism (operator -> parallelism, or '' for all)")
        return routing_to_proto(self._d.rescale(JobId(request.job_id), dict(request.parallelism)))

    @rpc_method
    def RestoreJob(self, request: jm_pb.RestoreJobRequest, context: grpc.ServicerContext) -> pb.RoutingTable:
        """Redeploy a job in place from a checkpoint or savepoint path."""
        mode = claim_mode_from_proto(request.claim_mode)
        return routing_to_proto(self._d.restore(JobId(request.job_id), request.restore_path, mode))

    # -- checkpoints -------------------------------------------------------------------------
    @rpc_method
    def TriggerCheckpoint(
        self, request: jm_pb.TriggerCheckpointRequest, context: grpc.ServicerContext
    ) -> jm_pb.CheckpointInfo:
        """Trigger a checkpoint or savepoint of the job, optionally waiting for it to complete."""
        _check_timeout_ms("TriggerCheckpoint", request.timeout_ms)
        summary = self._checkpointing.trigger_request(self._d.job(JobId(request.job_id)), trigger_from_proto(request))
        return summary_to_proto(summary)

    @rpc_method
    def ListCheckpoints(
        self, request: jm_pb.JobRequest, context: grpc.ServicerContext
    ) -> jm_pb.ListCheckpointsResponse:
        """List the job's recent checkpoints and their statistics."""
        return list_checkpoints_response(self._checkpointing.list_checkpoints(self._d.job(JobId(request.job_id))))

    # -- epochs ------------------------------------------------------------------------------
    @rpc_method
    def BeginBatch(self, request: jm_pb.BeginBatchRequest, context: grpc.ServicerContext) -> jm_pb.BeginBatchResponse:
        """Tell whether a Spark batch must run, be skipped (already committed) or wait, and under which epoch."""
        return batch_start_to_proto(self._epochs.begin_batch(JobId(request.job_id), request.query_id, request.batch_id))

    @rpc_method
    def CommitEpoch(
        self, request: jm_pb.CommitEpochRequest, context: grpc.ServicerContext
    ) -> jm_pb.CommitEpochResponse:
        """Commit an epoch's winning attempts on every slot, optionally with a checkpoint after it."""
        _check_timeout_ms("CommitEpoch", request.timeout_ms)
        # Validated here, before anything is applied: a malformed winner is the caller's INVALID_ARGUMENT.
        winners = list(winners_from_proto(request.winners).values())
        outcome = self._epochs.commit(
            EpochCommit(
                job_id=JobId(request.job_id),
                epoch=request.epoch,
                query_id=request.query_id,
                batch_id=request.batch_id,
                winners=winners,
                routing_version=request.expected_routing_version,
                checkpoint=request.checkpoint,
                wait_for_checkpoint=request.wait_for_checkpoint,
                timeout_ms=request.timeout_ms,
            )
        )
        response = jm_pb.CommitEpochResponse(
            committed_epoch=outcome.committed_epoch,
            already_committed=outcome.already_committed,
            decided=outcome.decided,
        )
        if outcome.checkpoint is not None:
            response.checkpoint.CopyFrom(checkpoint_info(outcome.checkpoint))
        return response
