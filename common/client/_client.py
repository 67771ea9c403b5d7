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
from keyedstate.common.client._routing import Routing
from keyedstate.common.config import Configuration, options as o
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor
from keyedstate.common.errors import (
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
# ListUpdate replaces each key's whole list with the values given for it, so one key's values
# must travel in one request.
UNSPLITTABLE = frozenset({"ListUpdate"})

Part = list[int] | range | None
"""The keys of one request: positions in the call's key list, a contiguous range, or None (all)."""


@dataclass
class _Lane:
    """The requests still to send to one subtask, and how many of its requests are in flight."""

    target: tm_pb.StateTarget
    address: str
    call: Any
    parts: deque[Any]
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

    Our servers validate a whole batch before writing, and only answer with a reason after
    deciding not to apply it; a bare transport error leaves the outcome unknown.
    """
    try:
        return any(k == REASON_KEY for k, _ in (err.trailing_metadata() or ()))
    except Exception:
        return False


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

    def trigger_checkpoint(self, job_id: str, *, savepoint: bool = False, target_directory: str = "",
                           wait: bool = True, timeout_s: float = 600.0) -> jm_pb.CheckpointInfo:
        return self._jm_call("TriggerCheckpoint", jm_pb.TriggerCheckpointRequest(
            job_id=job_id, savepoint=savepoint, target_directory=target_directory, wait=wait,
            timeout_ms=int(timeout_s * 1000),
        ), timeout=timeout_s + 30, retry=False)

    def commit_epoch(
        self,
        job_id: str,
        epoch: int,
        winners: dict[int, int],
        *,
        checkpoint: bool = True,
        wait_for_checkpoint: bool = True,
        expected_routing_version: int = 0,
        timeout_s: float = 600.0,
    ) -> jm_pb.CommitEpochResponse:
        """Commit ``epoch`` with the winning attempt of each partition (``{partition: attempt}``).

        Safe to call again: an already committed epoch is acknowledged without effect.
        """
        request = jm_pb.CommitEpochRequest(
            job_id=job_id, epoch=epoch, checkpoint=checkpoint, wait_for_checkpoint=wait_for_checkpoint,
            expected_routing_version=expected_routing_version,
            winners=[pb.PartitionAttempt(partition=p, attempt=a) for p, a in sorted(winners.items())],
        )
        return self._jm_call("CommitEpoch", request, timeout=timeout_s)

    def routing(self, job_id: str, refresh: bool = False) -> Routing:
        routing = self._routing.get(job_id)
        if routing is None or refresh:
            table = self._jm_call("GetRouting", jm_pb.GetRoutingRequest(job_id=job_id))
            routing = self._store_routing(table)
        return routing

    def _store_routing(self, table: pb.RoutingTable) -> Routing:
        routing = Routing.from_proto(table)
        with self._lock:
            current = self._routing.get(routing.job_id)
            if current is None or routing.version >= current.version or routing.job_status != current.job_status:
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
        epoch: pb.EpochContext | None = None,
    ) -> list[tuple[Part, Any]]:
        """Send one logical batch: group keys by owning subtask, split into requests, pipeline them.

        ``build(target, indices)`` makes the request for the keys at ``indices``: None = all keys
        (every key has the same owner), a ``range`` = a contiguous slice, or a list of positions.
        Returns (indices, response) pairs.
        Idempotent methods are retried on UNAVAILABLE and stale routing; others only when the
        server answered that it applied nothing.
        """
        if not keys:
            return []
        idempotent = method in IDEMPOTENT
        # Requests of one subtask may overtake each other in flight; that is harmless for reads and
        # for writes that touch every key once (checked on the whole call, conservatively per key).
        order_free = method in READS or (len(keys) <= self.settings.batch_size) or len(set(keys)) == len(keys)
        attempts = self.settings.max_attempts
        delay = self.settings.backoff_s
        pending: list[Part] | None = None  # None: first round, everything
        results: list[tuple[Part, Any]] = []
        refresh = False
        for attempt in range(1, attempts + 1):
            routing = self.routing(job_id, refresh=refresh)
            if routing.job_status not in ("RUNNING", ""):
                if routing.job_status in ("FAILED", "CANCELED"):
                    raise KeyedStateError(f"job {job_id!r} is {routing.job_status}", reason=Reason.JOB_NOT_RUNNING)
                failed_groups = pending
                error: KeyedStateError = UnavailableError(f"job {job_id!r} is {routing.job_status}")
            else:
                groups = self._group(routing, operator_id, keys, pending)
                sent, failed_groups, error = self._send_groups(
                    routing, operator_id, state, method, groups, build, epoch, idempotent, len(keys), order_free
                )
                results.extend(sent)
                if not failed_groups:
                    return results
            if attempt == attempts:
                raise error
            logger.debug("retrying %s of %s/%s after %s (attempt %d)", method, job_id, operator_id, error.message, attempt)
            pending = failed_groups
            refresh = True
            if not isinstance(error, StaleRoutingError):
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")

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

    def _send_groups(
        self,
        routing: Routing,
        operator_id: str,
        state: str,
        method: str,
        groups: dict[int, Part],
        build: Callable[[tm_pb.StateTarget, Part], tm_pb.KeyedRequest],
        epoch: pb.EpochContext | None,
        idempotent: bool,
        n_keys: int,
        order_free: bool,
    ) -> tuple[list[tuple[Part, Any]], list[Part], KeyedStateError]:
        """Pipeline the requests of every subtask; returns (answers, parts to retry, last error).

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
        lanes: list[_Lane] = []
        for subtask, indices in groups.items():
            target = tm_pb.StateTarget(
                job_id=routing.job_id, operator_id=operator_id, subtask_index=subtask, state_name=state,
                routing_version=routing.version, epoch=epoch,
            )
            address = routes.addresses[subtask]
            lanes.append(_Lane(target, address, getattr(self._stub(address), method),
                               deque(self._split(method, indices, n_keys))))
        sent: list[tuple[Part, Any]] = []
        failed: list[Part] = []
        last_error: KeyedStateError = UnavailableError("no error")
        in_flight: deque[tuple[_Lane, Part, Any]] = deque()

        def drain_one() -> None:
            nonlocal last_error
            lane, indices, future = in_flight.popleft()
            lane.in_flight -= 1
            try:
                sent.append((indices, future.result()))
            except grpc.RpcError as exc:
                error = from_rpc_error(exc, f"{method} on TaskManager {lane.address}")
                retryable = isinstance(error, (StaleRoutingError, UnavailableError))
                if retryable and (idempotent or _not_applied(exc)):
                    failed.append(indices)
                    failed.extend(lane.parts)  # never sent, so certainly not applied
                    lane.parts.clear()
                    last_error = error
                    return
                for _lane, _part, f in in_flight:  # the caller gets the error now; stop the rest
                    f.cancel()
                if retryable:
                    raise UnavailableError(
                        f"{error.message}. The outcome of this {method} is unknown (the TaskManager may have applied "
                        "it), so it was not retried; use epoch transactions for exactly-once updates"
                    ) from exc
                raise error from exc

        while True:
            for lane in lanes:
                while lane.parts and lane.in_flight < per_subtask:
                    indices = lane.parts.popleft()
                    in_flight.append((lane, indices, lane.call.future(build(lane.target, indices), timeout=timeout)))
                    lane.in_flight += 1
            if not in_flight:
                return sent, failed, last_error
            drain_one()

    def stream_call(self, job_id: str, operator_id: str, method: str, subtask: int, request: tm_pb.ScanRequest) -> Iterator[tm_pb.ScanChunk]:
        """A server-streaming scan of one subtask (retries before the first chunk only)."""
        for attempt in range(1, self.settings.max_attempts + 1):
            routing = self.routing(job_id, refresh=attempt > 1)
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
