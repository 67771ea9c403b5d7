"""The TaskManager's side of the JobManager relationship: registration, heartbeats, the lease.

A TaskManager serves its slots only under a lease (:class:`~keyedstate.common.lease.Lease`):
every heartbeat the JobManager answers ``known`` extends it, counted from when the heartbeat was
sent. A heartbeat answered ``unknown`` (the JobManager restarted, or declared this TaskManager
lost) revokes it at once, and the TaskManager registers again; the registration answer names
the slots it may keep, and every other slot is released before the lease is renewed. A
TaskManager that cannot reach the JobManager keeps heartbeating and stops serving when its
lease runs out.

Checkpoint acknowledgements and declines travel on the same channel; this module is the one
place that writes their fields (the decline reason, and any ack outcome the JobManager answers).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable

import grpc

from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common._proto.v1 import jobmanager_pb2_grpc as jm_grpc
from keyedstate.common.clock import Clock
from keyedstate.common.errors import (
    AuthenticationError,
    ClusterMismatchError,
    ConfigError,
    KeyedStateError,
    PermissionDeniedError,
    Reason,
    UnavailableError,
)
from keyedstate.common.handles import DeclineReason, SubtaskStateHandle
from keyedstate.common.ids import CheckpointId, JobId, SubtaskId, TaskManagerId
from keyedstate.common.lease import Lease
from keyedstate.common.retry import RetryPolicy, call_with_retries
from keyedstate.common.rpc.channels import open_channel
from keyedstate.common.rpc.convert import handle_to_proto
from keyedstate.common.rpc.status import from_rpc_error, is_unreachable, status_name
from keyedstate.common.security.tls import ChannelSecurity
from keyedstate.taskmanager.rpc.wire import limits_to_proto
from keyedstate.taskmanager.state import StateLimits

logger = logging.getLogger(__name__)

_RPC_TIMEOUT_S = 10.0
_CHECKPOINT_RPC_TIMEOUT_S = 30.0
_DECLINE_REASONS = {
    DeclineReason.UNSPECIFIED: jm_pb.DECLINE_REASON_UNSPECIFIED,
    DeclineReason.SNAPSHOT_FAILED: jm_pb.DECLINE_REASON_SNAPSHOT_FAILED,
    DeclineReason.STATE_SIZE_LIMIT_EXCEEDED: jm_pb.DECLINE_REASON_STATE_SIZE_LIMIT_EXCEEDED,
}
_CHECKPOINT_REPORT_RETRIES = RetryPolicy(max_attempts=5, initial_backoff_s=0.2, multiplier=2.0, jitter=0.0)
"""An ack or decline is retried while the JobManager is unreachable (0.2 s, 0.4 s, ... between tries)."""

RetainSlots = Callable[[set[SubtaskId], dict[JobId, int]], None]
"""Release every hosted slot that is not in the given set, and take the jobs' routing versions as
the floor for later deploys (called before the lease is renewed)."""


class JobManagerConnection:
    """Registers with the JobManager and keeps the registration, and with it the lease, alive."""

    def __init__(
        self,
        jobmanager_address: str,
        taskmanager_id: TaskManagerId,
        address: str,
        host: str,
        num_slots: int,
        backend: str,
        metrics_port: int,
        slot_reports: Callable[[], list[jm_pb.SlotReport]],
        retain_slots: RetainSlots,
        lease: Lease,
        clock: Clock,
        stop: threading.Event,
        *,
        limits: StateLimits | None = None,
        internal_address: str = "",
        security: ChannelSecurity | None = None,
        cluster_id: str = "default",
        token: str | None = None,
    ) -> None:
        self.jobmanager_address = jobmanager_address
        self._tm_id = taskmanager_id
        self._address = address
        self._host = host
        self._num_slots = num_slots
        self._backend = backend
        self._metrics_port = metrics_port
        self._slot_reports = slot_reports
        self._retain_slots = retain_slots
        self.lease = lease
        self._clock = clock
        self._stop = stop
        self._cluster_id = cluster_id
        self._limits = limits_to_proto(limits) if limits is not None else None
        self._internal_address = internal_address
        # The JobManager's internal plane: mutual TLS with the cluster's certificates when enabled.
        self._channel = open_channel(jobmanager_address, security=security, token=token)
        self._plane = "internal"
        self._stub = jm_grpc.ResourceManagerStub(self._channel)
        self._checkpoints = jm_grpc.CheckpointCoordinatorGatewayStub(self._channel)
        self._session = ""
        self.heartbeat_interval_ms = 1000
        self.lease_duration_ms = 0
        self._thread: threading.Thread | None = None
        self.registrations = 0
        self._asked_to_register = False
        self._slot_addresses: list[str] = []
        self._slot_processes: list[tuple[str, int]] = []
        self.registered_slot_addresses: list[str] = []
        """The slot addresses the JobManager accepted with the last registration."""
        self._register_again = threading.Event()

    @property
    def stub(self) -> jm_grpc.ResourceManagerStub:
        """The JobManager's ResourceManager service on this connection's channel."""
        return self._stub

    def advertise(
        self,
        address: str,
        internal_address: str,
        metrics_port: int,
        slot_addresses: list[str] | None = None,
        slot_processes: list[tuple[str, int]] | None = None,
    ) -> None:
        """Where this TaskManager serves, as registrations report it (known once its servers are bound).

        ``slot_addresses``: where each slot is served, when slot processes serve them (None: on ``address``);
        ``slot_processes``: their ``(address, pid)`` by index (statectl shows them).
        """
        self._address = address
        self._internal_address = internal_address
        self._metrics_port = metrics_port
        self._slot_addresses = list(slot_addresses or [])
        self._slot_processes = list(slot_processes or [])

    def readvertise_slots(self, slot_addresses: list[str], slot_processes: list[tuple[str, int]]) -> None:
        """A slot process was replaced on a new port: register again, with the new addresses, at the next beat.

        The registration answer lets the TaskManager keep the slots that still run; the JobManager
        fails over the jobs whose slots the replaced process hosted.
        """
        self._slot_addresses = list(slot_addresses)
        self._slot_processes = list(slot_processes)
        self._register_again.set()

    # -- checkpoints (the snapshot layer's CheckpointReporter) ---------------------------------
    def acknowledge_checkpoint(self, job_id: JobId, checkpoint_id: CheckpointId, state: SubtaskStateHandle) -> None:
        """Report one slot's uploaded snapshot; retried while the JobManager is unreachable."""
        request = jm_pb.AcknowledgeCheckpointRequest(
            job_id=job_id, checkpoint_id=checkpoint_id, taskmanager_id=self._tm_id, state=handle_to_proto(state)
        )
        self._report(
            f"acknowledging checkpoint {checkpoint_id}",
            lambda: self._checkpoints.AcknowledgeCheckpoint(request, timeout=_CHECKPOINT_RPC_TIMEOUT_S),
        )

    def decline_checkpoint(
        self,
        job_id: JobId,
        checkpoint_id: CheckpointId,
        subtask: SubtaskId,
        reason: str,
        kind: DeclineReason = DeclineReason.SNAPSHOT_FAILED,
    ) -> None:
        """Report that one slot cannot complete a checkpoint, and why; retried while the JobManager is unreachable."""
        request = jm_pb.DeclineCheckpointRequest(
            job_id=job_id,
            checkpoint_id=checkpoint_id,
            taskmanager_id=self._tm_id,
            operator_id=subtask.operator_id,
            subtask_index=subtask.subtask_index,
            message=reason,
            reason=_DECLINE_REASONS[kind],
        )
        self._report(
            f"declining checkpoint {checkpoint_id}",
            lambda: self._checkpoints.DeclineCheckpoint(request, timeout=_CHECKPOINT_RPC_TIMEOUT_S),
        )

    def report_task_failure(self, subtask: SubtaskId, routing_version: int, cause: str) -> None:
        """Report that ``subtask`` (deployed under ``routing_version``) failed while running, so its job fails over."""
        request = jm_pb.ReportTaskFailureRequest(
            job_id=subtask.job_id,
            taskmanager_id=self._tm_id,
            operator_id=subtask.operator_id,
            subtask_index=subtask.subtask_index,
            routing_version=routing_version,
            cause=cause,
        )
        self._report(
            f"reporting the failure of {subtask}",
            lambda: self._stub.ReportTaskFailure(request, timeout=_CHECKPOINT_RPC_TIMEOUT_S),
        )

    def _report(self, what: str, call: Callable[[], object]) -> None:
        call_with_retries(
            call, what=what, policy=_CHECKPOINT_REPORT_RETRIES, waiter=self._stop, is_transient=is_unreachable
        )

    def register(self, timeout_ms: int) -> None:
        """Register, retrying until ``timeout_ms`` passes; then raise with what to check."""
        failures: list[Exception] = []

        def attempt() -> None:
            try:
                self._register_once()
            except (grpc.RpcError, UnavailableError) as exc:
                failures.append(exc)
                raise

        def reachable_later(exc: BaseException) -> bool:
            # Waiting does not fix a wrong cluster or a missing permission: those stop at once.
            return isinstance(exc, (grpc.RpcError, UnavailableError)) and _refusal(exc) is None

        if self._stop.is_set():
            raise self._unreachable(timeout_ms, None)
        policy = RetryPolicy(
            max_attempts=sys.maxsize,
            initial_backoff_s=0.1,
            max_backoff_s=2.0,
            multiplier=2.0,
            jitter=0.0,
            deadline_s=timeout_ms / 1000.0,
        )
        try:
            call_with_retries(
                attempt,
                what=f"taskmanager {self._tm_id}: registering with the JobManager at {self.jobmanager_address}",
                policy=policy,
                waiter=self._stop,
                is_transient=reachable_later,
                interrupted=lambda _what: self._unreachable(timeout_ms, failures[-1]),
                clock=self._clock,
                log_level=logging.INFO,
            )
        except (grpc.RpcError, UnavailableError) as exc:
            if not any(exc is failure for failure in failures):
                raise  # stopped while waiting: already the error naming what to check
            refused = _refusal(exc)
            if refused is not None:
                raise refused from exc
            raise self._unreachable(timeout_ms, exc) from exc

    def _unreachable(self, timeout_ms: int, last: Exception | None) -> UnavailableError:
        detail = f" ({from_rpc_error(last, plane=self._plane).message})" if isinstance(last, grpc.RpcError) else ""
        return UnavailableError(
            f"cannot reach the JobManager at {self.jobmanager_address} within {timeout_ms / 1000:.0f} s{detail}; "
            "check jobmanager.rpc.address and jobmanager.rpc.port (jobmanager.internal.port when TLS is on), or raise "
            "taskmanager.registration.timeout"
        )

    def _register_once(self) -> None:
        # Fenced before asking: from the moment the JobManager sees this registration, nothing is
        # served here except the slots its answer lets us keep.
        self.lease.revoke("registering with the JobManager")
        self._asked_to_register = True
        slot_addresses = list(self._slot_addresses)
        sent_at = self._clock.boottime_ms()
        response = self._stub.RegisterTaskManager(
            jm_pb.RegisterTaskManagerRequest(
                taskmanager_id=self._tm_id,
                address=self._address,
                num_slots=self._num_slots,
                host=self._host,
                slots=self._slot_reports(),
                metrics_port=self._metrics_port,
                backend=self._backend,
                limits=self._limits,
                internal_address=self._internal_address,
                cluster_id=self._cluster_id,
                slot_addresses=slot_addresses,
                slot_processes=[
                    jm_pb.SlotProcessInfo(index=i, address=address, pid=pid)
                    for i, (address, pid) in enumerate(self._slot_processes)
                ],
            ),
            timeout=_RPC_TIMEOUT_S,
        )
        kept = {SubtaskId(s.job_id, s.operator_id, s.subtask_index) for s in response.kept_slots}
        self._retain_slots(kept, {JobId(job): version for job, version in response.routing_versions.items()})
        self._session = response.jobmanager_session
        self.heartbeat_interval_ms = max(10, response.heartbeat_interval_ms)
        self.lease_duration_ms = response.lease_duration_ms
        self.lease.renew(sent_at, self.lease_duration_ms)
        self.registered_slot_addresses = slot_addresses
        self.registrations += 1
        logger.info(
            "taskmanager %s: registered with JobManager %s (session %s, lease %d ms, %d slots kept)",
            self._tm_id,
            self.jobmanager_address,
            self._session,
            self.lease_duration_ms,
            len(kept),
        )

    def start_heartbeats(self) -> None:
        """Heartbeat every interval the JobManager asked for, until the TaskManager stops."""
        self._thread = threading.Thread(target=self._heartbeat_loop, name="tm-heartbeat", daemon=True)
        self._thread.start()

    def heartbeat_once(self) -> None:
        """One heartbeat: renew the lease, or revoke it and register again when the JobManager disowns us."""
        if self._register_again.is_set():
            self._register_again.clear()
            try:
                self._register_once()
            except BaseException:
                self._register_again.set()  # the JobManager must learn the new addresses: the next beat registers
                raise
            return
        sent_at = self._clock.boottime_ms()
        response = self._stub.Heartbeat(
            jm_pb.HeartbeatRequest(
                taskmanager_id=self._tm_id, slots=self._slot_reports(), jobmanager_session=self._session
            ),
            timeout=_RPC_TIMEOUT_S,
        )
        if response.known:
            self.lease.renew(sent_at, self.lease_duration_ms)
            return
        self.lease.revoke("the JobManager does not know this TaskManager (it restarted, or declared it lost)")
        logger.warning("taskmanager %s: JobManager does not know us; registering again", self._tm_id)
        self._register_once()

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_interval_ms / 1000.0):
            try:
                self.heartbeat_once()
            except grpc.RpcError as exc:
                # The lease runs out by itself if this goes on; nothing else to do but try again.
                logger.warning(
                    "taskmanager %s: heartbeat to %s failed: %s (lease %d ms left)",
                    self._tm_id,
                    self.jobmanager_address,
                    status_name(exc),
                    self.lease.remaining_ms(),
                )
            except Exception:  # the loop must survive anything; the next beat retries
                logger.exception("taskmanager %s: heartbeat failed", self._tm_id)

    def deregister(self) -> None:
        """Tell the JobManager this TaskManager leaves (best effort: its lease runs out anyway)."""
        if not self._asked_to_register:
            return  # the JobManager never heard of this TaskManager: nobody to tell
        try:
            self._stub.DeregisterTaskManager(
                jm_pb.DeregisterTaskManagerRequest(taskmanager_id=self._tm_id), timeout=2.0
            )
        except grpc.RpcError as exc:
            logger.info("taskmanager %s: deregistration skipped (%s)", self._tm_id, status_name(exc))

    def close(self) -> None:
        """Stop heartbeating and close the channel."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._channel.close()


def _refusal(exc: Exception) -> KeyedStateError | None:
    """The JobManager's definite no (another cluster, no or wrong identity), as a ConfigError naming the fix."""
    if not isinstance(exc, grpc.RpcError):
        return None
    error = from_rpc_error(exc, "the JobManager refused this TaskManager's registration")
    if isinstance(error, ClusterMismatchError):
        return ConfigError(error.message + " (high-availability.cluster-id)", reason=Reason.WRONG_CLUSTER)
    if isinstance(error, (AuthenticationError, PermissionDeniedError)):
        return ConfigError(
            f"{error.message}. A TaskManager presents the token in security.auth.token-file (or KEYEDSTATE_TOKEN_FILE / "
            "KEYEDSTATE_TOKEN); it needs role taskmanager in the JobManager's security.auth.tokens-file",
            reason=error.reason,
        )
    return None


__all__ = ["JobManagerConnection"]
