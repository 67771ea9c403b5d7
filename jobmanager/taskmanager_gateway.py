"""Calls from the JobManager to TaskManagers (deploy, release, barriers, notifications, epochs).

These go to the TaskManagers' internal plane (TaskExecutor): the internal address each
TaskManager reported at registration, over mutual TLS when security.ssl.internal.enabled. The
rest of the JobManager names a TaskManager by its client address (the one in routing tables);
:meth:`TaskManagerGateways.route` maps it to the internal one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc

from keyedstate.common._proto.v1 import common_pb2 as common_pb
from keyedstate.common._proto.v1 import taskmanager_pb2 as pb
from keyedstate.common._proto.v1 import taskmanager_pb2_grpc as pb_grpc
from keyedstate.common.batches import Winner
from keyedstate.common.changesets import ChangeSetFile
from keyedstate.common.descriptors import OperatorSpec
from keyedstate.common.handles import CheckpointBarrier, SlotRestore
from keyedstate.common.ids import CheckpointId, JobId, KeyGroupRange, SubtaskId
from keyedstate.common.rpc.channels import open_channel
from keyedstate.common.rpc.convert import (
    barrier_to_proto,
    change_set_from_proto,
    change_set_to_proto,
    restore_to_proto,
    winner_to_proto,
)
from keyedstate.common.rpc.descriptors import operator_spec_to_proto
from keyedstate.common.rpc.status import from_rpc_error
from keyedstate.common.security.tls import INTERNAL, ChannelSecurity

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlotDeployment:
    """One subtask to deploy into one slot of a TaskManager (the DeploySlot call)."""

    job_id: JobId
    operator: OperatorSpec
    subtask_index: int
    key_groups: KeyGroupRange
    max_parallelism: int
    slot_index: int
    routing_version: int
    checkpoint_base: str
    """The job's checkpoint storage (state.checkpoints.dir/<job-id>), for snapshot uploads."""
    incremental: bool
    restore: SlotRestore | None = None
    """What the slot restores first (None: it starts empty)."""
    changelog_materialize_interval_ms: int | None = None
    """Changelog checkpoints (``state.changelog.enabled``): how often the slot materializes; None: off."""
    changelog_max_failures_allowed: int = 3
    """With changelog checkpoints: consecutive failed materializations tolerated (``state.changelog.max-failures-allowed``)."""
    replay: tuple[ChangeSetFile, ...] = ()
    """Overlapped commits: the decided epochs' change sets the slot folds in after its restore."""


@dataclass(frozen=True)
class DeployedSlot:
    """A TaskManager's answer to a deployment."""

    restore_duration_ms: int
    committed_epoch: int
    """The epoch the deployed slot's state holds (-1: none)."""


def _ignore(_connectivity: grpc.ChannelConnectivity) -> None:
    pass


class TaskManagerGateways:
    """A cached channel and stub per TaskManager address; every call maps errors to domain errors."""

    def __init__(
        self,
        max_message_bytes: int,
        deploy_timeout_s: float = 600.0,
        control_timeout_s: float = 30.0,
        barrier_timeout_s: float = 10.0,
        security: ChannelSecurity | None = None,
        token: str | None = None,
    ) -> None:
        self._stubs: dict[str, tuple[grpc.Channel, pb_grpc.TaskExecutorStub]] = {}
        self._internal: dict[str, str] = {}
        self._security = security
        self._watchers: dict[str, list[Callable[[grpc.ChannelConnectivity], None]]] = {}
        self._lock = threading.Lock()
        self._max_message = max_message_bytes
        self._token = token
        self.deploy_timeout_s = deploy_timeout_s
        self.control_timeout_s = control_timeout_s
        # A barrier only starts the synchronous part of a snapshot; a TaskManager that does not
        # answer within seconds is not going to take part in this checkpoint.
        self.barrier_timeout_s = barrier_timeout_s

    def _stub(self, address: str) -> pb_grpc.TaskExecutorStub:
        with self._lock:
            entry = self._stubs.get(address)
            if entry is None:
                # Private: a TaskManager restarted on its old port must not inherit the backoff
                # of the connection to its dead predecessor (see open_channel).
                target = self._internal.get(address, address)
                channel = open_channel(
                    target, self._max_message, private=True, security=self._security, token=self._token
                )
                entry = (channel, pb_grpc.TaskExecutorStub(channel))
                self._stubs[address] = entry
            return entry[1]

    def route(self, address: str, internal_address: str) -> None:
        """Calls for the TaskManager at ``address`` go to ``internal_address`` (empty: ``address`` itself)."""
        target = internal_address or address
        with self._lock:
            changed = self._internal.get(address, address) != target
            self._internal[address] = target
        if changed:
            # A TaskManager restarted on the same client port may serve its internal plane elsewhere.
            self.forget(address, keep_route=True)

    def watch(self, address: str, on_broken: Callable[[str], None]) -> None:
        """Call ``on_broken(cause)`` once when the connection to ``address`` breaks for good.

        A TaskManager killed with SIGKILL sends no goodbye, but the kernel closes its sockets:
        the channel drops from READY to IDLE at once. The watcher then tries to reconnect, and
        a refused connection (TRANSIENT_FAILURE) means nothing listens there any more. That
        detects the loss in milliseconds instead of after ``heartbeat.timeout``; a TaskManager
        that is merely slow or paused keeps its connection and is left to the heartbeats.
        """
        self._stub(address)
        with self._lock:
            channel = self._stubs[address][0]
        state = {"was_ready": False, "fired": False}

        def on_change(connectivity: grpc.ChannelConnectivity) -> None:
            if connectivity is grpc.ChannelConnectivity.READY:
                state["was_ready"] = True
            elif connectivity is grpc.ChannelConnectivity.IDLE and state["was_ready"]:
                # Kick one reconnect attempt (subscribing with try_to_connect does; the flag
                # outlives the throwaway subscription); its outcome arrives here.
                channel.subscribe(_ignore, try_to_connect=True)
                channel.unsubscribe(_ignore)
            elif (
                connectivity is grpc.ChannelConnectivity.TRANSIENT_FAILURE and state["was_ready"] and not state["fired"]
            ):
                state["fired"] = True
                channel.unsubscribe(on_change)
                # Not on gRPC's callback thread: the listener fails jobs over.
                threading.Thread(
                    target=on_broken,
                    args=(f"the connection to {address} broke (refused after it was up)",),
                    name="jm-tm-broken",
                    daemon=True,
                ).start()

        with self._lock:
            self._watchers.setdefault(address, []).append(on_change)
        channel.subscribe(on_change, try_to_connect=True)

    def _close(self, address: str, channel: grpc.Channel) -> None:
        with self._lock:
            watchers = self._watchers.pop(address, [])
        if not watchers:
            channel.close()
            return
        for callback in watchers:
            channel.unsubscribe(callback)
        # gRPC's connectivity poller wakes every 200 ms and fails loudly on a channel closed
        # under it; it stops by itself once nothing is subscribed (within a poll or two, longer
        # on a loaded machine), so close well after that.
        timer = threading.Timer(2.0, channel.close)
        timer.daemon = True
        timer.start()

    def forget(self, address: str, keep_route: bool = False) -> None:
        """Drop and close the channel to ``address`` (a TaskManager lost or re-registered elsewhere).

        ``keep_route``: keep its internal route (see :meth:`route`), so the next call opens a fresh channel there.
        """
        with self._lock:
            entry = self._stubs.pop(address, None)
            if not keep_route:
                self._internal.pop(address, None)
        if entry is not None:
            self._close(address, entry[0])

    def _error(self, exc: grpc.RpcError, method: str, address: str) -> Exception:
        target = self._internal.get(address, address)
        where = address if target == address else f"{address} (internal {target})"
        return from_rpc_error(exc, f"{method} on TaskManager {where}", plane=INTERNAL)

    def deploy(self, address: str, deployment: SlotDeployment) -> DeployedSlot:
        """Deploy one slot (restoring its state first when the deployment says so); may take long."""
        request = pb.DeploySlotRequest(
            job_id=deployment.job_id,
            operator=operator_spec_to_proto(deployment.operator),
            subtask_index=deployment.subtask_index,
            key_groups=common_pb.KeyGroupRange(start=deployment.key_groups.start, end=deployment.key_groups.end),
            max_parallelism=deployment.max_parallelism,
            slot_index=deployment.slot_index,
            routing_version=deployment.routing_version,
            checkpoint_base=deployment.checkpoint_base,
            incremental=deployment.incremental,
            replay=[change_set_to_proto(f) for f in deployment.replay],
        )
        if deployment.restore is not None:
            request.restore.CopyFrom(restore_to_proto(deployment.restore))
        if deployment.changelog_materialize_interval_ms is not None:
            request.changelog.enabled = True
            request.changelog.materialize_interval_ms = deployment.changelog_materialize_interval_ms
            request.changelog.max_failures_allowed = deployment.changelog_max_failures_allowed
        try:
            response: pb.DeploySlotResponse = self._stub(address).DeploySlot(request, timeout=self.deploy_timeout_s)
        except grpc.RpcError as exc:
            raise self._error(exc, "DeploySlot", address) from exc
        return DeployedSlot(restore_duration_ms=response.restore_duration_ms, committed_epoch=response.committed_epoch)

    def release(
        self, address: str, subtask: SubtaskId, *, discard_local_state: bool = False, routing_version: int = 0
    ) -> None:
        """Release one slot; the TaskManager stops serving it before it answers.

        ``routing_version``: release only a deployment of this version or older (0: whatever is deployed), so a late
        release never removes a newer deployment of the same subtask.
        """
        request = pb.ReleaseSlotRequest(
            job_id=subtask.job_id,
            operator_id=subtask.operator_id,
            subtask_index=subtask.subtask_index,
            discard_local_state=discard_local_state,
            routing_version=routing_version,
        )
        try:
            self._stub(address).ReleaseSlot(request, timeout=self.control_timeout_s)
        except grpc.RpcError as exc:
            raise self._error(exc, "ReleaseSlot", address) from exc

    def trigger_checkpoint(self, address: str, barrier: CheckpointBarrier) -> int:
        """Send a checkpoint barrier to every slot of the job on ``address``; the number of slots that took it."""
        try:
            response: pb.TriggerResponse = self._stub(address).TriggerCheckpoint(
                barrier_to_proto(barrier), timeout=self.barrier_timeout_s
            )
            return response.slots
        except grpc.RpcError as exc:
            raise self._error(exc, "TriggerCheckpoint", address) from exc

    def notify_checkpoint(self, address: str, job_id: JobId, checkpoint_id: CheckpointId, completed: bool) -> None:
        """Tell ``address`` a checkpoint completed or was aborted (it may then drop or keep files)."""
        request = pb.CheckpointNotification(job_id=job_id, checkpoint_id=checkpoint_id, completed=completed)
        try:
            self._stub(address).NotifyCheckpoint(request, timeout=self.control_timeout_s)
        except grpc.RpcError as exc:
            raise self._error(exc, "NotifyCheckpoint", address) from exc

    def commit_epoch(
        self,
        address: str,
        *,
        job_id: JobId,
        epoch: int,
        winners: Iterable[Winner],
        routing_version: int,
        prepare: bool,
        upload_change_set: bool = False,
    ) -> list[ChangeSetFile]:
        """One round of an epoch commit (``prepare``, or apply) on the slots of ``address``.

        ``upload_change_set`` (a prepare of overlapped commits): every slot there writes its change
        set first; the files written (none otherwise).
        """
        request = pb.EpochCommitRequest(
            job_id=job_id,
            epoch=epoch,
            winners=[winner_to_proto(w) for w in winners],
            routing_version=routing_version,
            prepare=prepare,
            upload_change_set=upload_change_set,
        )
        # A plain prepare only checks; an apply, or a prepare writing change sets, moves the whole epoch.
        timeout = self.control_timeout_s if prepare and not upload_change_set else self.deploy_timeout_s
        try:
            response: pb.EpochCommitResponse = self._stub(address).CommitEpoch(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise self._error(exc, "CommitEpoch", address) from exc
        return [change_set_from_proto(f) for f in response.change_sets]

    def close(self) -> None:
        """Close every channel (JobManager shutdown); watched channels close a little later, once gRPC's poller lets go."""
        with self._lock:
            entries = list(self._stubs.items())
            self._stubs.clear()
        for address, (channel, _) in entries:
            self._close(address, channel)
