"""The executor client: talks to the JobManager for routing and to TaskManagers for state.

One :class:`StateClient` per process is enough (Spark reuses Python workers, so a module-level
client keeps its channels warm); it is thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import grpc

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common._proto.v1 import jobmanager_pb2_grpc as jm_grpc
from keyedstate.common._proto.v1 import taskmanager_pb2 as tm_pb
from keyedstate.common._proto.v1 import taskmanager_pb2_grpc as tm_grpc
from keyedstate.common.client._epoch import EpochScope, as_scope
from keyedstate.common.client._routing import Routing
from keyedstate.common.config import Configuration, options as o
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor
from keyedstate.common.errors import (
    EpochConflictError,
    InvalidArgumentError,
    KeyedStateError,
    NotFoundError,
    Reason,
    StaleRoutingError,
    UnavailableError,
)
from keyedstate.common.keygroups import HASH_SEED
from keyedstate.common.rpc.channels import open_channel
from keyedstate.common.rpc.status import REASON_KEY, from_rpc_error

import xxhash

logger = logging.getLogger(__name__)

_xxh64 = xxhash.xxh64_intdigest

# Calls whose second application changes nothing: retried after any transport failure.
IDEMPOTENT = frozenset({"ValueGet", "ValuePut", "Clear", "ListGet", "ListUpdate", "MapPut", "MapGet", "MapRemove",
                        "MapContains", "ListScan", "MapScan", "ScanKeys"})
READS = frozenset({"ValueGet", "ListGet", "MapGet", "MapContains"})
WRITES = frozenset({"ValuePut", "Clear", "Reduce", "ListAppend", "ListUpdate", "MapPut", "MapRemove"})
# ListUpdate replaces each key's whole list with the values given for it, so one key's values
# must travel in one request.
UNSPLITTABLE = frozenset({"ListUpdate"})

Part = list[int] | range | None
"""The keys of one request: positions in the call's key list, a contiguous range, or None (all)."""


@dataclass(frozen=True)
class _Unit:
    """One request to send: the owning subtask, its keys, and its sequence number (epoch writes; else 0)."""

    subtask: int
    part: Part
    seq: int = 0


@dataclass
class _Lane:
    """The requests still to send to one subtask, and how many of its requests are in flight."""

    target: tm_pb.StateTarget
    address: str
    call: Any
    parts: deque[_Unit]
    in_flight: int = 0


@dataclass(frozen=True)
class ClientSettings:
    timeout_s: float = 60.0
    max_attempts: int = 8
    backoff_s: float = 0.1
    batch_size: int = 2000
    max_in_flight: int = 4
    max_message_bytes: int = 256 << 20

    @classmethod
    def from_config(cls, conf: Configuration) -> ClientSettings:
        return cls(
            timeout_s=conf.get(o.CLIENT_TIMEOUT) / 1000.0,
            max_attempts=conf.get(o.CLIENT_RETRIES),
            backoff_s=conf.get(o.CLIENT_RETRY_BACKOFF) / 1000.0,
            batch_size=conf.get(o.CLIENT_BATCH_SIZE),
            max_in_flight=conf.get(o.CLIENT_MAX_IN_FLIGHT),
            max_message_bytes=conf.get(o.RPC_MAX_MESSAGE),
        )


class _Retry(Exception):
    """Internal: a sub-batch must be sent again after a routing refresh."""


def _not_applied(err: grpc.RpcError) -> bool:
    """True when the server guarantees the call changed nothing (it answered with our reason header).

    Our servers validate a whole batch before writing, and answer with a reason after deciding
    not to apply it, except OUTCOME_UNKNOWN (the call may have applied); a bare transport error
    leaves the outcome unknown.
    """
    try:
        reasons = [v for k, v in (err.trailing_metadata() or ()) if k == REASON_KEY]
    except Exception:
        return False
    return bool(reasons) and Reason.OUTCOME_UNKNOWN.value not in reasons


class StateClient:
    """Routes keyed-state calls of one or more jobs to the TaskManagers that own the keys."""

    def __init__(self, jobmanager_address: str, settings: ClientSettings | None = None) -> None:
        self.jobmanager_address = jobmanager_address
        self.settings = settings or ClientSettings()
        self._jm_channel = open_channel(jobmanager_address, self.settings.max_message_bytes)
        self.jobmanager = jm_grpc.JobManagerStub(self._jm_channel)
        self._stubs: dict[str, tm_grpc.KeyedStateStub] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._routing: dict[str, Routing] = {}
        self._suspect: set[str] = set()
        """Jobs whose cached table may name a dead owner: a call failed with an unknown outcome, which is not
        retried, so nothing else would fetch the table again and every later call would go to that address."""
        self._descriptors: dict[tuple[str, str, str], StateDescriptor] = {}
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_config(cls, conf: Configuration) -> StateClient:
        address = f"{conf.get(o.JOBMANAGER_ADDRESS)}:{conf.get(o.JOBMANAGER_PORT)}"
        return cls(address, ClientSettings.from_config(conf))

    # -- JobManager calls --------------------------------------------------------------------
    def _jm_call(self, method: str, request: Any, timeout: float | None = None, retry: bool = True) -> Any:
        attempts = self.settings.max_attempts if retry else 1
        delay = self.settings.backoff_s
        for attempt in range(1, attempts + 1):
            try:
                return getattr(self.jobmanager, method)(request, timeout=timeout or self.settings.timeout_s)
            except grpc.RpcError as exc:
                error = from_rpc_error(exc, f"JobManager {self.jobmanager_address} {method}")
                if isinstance(error, UnavailableError) and attempt < attempts:
                    time.sleep(delay)
                    delay = min(delay * 2, 5.0)
                    continue
                raise error from exc
        raise AssertionError("unreachable")

    def submit_job(
        self,
        job_id: str,
        operators: Sequence[OperatorSpec],
        *,
        max_parallelism: int = 0,
        restore_path: str = "",
        config: dict[str, str] | None = None,
    ) -> Routing:
        """Register (or re-attach to) a job; returns its routing. Submitting the same job again is a no-op."""
        table = self._jm_call("SubmitJob", jm_pb.SubmitJobRequest(
            job_id=job_id, operators=[op.to_proto() for op in operators], max_parallelism=max_parallelism,
            restore_path=restore_path, config={k: str(v) for k, v in (config or {}).items()},
        ), timeout=max(self.settings.timeout_s, 600.0))
        return self._store_routing(table)

    def cancel_job(self, job_id: str) -> jm_pb.JobInfo:
        return self._jm_call("CancelJob", jm_pb.JobRequest(job_id=job_id))

    def job_info(self, job_id: str) -> jm_pb.JobInfo:
        return self._jm_call("GetJob", jm_pb.JobRequest(job_id=job_id))

    def cluster(self) -> jm_pb.ClusterOverview:
        return self._jm_call("GetClusterOverview", jm_pb.ClusterOverviewRequest())

    def wait_for_taskmanagers(self, count: int, *, slots: int = 0, timeout_s: float = 60.0) -> jm_pb.ClusterOverview:
        """Wait until ``count`` TaskManagers (and at least ``slots`` slots) are registered; the cluster then.

        The documented way for a program or script to know a cluster is ready before it submits
        a job (``statectl cluster --wait N`` does the same from a shell). Raises UnavailableError
        naming what is missing after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        last = "the JobManager did not answer"
        fix = f"check that a JobManager runs at {self.jobmanager_address}"
        while True:
            try:
                overview = self._jm_call("GetClusterOverview", jm_pb.ClusterOverviewRequest(), retry=False)
                active = [t for t in overview.taskmanagers if t.status == "ACTIVE"]
                if len(active) >= count and overview.total_slots >= slots:
                    return overview
                last = f"{len(active)} of {count} TaskManagers are registered"
                if slots:
                    last += f", with {overview.total_slots} of {slots} slots"
                fix = "start more TaskManagers (pointed at this JobManager), or wait longer"
            except UnavailableError as exc:
                last = exc.message
            if time.monotonic() >= deadline:
                raise UnavailableError(
                    f"the cluster at {self.jobmanager_address} was not ready within {timeout_s:.0f} s: {last}; {fix}"
                )
            time.sleep(0.1)

    def trigger_checkpoint(self, job_id: str, *, savepoint: bool = False, target_directory: str = "",
                           wait: bool = True, timeout_s: float = 600.0) -> jm_pb.CheckpointInfo:
        return self._jm_call("TriggerCheckpoint", jm_pb.TriggerCheckpointRequest(
            job_id=job_id, savepoint=savepoint, target_directory=target_directory, wait=wait,
            timeout_ms=int(timeout_s * 1000),
        ), timeout=timeout_s + 30, retry=False)

    def begin_batch(self, job_id: str, query_id: str, batch_id: int) -> jm_pb.BeginBatchResponse:
        """Where batch ``batch_id`` of ``query_id`` stands: its job epoch and what to do (docs/exactly-once.md).

        Raises EpochGapError when the job's state cannot take the batch (it would skip epochs).
        """
        response = self._jm_call("BeginBatch", jm_pb.BeginBatchRequest(job_id=job_id, query_id=query_id, batch_id=batch_id))
        self._store_routing(response.routing, fetched=True)
        return response

    def commit_epoch(
        self,
        job_id: str,
        epoch: int,
        winners: dict[int, int] | Sequence[pb.PartitionAttempt],
        *,
        expected_routing_version: int,
        query_id: str = "",
        batch_id: int | None = None,
        checkpoint: bool = True,
        wait_for_checkpoint: bool = True,
        timeout_s: float = 600.0,
    ) -> jm_pb.CommitEpochResponse:
        """Commit job epoch ``epoch`` (batch ``batch_id`` of ``query_id``) with the winning attempt of each partition.

        ``winners`` is ``{partition: attempt}`` (no ledgers checked) or the winners' own
        ``PartitionAttempt`` messages with their ledgers (``EpochScope.winner()``). With
        ``wait_for_checkpoint`` the call answers once a completed checkpoint holds the epoch, or
        raises. Safe to call again: an epoch already committed only waits for durability.
        """
        if isinstance(winners, dict):
            attempts = [pb.PartitionAttempt(partition=p, attempt=a) for p, a in sorted(winners.items())]
        else:
            attempts = list(winners)
        request = jm_pb.CommitEpochRequest(
            job_id=job_id, epoch=epoch, checkpoint=checkpoint, wait_for_checkpoint=wait_for_checkpoint,
            expected_routing_version=expected_routing_version, query_id=query_id,
            batch_id=epoch if batch_id is None else batch_id, winners=attempts, timeout_ms=int(timeout_s * 1000),
        )
        return self._jm_call("CommitEpoch", request, timeout=timeout_s + 30, retry=False)

    def routing(self, job_id: str, refresh: bool = False) -> Routing:
        """The job's routing table: cached, or fetched from the JobManager with ``refresh``."""
        routing = self._routing.get(job_id)
        if routing is None or refresh:
            table = self._jm_call("GetRouting", jm_pb.GetRoutingRequest(job_id=job_id))
            routing = self._store_routing(table, fetched=True)
            self._suspect.discard(job_id)
        return routing

    def _store_routing(self, table: pb.RoutingTable, fetched: bool = False) -> Routing:
        """Cache ``table``. A table just fetched is the JobManager's word and replaces any other (even
        a higher version: a JobManager restarted without high availability numbers from 1 again);
        one that arrived with another answer (a submission) replaces only an older one."""
        routing = Routing.from_proto(table)
        with self._lock:
            current = self._routing.get(routing.job_id)
            if fetched or current is None or routing.version >= current.version or routing.job_status != current.job_status:
                self._routing[routing.job_id] = routing
        return self._routing[routing.job_id]

    def descriptor(self, job_id: str, operator_id: str, state: str) -> StateDescriptor:
        key = (job_id, operator_id, state)
        found = self._descriptors.get(key)
        if found is None:
            info = self.job_info(job_id)
            for op in info.operators:
                for d in op.states:
                    self._descriptors[(job_id, op.operator_id, d.name)] = StateDescriptor.from_proto(d)
            found = self._descriptors.get(key)
            if found is None:
                operators = sorted(op.operator_id for op in info.operators)
                if operator_id not in operators:
                    raise NotFoundError(
                        f"job {job_id!r} has no operator {operator_id!r} (operators: {', '.join(operators) or 'none'})",
                        reason=Reason.UNKNOWN_OPERATOR,
                    )
                declared = sorted(d.name for op in info.operators if op.operator_id == operator_id for d in op.states)
                raise NotFoundError(
                    f"job {job_id!r} operator {operator_id!r} declares no state {state!r} (states: {', '.join(declared)})",
                    reason=Reason.UNKNOWN_STATE,
                )
        return found

    # -- TaskManager calls -------------------------------------------------------------------
    def _stub(self, address: str) -> tm_grpc.KeyedStateStub:
        stub = self._stubs.get(address)
        if stub is None:
            with self._lock:
                stub = self._stubs.get(address)
                if stub is None:
                    channel = open_channel(address, self.settings.max_message_bytes)
                    self._channels[address] = channel
                    stub = tm_grpc.KeyedStateStub(channel)
                    self._stubs[address] = stub
        return stub

    def keyed_call(
        self,
        job_id: str,
        operator_id: str,
        state: str,
        method: str,
        keys: list[bytes],
        build: Callable[[tm_pb.StateTarget, Part], tm_pb.KeyedRequest],
        epoch: pb.EpochContext | EpochScope | None = None,
    ) -> list[tuple[Part, Any]]:
        """Send one logical batch: group keys by owning subtask, split into requests, pipeline them.

        ``build(target, indices)`` makes the request for the keys at ``indices``: None = all keys
        (every key has the same owner), a ``range`` = a contiguous slice, or a list of positions.
        Returns (indices, response) pairs.

        Idempotent methods are retried on UNAVAILABLE and stale routing; others only when the
        server answered that it applied nothing. Inside an epoch scope with a pinned routing
        version (:class:`EpochScope`) every call goes out under that version, each write request
        carries a sequence number the slot stages once (so every write is safe to retry), and a
        routing that moved on fails the call with EpochConflictError: the batch must run again.
        """
        if not keys:
            return []
        scope = as_scope(epoch)
        pinned = scope is not None and scope.routing_version > 0
        numbered = scope is not None and scope.numbered and method in WRITES
        idempotent = method in IDEMPOTENT or (numbered and pinned)
        # Requests of one subtask may overtake each other in flight; that is harmless for reads and
        # for writes that touch every key once (checked on the whole call, conservatively per key).
        order_free = method in READS or (len(keys) <= self.settings.batch_size) or len(set(keys)) == len(keys)
        attempts = self.settings.max_attempts
        delay = self.settings.backoff_s
        pending: list[_Unit] | None = None  # None: first round, everything
        failed_units: list[_Unit] | None
        results: list[tuple[Part, Any]] = []
        refresh = job_id in self._suspect
        sent_under = -1  # the routing version the pending units were built for
        for attempt in range(1, attempts + 1):
            routing = self._routing_for(job_id, scope if pinned else None, refresh)
            if routing.job_status not in ("RUNNING", ""):
                if routing.job_status in ("FAILED", "CANCELED"):
                    self._suspect.add(job_id)  # a restore or a resubmission brings it back: the next call looks again
                    raise KeyedStateError(f"job {job_id!r} is {routing.job_status}", reason=Reason.JOB_NOT_RUNNING)
                failed_units = pending  # None: nothing was sent yet, everything goes next round
                error: KeyedStateError = UnavailableError(f"job {job_id!r} is {routing.job_status}")
            else:
                if pending is not None and (pinned or (numbered and routing.version == sent_under)):
                    # Same routing version: same owners, and the same sequence numbers, so a slot that
                    # applied a request whose answer was lost does not stage it twice.
                    units = pending
                else:
                    units = self._units(routing, operator_id, method, keys, pending, scope if numbered else None)
                sent_under = routing.version
                sent, failed_units, error = self._send_units(
                    routing, operator_id, state, method, units, build, scope, numbered, idempotent, order_free, pinned,
                )
                results.extend(sent)
                if not failed_units:
                    return results
            if attempt == attempts:
                raise error
            logger.debug("retrying %s of %s/%s after %s (attempt %d)", method, job_id, operator_id, error.message, attempt)
            pending = failed_units
            refresh = True
            if not isinstance(error, StaleRoutingError):
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")

    def _routing_for(self, job_id: str, scope: EpochScope | None, refresh: bool) -> Routing:
        """The routing to send with: the pinned version inside an epoch scope, else the newest known."""
        try:
            routing = self.routing(job_id, refresh=refresh)
        except UnavailableError:
            cached = self._routing.get(job_id)
            if cached is None or job_id not in self._suspect:
                raise
            routing = cached  # only suspect, and the JobManager is away: the cached table may still be right
        if scope is None:
            return routing
        if routing.version < scope.routing_version:
            routing = self.routing(job_id, refresh=True)
        if routing.version != scope.routing_version:
            raise EpochConflictError(
                f"job {job_id!r} was redeployed (routing v{scope.routing_version} -> v{routing.version}) while epoch "
                f"{scope.epoch} ran; the task's writes cannot be committed, so the batch must run again"
            )
        return routing

    def _units(
        self, routing: Routing, operator_id: str, method: str, keys: list[bytes], pending: list[_Unit] | None,
        numbering: EpochScope | None,
    ) -> list[_Unit]:
        """Requests to send, by owning subtask: all keys on the first round, the failed ones regrouped after."""
        if pending is None:
            groups = self._group(routing, operator_id, keys, None)
        else:
            groups = self._group(routing, operator_id, keys, [u.part for u in pending])
        units = []
        for subtask, indices in groups.items():
            for part in self._split(method, indices, len(keys)):
                seq = numbering.next_sequence(operator_id, subtask) if numbering is not None else 0
                units.append(_Unit(subtask, part, seq))
        return units

    def _group(
        self, routing: Routing, operator_id: str, keys: list[bytes], pending: list[Part] | None
    ) -> dict[int, Part]:
        routes = routing.operator(operator_id)
        table = routes.subtask_of
        m = routing.max_parallelism
        if pending is None:
            if routes.parallelism == 1:
                return {table[0]: None}  # one owner: no hashing at all
            h = _xxh64
            subs = [table[(h(k, HASH_SEED) & 0xFFFFFFFF) % m] for k in keys]
            first = subs[0]
            if subs.count(first) == len(subs):
                return {first: None}
            groups: dict[int, list[int]] = {}
            for i, s in enumerate(subs):
                g = groups.get(s)
                if g is None:
                    groups[s] = [i]
                else:
                    g.append(i)
            return groups  # type: ignore[return-value]
        indices = [i for group in pending for i in (group if group is not None else range(len(keys)))]
        regrouped: dict[int, list[int]] = {}
        for i in indices:
            s = table[(_xxh64(keys[i], HASH_SEED) & 0xFFFFFFFF) % m]
            regrouped.setdefault(s, []).append(i)
        return regrouped  # type: ignore[return-value]

    def _split(self, method: str, indices: Part, n_keys: int) -> list[Part]:
        """The requests of one subtask: ``batch_size`` keys each (contiguous ranges when possible)."""
        batch = self.settings.batch_size
        if method in UNSPLITTABLE:
            return [indices]
        if indices is None:
            if n_keys <= batch:
                return [None]
            return [range(a, min(a + batch, n_keys)) for a in range(0, n_keys, batch)]
        if len(indices) <= batch:
            return [indices]
        return [indices[a:a + batch] for a in range(0, len(indices), batch)]

    def _send_units(
        self,
        routing: Routing,
        operator_id: str,
        state: str,
        method: str,
        units: list[_Unit],
        build: Callable[[tm_pb.StateTarget, Part], tm_pb.KeyedRequest],
        scope: EpochScope | None,
        numbered: bool,
        idempotent: bool,
        order_free: bool,
        pinned: bool,
    ) -> tuple[list[tuple[Part, Any]], list[_Unit], KeyedStateError]:
        """Pipeline the requests of every subtask; returns (answers, units to retry, last error).

        Each request is built just before it is sent, so encoding the next batch overlaps the
        TaskManager applying the previous one. Up to ``max_in_flight`` requests per subtask are
        in flight when their order cannot matter (reads, or writes whose keys are all distinct);
        otherwise one at a time, so a repeated key's writes apply in the caller's order. After a
        retryable failure a subtask sends nothing more: its remaining requests are retried in
        order with the failed one.
        """
        routes = routing.operator(operator_id)
        per_subtask = self.settings.max_in_flight if order_free else 1
        timeout = self.settings.timeout_s
        context = scope.context if scope is not None else None
        lanes: dict[int, _Lane] = {}
        for unit in units:
            lane = lanes.get(unit.subtask)
            if lane is None:
                target = tm_pb.StateTarget(
                    job_id=routing.job_id, operator_id=operator_id, subtask_index=unit.subtask, state_name=state,
                    routing_version=routing.version, epoch=context,
                )
                address = routes.addresses[unit.subtask]
                lane = lanes[unit.subtask] = _Lane(target, address, getattr(self._stub(address), method), deque())
            lane.parts.append(unit)
        sent: list[tuple[Part, Any]] = []
        failed: list[_Unit] = []
        last_error: KeyedStateError = UnavailableError("no error")
        in_flight: deque[tuple[_Lane, _Unit, Any]] = deque()

        def request_for(lane: _Lane, unit: _Unit) -> tm_pb.KeyedRequest:
            if not unit.seq:
                return build(lane.target, unit.part)
            assert scope is not None
            target = tm_pb.StateTarget()
            target.CopyFrom(lane.target)
            target.epoch.CopyFrom(scope.context_for(unit.seq))
            return build(target, unit.part)

        def drain_one() -> None:
            nonlocal last_error
            lane, unit, future = in_flight.popleft()
            lane.in_flight -= 1
            try:
                sent.append((unit.part, future.result()))
                if unit.seq and scope is not None:
                    scope.acknowledged(operator_id, unit.subtask, unit.seq)
            except grpc.RpcError as exc:
                error = from_rpc_error(exc, f"{method} on TaskManager {lane.address}")
                if pinned and isinstance(error, StaleRoutingError):
                    for _lane, _unit, f in in_flight:
                        f.cancel()
                    raise EpochConflictError(
                        f"{error.message}. The batch's routing version v{routing.version} is no longer the slot's, so "
                        "this task's writes cannot be committed; the batch must run again"
                    ) from exc
                retryable = isinstance(error, (StaleRoutingError, UnavailableError))
                if retryable and (idempotent or _not_applied(exc)):
                    failed.append(unit)
                    failed.extend(lane.parts)  # never sent, so certainly not applied
                    lane.parts.clear()
                    last_error = error
                    return
                for _lane, _unit, f in in_flight:  # the caller gets the error now; stop the rest
                    f.cancel()
                if retryable:
                    self._suspect.add(routing.job_id)  # the owner may be gone: the next call fetches the table
                    raise UnavailableError(
                        f"{error.message}. The outcome of this {method} is unknown (the TaskManager may have applied "
                        "it), so it was not retried; use epoch transactions for exactly-once updates"
                    ) from exc
                raise error from exc

        while True:
            for lane in lanes.values():
                while lane.parts and lane.in_flight < per_subtask:
                    unit = lane.parts.popleft()
                    in_flight.append((lane, unit, lane.call.future(request_for(lane, unit), timeout=timeout)))
                    lane.in_flight += 1
            if not in_flight:
                return sent, failed, last_error
            drain_one()

    def stream_call(
        self, job_id: str, operator_id: str, method: str, subtask: int, request: tm_pb.ScanRequest,
        epoch: pb.EpochContext | EpochScope | None = None,
    ) -> Iterator[tm_pb.ScanChunk]:
        """A server-streaming scan of one subtask (retries before the first chunk only)."""
        scope = as_scope(epoch)
        pinned = scope if scope is not None and scope.routing_version > 0 else None
        if scope is not None:
            request.target.epoch.CopyFrom(scope.context)
        for attempt in range(1, self.settings.max_attempts + 1):
            routing = self._routing_for(job_id, pinned, refresh=attempt > 1)
            address = routing.operator(operator_id).addresses[subtask]
            request.target.routing_version = routing.version
            try:
                stream = getattr(self._stub(address), method)(request, timeout=self.settings.timeout_s * 10)
                first = True
                for chunk in stream:
                    first = False
                    yield chunk
                return
            except grpc.RpcError as exc:
                error = from_rpc_error(exc, f"{method} on TaskManager {address}")
                if first and isinstance(error, (StaleRoutingError, UnavailableError)) and attempt < self.settings.max_attempts:
                    time.sleep(self.settings.backoff_s)
                    continue
                raise error from exc

    def subtask_of(self, job_id: str, operator_id: str, key: bytes) -> int:
        routing = self.routing(job_id)
        routes = routing.operator(operator_id)
        return routes.subtask_of[(_xxh64(key, HASH_SEED) & 0xFFFFFFFF) % routing.max_parallelism]

    def close(self) -> None:
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
            self._stubs.clear()
        for c in channels:
            c.close()
        self._jm_channel.close()

    def __enter__(self) -> StateClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_lengths(what: str, **columns: Iterable[Any]) -> None:
    sizes = {name: len(col) for name, col in columns.items()}  # type: ignore[arg-type]
    if len(set(sizes.values())) > 1:
        detail = ", ".join(f"{n}={s}" for n, s in sizes.items())
        raise InvalidArgumentError(f"{what}: the columns must have equal lengths ({detail})")
