"""The TaskExecutor service of a TaskManager with slot processes: each call forwarded where the slots are.

The JobManager speaks to one TaskManager (one internal address, one lease, one registration);
with ``taskmanager.slot-processes`` > 1 the slots live in the slot processes, so this servicer
sends each call on: a deploy to the process of its slot index, a release, a barrier or a
checkpoint notification to every process, an epoch commit to the processes that host a slot of
the job (every one of them prepares before any applies, so a refusal applies nothing here, as
with one process). Errors come back with their status code and reason unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

import grpc

from keyedstate.common._proto.v1 import taskmanager_pb2 as pb
from keyedstate.common._proto.v1 import taskmanager_pb2_grpc as pb_grpc
from keyedstate.common.errors import NotFoundError, Reason
from keyedstate.common.ids import validate_id
from keyedstate.common.lease import Lease
from keyedstate.common.rpc.status import from_rpc_error, rpc_method
from keyedstate.taskmanager.rpc.slot_process_control import SlotProcessChannel

R = TypeVar("R")
_REPLACE_WAIT_S = 60.0
"""How long a deploy waits at most for its slot process to be replaced (a start takes a few seconds)."""


class SlotProcesses(Protocol):
    """The TaskManager's slot processes, as the forwarder needs them (a ``SlotProcessGroup``)."""

    def index_of(self, slot_index: int) -> int: ...

    def channel(self, index: int, wait_s: float = 0.0) -> SlotProcessChannel: ...

    def channels(self) -> list[SlotProcessChannel]: ...

    def each(self, call: Callable[[SlotProcessChannel], R], channels: Iterable[SlotProcessChannel]) -> list[R]: ...


def _timeout(context: grpc.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return remaining if remaining is not None and remaining < 1e9 else None


class ForwardingTaskExecutorServicer(pb_grpc.TaskExecutorServicer):
    """The JobManager's control calls, sent on to the slot processes over their Unix sockets."""

    def __init__(self, group: SlotProcesses, lease: Lease) -> None:
        self._group = group
        self._lease = lease

    def add_to(self, server: grpc.Server) -> None:
        """Serve this service on ``server`` (the internal plane's)."""
        pb_grpc.add_TaskExecutorServicer_to_server(self, server)

    @rpc_method
    def DeploySlot(self, request: pb.DeploySlotRequest, context: grpc.ServicerContext) -> pb.DeploySlotResponse:
        """Deploy into the slot process that owns ``slot_index``."""
        timeout = _timeout(context)
        # While its slot process is replaced, a deploy waits for the new one (as long as the call may).
        wait_s = _REPLACE_WAIT_S if timeout is None else min(timeout, _REPLACE_WAIT_S)
        process = self._group.channel(self._group.index_of(request.slot_index), wait_s)
        try:
            response: pb.DeploySlotResponse = process.executor.DeploySlot(request, timeout=_timeout(context))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc
        return response

    @rpc_method
    def ReleaseSlot(self, request: pb.ReleaseSlotRequest, context: grpc.ServicerContext) -> pb.ReleaseSlotResponse:
        """Release the subtask in whichever slot process hosts it."""
        timeout = _timeout(context)
        self._all(lambda p: self._call(lambda: p.executor.ReleaseSlot(request, timeout=timeout)))
        return pb.ReleaseSlotResponse()

    @rpc_method
    def TriggerCheckpoint(self, request: pb.CheckpointBarrier, context: grpc.ServicerContext) -> pb.TriggerResponse:
        """The barrier to every slot process; answers how many slots took it."""
        self._lease.check(f"the barrier of checkpoint {request.checkpoint_id}")
        timeout = _timeout(context)
        answers = self._all(lambda p: self._call(lambda: p.executor.TriggerCheckpoint(request, timeout=timeout)))
        return pb.TriggerResponse(slots=sum(a.slots for a in answers))

    @rpc_method
    def NotifyCheckpoint(
        self, request: pb.CheckpointNotification, context: grpc.ServicerContext
    ) -> pb.NotificationResponse:
        """A checkpoint completed or was aborted: every slot process keeps or deletes its files."""
        timeout = _timeout(context)
        self._all(lambda p: self._call(lambda: p.executor.NotifyCheckpoint(request, timeout=timeout)))
        return pb.NotificationResponse()

    @rpc_method
    def CommitEpoch(self, request: pb.EpochCommitRequest, context: grpc.ServicerContext) -> pb.EpochCommitResponse:
        """Prepare, commit or abort an epoch in every slot process hosting a slot of the job."""
        self._lease.check(f"the commit of epoch {request.epoch}")
        timeout = _timeout(context)
        hosts = self._hosts_of(request.job_id)
        if not request.prepare and not request.abort:
            # Every process checks before any applies: a refusal anywhere applies nothing here.
            prepare = pb.EpochCommitRequest()
            prepare.CopyFrom(request)
            prepare.prepare = True
            self._group.each(lambda p: self._call(lambda: p.executor.CommitEpoch(prepare, timeout=timeout)), hosts)
        answers = self._group.each(
            lambda p: self._call(lambda: p.executor.CommitEpoch(request, timeout=timeout)), hosts
        )
        if request.prepare:
            return pb.EpochCommitResponse(
                committed_epoch=request.epoch - 1, change_sets=[f for a in answers for f in a.change_sets]
            )
        return pb.EpochCommitResponse(
            committed_epoch=min(a.committed_epoch for a in answers),
            applied_entries=sum(a.applied_entries for a in answers),
        )

    def _all(self, call: Callable[[SlotProcessChannel], R]) -> list[R]:
        return self._group.each(call, self._group.channels())

    def _hosts_of(self, job_id: str) -> list[SlotProcessChannel]:
        """The slot processes hosting a slot of ``job_id`` (NotFoundError when none does, as with one process)."""
        validate_id("job id", job_id)
        processes = self._group.channels()
        hosting = self._group.each(lambda p: p.hosts_job(job_id), processes)
        found = [p for p, hosts in zip(processes, hosting) if hosts]
        if not found:
            raise NotFoundError(
                f"this TaskManager hosts no slot of job {job_id!r}; send the commit to the TaskManagers of the job's "
                "current routing table",
                reason=Reason.UNKNOWN_JOB,
            )
        return found

    @staticmethod
    def _call(call: Callable[[], R]) -> R:
        try:
            return call()
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc
