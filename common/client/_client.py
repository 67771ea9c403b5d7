"""The executor client: talks to the JobManager for routing and to TaskManagers for state.

One :class:`StateClient` per process is enough (Spark reuses Python workers, so a module-level
client keeps its channels warm); it is thread-safe.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import grpc
import xxhash

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common._proto.v1 import jobmanager_pb2_grpc as jm_grpc
from keyedstate.common._proto.v1 import taskmanager_pb2 as tm_pb
from keyedstate.common._proto.v1 import taskmanager_pb2_grpc as tm_grpc
from keyedstate.common.auth import resolve_token, token_from_config
from keyedstate.common.batches import Winner
from keyedstate.common.claim_mode import RecoveryClaimMode
from keyedstate.common.client._batch import BatchStart, EpochCommitted, JobProgress
from keyedstate.common.client._epoch import EpochScope, as_scope
from keyedstate.common.client._routing import Limits, Routing
from keyedstate.common.client._wire import (
    COLUMNAR,
    batch_start_from_proto,
    epoch_committed_from_proto,
    job_progress_from_proto,
    keyed_request,
)
from keyedstate.common.clock import SYSTEM_CLOCK, Clock
from keyedstate.common.config import Configuration
from keyedstate.common.config import options as o
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor
from keyedstate.common.errors import (
    BatchOutcome,
    EpochConflictError,
    InvalidArgumentError,
    JobStateError,
    KeyedStateError,
    NotFoundError,
    Reason,
    SizeLimitError,
    StaleRoutingError,
    UnavailableError,
)
from keyedstate.common.ids import JobId, OperatorId
from keyedstate.common.keygroups import HASH_SEED
from keyedstate.common.retry import RetryPolicy, Waiter, call_with_retries
from keyedstate.common.rpc.channels import open_channel
from keyedstate.common.rpc.convert import winner_to_proto
from keyedstate.common.rpc.descriptors import operator_spec_to_proto, state_descriptor_from_proto
from keyedstate.common.rpc.enums import value_of
from keyedstate.common.rpc.status import REASON_KEY, from_rpc_error
from keyedstate.common.security.tls import REST, ChannelSecurity
from keyedstate.common.security.transport import TransportSecurity

logger = logging.getLogger(__name__)

_xxh64 = xxhash.xxh64_intdigest

Req = TypeVar("Req")
Resp = TypeVar("Resp")
_ReqIn = TypeVar("_ReqIn", contravariant=True)
_RespOut = TypeVar("_RespOut", covariant=True)


class _UnaryCall(Protocol[_ReqIn, _RespOut]):
    """A unary stub method as the client calls it: the generated stubs type each one with its messages,
    so a call's response type follows from the method passed in."""

    def __call__(self, request: _ReqIn, timeout: float | None = ...) -> _RespOut: ...


# Calls whose second application changes nothing: retried after any transport failure.
IDEMPOTENT = frozenset(
    {
        "ValueGet",
        "ValuePut",
        "Clear",
        "ListGet",
        "ListUpdate",
        "MapPut",
        "MapGet",
        "MapRemove",
        "MapContains",
        "ListScan",
        "MapScan",
        "ScanKeys",
    }
)
_TERMINAL = frozenset({"FAILED", "CANCELED"})
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


@dataclass
class _Ledger:
    """What became of the requests of one direct write call, across its rounds of retries."""

    applied: list[_Unit] = field(default_factory=list)
    unknown: list[_Unit] = field(default_factory=list)
    """Requests that got no answer (or one that did not rule out having applied them)."""
    sent: bool = False
    requests: int = 0


# The TaskManager's unary keyed methods, by name: the stub method each name calls (typed, no getattr).
_KEYED_RPCS: dict[str, Callable[[tm_grpc.KeyedStateStub], grpc.UnaryUnaryMultiCallable[Any, Any]]] = {
    "ValueGet": lambda stub: stub.ValueGet,
    "ValuePut": lambda stub: stub.ValuePut,
    "Clear": lambda stub: stub.Clear,
    "Reduce": lambda stub: stub.Reduce,
    "ListAppend": lambda stub: stub.ListAppend,
    "ListGet": lambda stub: stub.ListGet,
    "ListUpdate": lambda stub: stub.ListUpdate,
    "MapPut": lambda stub: stub.MapPut,
    "MapGet": lambda stub: stub.MapGet,
    "MapRemove": lambda stub: stub.MapRemove,
    "MapContains": lambda stub: stub.MapContains,
}
# ... and its streaming scans.
_SCAN_RPCS: dict[str, Callable[[tm_grpc.KeyedStateStub], grpc.UnaryStreamMultiCallable[Any, Any]]] = {
    "ListScan": lambda stub: stub.ListScan,
    "MapScan": lambda stub: stub.MapScan,
    "ScanKeys": lambda stub: stub.ScanKeys,
}


def _keyed_rpc(
    method: str,
) -> Callable[[tm_grpc.KeyedStateStub], grpc.UnaryUnaryMultiCallable[Any, Any]]:
    rpc = _KEYED_RPCS.get(method)
    if rpc is None:
        raise InvalidArgumentError(f"{method!r} is not a keyed method of the TaskManager ({', '.join(_KEYED_RPCS)})")
    return rpc


@dataclass
class _Call:
    """One keyed call across its rounds: what it sends, how it may be retried, and where it stands."""

    job_id: str
    operator_id: str
    state: str
    method: str
    keys: list[bytes]
    build: Callable[[tm_pb.StateTarget, Part], tm_pb.KeyedRequest] | None
    """A caller's own request builder (always wire version 1); None: built here from keys and columns."""
    scope: EpochScope | None
    columns: Mapping[str, Sequence[bytes]]
    namespace: bytes
    return_values: bool
    rpc: Callable[[tm_grpc.KeyedStateStub], grpc.UnaryUnaryMultiCallable[Any, Any]]
    pinned: bool
    """Inside an epoch scope with a pinned routing version: every round goes out under that version."""
    numbered: bool
    """Epoch writes: each request carries a sequence number the slot stages once."""
    idempotent: bool
    order_free: bool
    """Requests of one subtask may overtake each other in flight (see :meth:`plan`)."""
    ledger: _Ledger | None
    refresh: bool
    pending: list[_Unit] | None = None
    """The requests the next round sends again; None: the first round, everything."""
    sent_under: int = -1
    """The routing version the pending units were built for."""
    sent_with: Routing | None = None
    """The routing the latest requests were sent under."""
    results: list[tuple[Part, Any]] = field(default_factory=list)

    @classmethod
    def plan(
        cls,
        job_id: str,
        operator_id: str,
        state: str,
        method: str,
        keys: list[bytes],
        build: Callable[[tm_pb.StateTarget, Part], tm_pb.KeyedRequest] | None,
        scope: EpochScope | None,
        columns: Mapping[str, Sequence[bytes]],
        namespace: bytes,
        batch_size: int,
        *,
        refresh: bool,
        return_values: bool = False,
    ) -> _Call:
        pinned = scope is not None and scope.routing_version > 0
        numbered = scope is not None and scope.numbered and method in WRITES
        return cls(
            job_id,
            operator_id,
            state,
            method,
            keys,
            build,
            scope,
            columns,
            namespace,
            return_values,
            _keyed_rpc(method),
            pinned=pinned,
            numbered=numbered,
            idempotent=method in IDEMPOTENT or (numbered and pinned),
            # Harmless for reads and for writes that touch every key once (checked on the whole
            # call, conservatively per key).
            order_free=method in READS or len(keys) <= batch_size or len(set(keys)) == len(keys),
            # Direct writes account for every request, to say exactly what a failure left applied.
            # (Epoch writes are only staged: a failed task's attempt is never committed.)
            ledger=_Ledger() if scope is None and method in WRITES else None,
            refresh=refresh,
        )

    def request_for(self, target: tm_pb.StateTarget, unit: _Unit, columnar: bool) -> tuple[tm_pb.KeyedRequest, bool]:
        """Build the request of ``unit`` (an epoch write's target carries its sequence number); packed when
        ``columnar`` (the TaskManager speaks wire version 2) and the columns are built here. Also says
        whether it went packed."""
        if unit.seq:
            assert self.scope is not None
            numbered = tm_pb.StateTarget()
            numbered.CopyFrom(target)
            numbered.epoch.CopyFrom(self.scope.context_for(unit.seq))
            target = numbered
        if self.build is not None:
            return self.build(target, unit.part), False
        part = unit.part
        columns = {name: _pick(column, part) for name, column in self.columns.items()}
        request = keyed_request(
            target,
            _pick(self.keys, part),
            columns,
            self.namespace,
            return_values=self.return_values,
            packed=columnar,
        )
        return request, columnar


def _pick(column: Sequence[bytes], part: Part) -> Sequence[bytes]:
    """The items of ``column`` at the positions of ``part``."""
    if part is None:
        return column
    if type(part) is range:
        return column[part.start : part.stop]
    return [column[i] for i in part]


class _WireVersions:
    """Which TaskManagers answered with the columnar wire (version 2), and under which routing version.

    A client sends packed columns to an address only after a TaskManager there advertised version
    2 under the routing version the request is sent with. A TaskManager of version 1 would ignore
    the packed fields and see an empty batch; since every (re)started TaskManager process gets its
    slots deployed under a new routing version, and a request under an older version is refused
    as stale before anything applies, packed requests never reach a process that did not advertise.
    """

    def __init__(self) -> None:
        self._columnar: dict[str, int] = {}  # address -> routing version (single assignments: thread-safe)

    def columnar(self, address: str, routing_version: int) -> bool:
        return self._columnar.get(address) == routing_version

    def answered(self, address: str, routing_version: int, wire_version: int) -> None:
        if wire_version >= COLUMNAR:
            self._columnar[address] = routing_version


class _Pipeline:
    """One round of a keyed call: the requests of every subtask, pipelined; (answers, units to retry, last error).

    Each request is built just before it is sent, so encoding the next batch overlaps the
    TaskManager applying the previous one. Up to ``max_in_flight`` requests per subtask are
    in flight when their order cannot matter (reads, or writes whose keys are all distinct);
    otherwise one at a time, so a repeated key's writes apply in the caller's order. After a
    retryable failure a subtask sends nothing more: its remaining requests are retried in
    order with the failed one.

    With a ledger (direct writes) a failure that ends the call stops sending, but the requests
    already in flight are waited for instead of cancelled: the ledger then knows which were
    applied, and the error raised at the end can say so.
    """

    def __init__(
        self,
        routing: Routing,
        call: _Call,
        units: list[_Unit],
        stub_for: Callable[[str], tm_grpc.KeyedStateStub],
        suspect: set[str],
        settings: ClientSettings,
        wire: _WireVersions,
    ) -> None:
        self._routing = routing
        self._wire = wire
        self._call = call
        self._suspect = suspect
        self._per_subtask = settings.max_in_flight if call.order_free else 1
        self._timeout = settings.timeout_s
        self._lanes = self._make_lanes(units, stub_for)
        self._sent: list[tuple[Part, Any]] = []
        self._failed: list[_Unit] = []
        self._last_error: KeyedStateError = UnavailableError("no error")
        self._fatal: list[tuple[KeyedStateError, grpc.RpcError]] = []  # the failure that ends the call (ledger only)
        self._in_flight: deque[tuple[_Lane, _Unit, Any, bool]] = deque()

    def _make_lanes(self, units: list[_Unit], stub_for: Callable[[str], tm_grpc.KeyedStateStub]) -> dict[int, _Lane]:
        routing, call = self._routing, self._call
        routes = routing.operator(call.operator_id)
        context = call.scope.context if call.scope is not None else None
        lanes: dict[int, _Lane] = {}
        for unit in units:
            lane = lanes.get(unit.subtask)
            if lane is None:
                target = tm_pb.StateTarget(
                    job_id=routing.job_id,
                    operator_id=call.operator_id,
                    subtask_index=unit.subtask,
                    state_name=call.state,
                    routing_version=routing.version,
                    epoch=context,
                )
                address = routes.addresses[unit.subtask]
                lane = lanes[unit.subtask] = _Lane(target, address, call.rpc(stub_for(address)), deque())
            lane.parts.append(unit)
        return lanes

    def run(self) -> tuple[list[tuple[Part, Any]], list[_Unit], KeyedStateError]:
        ledger, in_flight = self._call.ledger, self._in_flight
        while True:
            for lane in self._lanes.values():
                while lane.parts and lane.in_flight < self._per_subtask:
                    unit = lane.parts.popleft()
                    columnar = self._wire.columnar(lane.address, self._routing.version)
                    request, packed = self._call.request_for(lane.target, unit, columnar)
                    in_flight.append((lane, unit, lane.call.future(request, timeout=self._timeout), packed))
                    lane.in_flight += 1
                    if ledger is not None:
                        ledger.requests += 1
            if not in_flight:
                if self._fatal:
                    error, cause = self._fatal[0]
                    raise error from cause
                return self._sent, self._failed, self._last_error
            self._drain_one()

    def _drain_one(self) -> None:
        call, ledger = self._call, self._call.ledger
        lane, unit, future, packed = self._in_flight.popleft()
        lane.in_flight -= 1
        if ledger is not None:
            ledger.sent = True
        try:
            response = future.result()
        except grpc.RpcError as exc:
            self._failed_request(lane, unit, exc)
            return
        if packed and response.wire_version < COLUMNAR:
            # Cannot happen (see _WireVersions); if it did, the TaskManager saw an empty batch.
            raise KeyedStateError(
                f"{call.method} on TaskManager {lane.address}: it answered a columnar request without the columnar "
                "wire version, so it read none of the request's keys; upgrade it or report this",
                reason=Reason.INTERNAL,
            )
        self._wire.answered(lane.address, self._routing.version, response.wire_version)
        self._sent.append((unit.part, response))
        if ledger is not None:
            ledger.applied.append(unit)
        if unit.seq and call.scope is not None:
            call.scope.acknowledged(call.operator_id, unit.subtask, unit.seq)

    def _cancel_in_flight(self) -> None:
        for _lane, _unit, future, _packed in self._in_flight:
            future.cancel()

    def _failed_request(self, lane: _Lane, unit: _Unit, exc: grpc.RpcError) -> None:
        call, ledger, method = self._call, self._call.ledger, self._call.method
        error = from_rpc_error(exc, f"{method} on TaskManager {lane.address}")
        if call.pinned and isinstance(error, StaleRoutingError):
            self._cancel_in_flight()
            raise EpochConflictError(
                f"{error.message}. The batch's routing version v{self._routing.version} is no longer the slot's, so "
                "this task's writes cannot be committed; the batch must run again"
            ) from exc
        if ledger is not None and not _not_applied(exc):
            ledger.unknown.append(unit)  # until a retry applies it
        retryable = isinstance(error, (StaleRoutingError, UnavailableError))
        if not self._fatal and retryable and (call.idempotent or _not_applied(exc)):
            self._failed.append(unit)
            self._failed.extend(lane.parts)  # never sent, so certainly not applied
            lane.parts.clear()
            self._last_error = error
            return
        if retryable:
            self._suspect.add(self._routing.job_id)  # the owner may be gone: the next call fetches the table
            error = UnavailableError(
                f"{error.message}. The outcome of this {method} is unknown (the TaskManager may have applied "
                "it), so it was not retried; use epoch transactions for exactly-once updates"
            )
        if ledger is None:
            self._cancel_in_flight()  # the caller gets the error now; stop the rest
            raise error from exc
        if not self._fatal:
            self._fatal.append((error, exc))
            for other in self._lanes.values():  # send nothing more; learn what the requests in flight did
                other.parts.clear()


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
        """Settings from the ``client.*`` options and ``rpc`` message size (milliseconds become seconds)."""
        return cls(
            timeout_s=conf.get(o.CLIENT_TIMEOUT) / 1000.0,
            max_attempts=conf.get(o.CLIENT_RETRIES),
            backoff_s=conf.get(o.CLIENT_RETRY_BACKOFF) / 1000.0,
            batch_size=conf.get(o.CLIENT_BATCH_SIZE),
            max_in_flight=conf.get(o.CLIENT_MAX_IN_FLIGHT),
            max_message_bytes=conf.get(o.RPC_MAX_MESSAGE),
        )


def client_security(conf: Configuration) -> ChannelSecurity | None:
    """The client side of the rest plane from security.ssl.rest.* (None: TLS is off); checks the files now."""
    return TransportSecurity.from_config(conf, role="client").channel_security(REST)


class _RoundFailed(Exception):
    """Internal: some requests of a keyed call failed retryably; the next round sends them again."""

    def __init__(self, error: KeyedStateError) -> None:
        super().__init__(error.message)
        self.error = error


def _is_round_failure(exc: BaseException) -> bool:
    return isinstance(exc, _RoundFailed)


def _is_stale_round(exc: BaseException) -> bool:
    """A stale routing is retried at once: the retry fetches the new table itself, there is nothing to wait for."""
    return isinstance(exc, _RoundFailed) and isinstance(exc.error, StaleRoutingError)


def _is_unavailable(exc: BaseException) -> bool:
    return isinstance(exc, UnavailableError)


def _is_retryable_stream_error(exc: BaseException) -> bool:
    return isinstance(exc, (StaleRoutingError, UnavailableError))


_ONCE = RetryPolicy(max_attempts=1, jitter=0.0)


def _not_applied(err: grpc.RpcError) -> bool:
    """True when the server guarantees the call changed nothing (it answered with our reason header).

    Our servers validate a whole batch before writing, and answer with a reason after deciding
    not to apply it, except OUTCOME_UNKNOWN (the call may have applied); a bare transport error
    leaves the outcome unknown.
    """
    trailing_metadata: Callable[[], Any] | None = getattr(err, "trailing_metadata", None)  # a grpc.Call's
    try:
        reasons = [v for k, v in ((trailing_metadata() if trailing_metadata else None) or ()) if k == REASON_KEY]
    except Exception:
        return False
    return bool(reasons) and Reason.OUTCOME_UNKNOWN.value not in reasons


class StateClient:
    """Routes keyed-state calls of one or more jobs to the TaskManagers that own the keys."""

    def __init__(
        self,
        jobmanager_address: str,
        settings: ClientSettings | None = None,
        security: ChannelSecurity | None = None,
        *,
        token: str | None = None,
        clock: Clock = SYSTEM_CLOCK,
        waiter: Waiter | None = None,
    ) -> None:
        """``security``: TLS for every channel (None: plaintext); :meth:`from_config` builds it from the
        security.ssl.rest.* keys, :meth:`ChannelSecurity.from_pem` from PEM bytes.

        ``token``: sent with every call (security.auth.enabled). None: the token of this process's
        environment, from the file named by ``KEYEDSTATE_TOKEN_FILE`` or from ``KEYEDSTATE_TOKEN``
        (none there: calls carry no token).

        ``clock`` and ``waiter`` time the retries (tests inject fakes); the default waiter is
        released by :meth:`close`, so a retry waiting out its backoff ends when the client closes."""
        self.jobmanager_address = jobmanager_address
        self.settings = settings or ClientSettings()
        self._clock = clock
        self._closing = threading.Event()
        self._waiter: Waiter = waiter if waiter is not None else self._closing
        # The client's backoff: doubling from backoff_s up to 5 s, exact (no jitter), as it always was.
        self._retry_policy = RetryPolicy(
            max_attempts=self.settings.max_attempts,
            initial_backoff_s=self.settings.backoff_s,
            max_backoff_s=5.0,
            multiplier=2.0,
            jitter=0.0,
        )
        self.security = security
        self._token = token if token is not None else resolve_token()
        self._jm_channel = open_channel(
            jobmanager_address, self.settings.max_message_bytes, security=security, token=self._token
        )
        self.jobmanager = jm_grpc.JobManagerStub(self._jm_channel)
        self._stubs: dict[str, tm_grpc.KeyedStateStub] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._routing: dict[str, Routing] = {}
        self._suspect: set[str] = set()
        """Jobs whose cached table may name a dead owner: a call failed with an unknown outcome, which is not
        retried, so nothing else would fetch the table again and every later call would go to that address."""
        self._descriptors: dict[tuple[str, str, str], StateDescriptor] = {}
        self._wire = _WireVersions()
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_config(cls, conf: Configuration) -> StateClient:
        """A client for the JobManager the configuration names, with its TLS and token; close it after use."""
        address = f"{conf.get(o.JOBMANAGER_ADDRESS)}:{conf.get(o.JOBMANAGER_PORT)}"
        return cls(address, ClientSettings.from_config(conf), client_security(conf), token=token_from_config(conf))

    # -- JobManager calls --------------------------------------------------------------------
    def _jm_call(
        self,
        name: str,
        rpc: _UnaryCall[Req, Resp],
        request: Req,
        *,
        timeout: float | None = None,
        retry: bool = True,
    ) -> Resp:
        """Call JobManager method ``name`` (``rpc`` is its stub method); UNAVAILABLE is retried with ``retry``."""
        what = f"JobManager {self.jobmanager_address} {name}"
        call_timeout = timeout or self.settings.timeout_s

        def attempt() -> Resp:
            try:
                return rpc(request, timeout=call_timeout)
            except grpc.RpcError as exc:
                raise from_rpc_error(exc, what) from exc

        return call_with_retries(
            attempt,
            what=what,
            policy=self._retry_policy if retry else _ONCE,
            waiter=self._waiter,
            is_transient=_is_unavailable,
            clock=self._clock,
            log_level=logging.DEBUG,
        )

    def submit_job(
        self,
        job_id: JobId | str,
        operators: Sequence[OperatorSpec],
        *,
        max_parallelism: int = 0,
        restore_path: str = "",
        config: dict[str, str] | None = None,
    ) -> Routing:
        """Register (or re-attach to) a job; returns its routing. Submitting the same job again is a no-op."""
        table: pb.RoutingTable = self._jm_call(
            "SubmitJob",
            self.jobmanager.SubmitJob,
            jm_pb.SubmitJobRequest(
                job_id=job_id,
                operators=[operator_spec_to_proto(op) for op in operators],
                max_parallelism=max_parallelism,
                restore_path=restore_path,
                config={k: str(v) for k, v in (config or {}).items()},
            ),
            timeout=max(self.settings.timeout_s, 600.0),
        )
        return self._store_routing(table)

    def restore_job(
        self, job_id: JobId | str, restore_path: str, *, claim_mode: RecoveryClaimMode | str | None = None
    ) -> Routing:
        """Replace the state of job ``job_id`` with the checkpoint or savepoint at ``restore_path``.

        The JobManager verifies the source in full before it touches the job, so a bad path or a
        damaged checkpoint leaves the job as it was; a running job whose redeploy fails comes back
        as it was (see ``statectl job restore`` in the README). Not retried: the answer says what happened.

        ``claim_mode`` (``CLAIM`` or ``NO_CLAIM``; None: the job's ``execution.state-recovery.claim-mode``,
        NO_CLAIM by default) says who owns the source's files afterwards: CLAIM lets the job delete
        them once subsumed (and reference them, when the source is a checkpoint of the job's own
        directory); NO_CLAIM leaves them to the user, and the job's first checkpoint after the
        restore is a full one.
        """
        mode = RecoveryClaimMode.parse(claim_mode, "claim_mode") if claim_mode is not None else None
        table: pb.RoutingTable = self._jm_call(
            "RestoreJob",
            self.jobmanager.RestoreJob,
            jm_pb.RestoreJobRequest(
                job_id=job_id,
                restore_path=restore_path,
                claim_mode=value_of(jm_pb.RecoveryClaimMode, mode.value if mode is not None else ""),
            ),
            timeout=max(self.settings.timeout_s, 600.0),
            retry=False,
        )
        return self._store_routing(table, fetched=True)

    def rescale_job(self, job_id: JobId | str, parallelism: int, *, timeout_s: float | None = None) -> Routing:
        """Run every operator of ``job_id`` at ``parallelism``; the job's new routing.

        The JobManager refuses a rescale the cluster has no slots for before it stops anything.
        Not retried: the answer says what happened. The routing is returned, not cached: this
        client's calls go on under the table they know until a slot refuses it.
        """
        table: pb.RoutingTable = self._jm_call(
            "RescaleJob",
            self.jobmanager.RescaleJob,
            jm_pb.RescaleJobRequest(job_id=job_id, parallelism={"": parallelism}),
            timeout=timeout_s,
            retry=False,
        )
        return Routing.from_proto(table)

    def cancel_job(self, job_id: JobId | str) -> jm_pb.JobInfo:
        """Cancel ``job_id``; its slots are released and its routing fails calls until it is restored."""
        result: jm_pb.JobInfo = self._jm_call("CancelJob", self.jobmanager.CancelJob, jm_pb.JobRequest(job_id=job_id))
        return result

    def job_info(self, job_id: JobId | str) -> jm_pb.JobInfo:
        """The JobManager's view of ``job_id``: status, operators, declared states, latest checkpoint, restarts."""
        result: jm_pb.JobInfo = self._jm_call("GetJob", self.jobmanager.GetJob, jm_pb.JobRequest(job_id=job_id))
        return result

    def job_progress(self, job_id: JobId | str) -> JobProgress:
        """The job's status and epochs from the JobManager (one GetJob call): what a driver steers by."""
        return job_progress_from_proto(self.job_info(job_id))

    def list_checkpoints(self, job_id: JobId | str, *, retry: bool = True) -> jm_pb.ListCheckpointsResponse:
        """The checkpoints and savepoints the JobManager remembers for ``job_id`` (completed, failed, in progress)."""
        result: jm_pb.ListCheckpointsResponse = self._jm_call(
            "ListCheckpoints", self.jobmanager.ListCheckpoints, jm_pb.JobRequest(job_id=job_id), retry=retry
        )
        return result

    def cluster(self) -> jm_pb.ClusterOverview:
        """TaskManagers, slots and jobs, as the JobManager sees them now."""
        result: jm_pb.ClusterOverview = self._jm_call(
            "GetClusterOverview", self.jobmanager.GetClusterOverview, jm_pb.ClusterOverviewRequest()
        )
        return result

    def wait_for_taskmanagers(self, count: int, *, slots: int = 0, timeout_s: float = 60.0) -> jm_pb.ClusterOverview:
        """Wait until ``count`` TaskManagers (and at least ``slots`` slots) are registered; the cluster then.

        The documented way for a program or script to know a cluster is ready before it submits
        a job (``statectl cluster --wait N`` does the same from a shell). Raises UnavailableError
        naming what is missing after ``timeout_s``.
        """
        progress = {
            "last": "the JobManager did not answer",
            "fix": f"check that a JobManager runs at {self.jobmanager_address}",
        }

        def ready() -> jm_pb.ClusterOverview:
            overview: jm_pb.ClusterOverview = self._jm_call(
                "GetClusterOverview", self.jobmanager.GetClusterOverview, jm_pb.ClusterOverviewRequest(), retry=False
            )
            active = [t for t in overview.taskmanagers if t.status == jm_pb.TASK_MANAGER_STATUS_ACTIVE]
            if len(active) >= count and overview.total_slots >= slots:
                return overview
            last = f"{len(active)} of {count} TaskManagers are registered"
            if slots:
                last += f", with {overview.total_slots} of {slots} slots"
            progress["last"] = last
            progress["fix"] = "start more TaskManagers (pointed at this JobManager), or wait longer"
            raise UnavailableError(last)

        def not_ready(exc: BaseException) -> bool:
            if isinstance(exc, UnavailableError) and exc.message != progress["last"]:
                progress["last"] = exc.message  # the JobManager's own answer
            return isinstance(exc, UnavailableError)

        poll = RetryPolicy.polling(0.1, deadline_s=timeout_s)
        try:
            return call_with_retries(
                ready,
                what=f"waiting for {count} TaskManagers",
                policy=poll,
                waiter=self._waiter,
                is_transient=not_ready,
                clock=self._clock,
                log_level=logging.DEBUG,
            )
        except UnavailableError:
            raise UnavailableError(
                f"the cluster at {self.jobmanager_address} was not ready within {timeout_s:.0f} s: "
                f"{progress['last']}; {progress['fix']}"
            ) from None

    def wait_for_applied(
        self, job_id: JobId | str, epoch: int | None = None, *, timeout_s: float = 60.0
    ) -> JobProgress:
        """Wait until reads outside an epoch see ``epoch`` (default: the epoch the job has committed now).

        With overlapped commits a batch's apply runs after ``foreachBatch`` returned, so a driver,
        a script or ``statectl`` reading state right after a query ended may not see the last
        batch yet. This returns (the job's progress then) once every slot applied the epoch: a
        read issued afterwards sees it, and every epoch before it, across all states. Raises
        JobStateError when the job failed or was cancelled first, InvalidArgumentError for an
        epoch the job has not committed, UnavailableError naming the applied epoch after ``timeout_s``.
        """
        wanted: list[int] = [] if epoch is None else [epoch]  # the committed epoch at the first answer
        progress = {"last": "the JobManager did not answer"}

        def applied() -> JobProgress:
            info = self.job_progress(job_id)
            if not wanted:
                wanted.append(info.committed_epoch)
            target = wanted[0]
            if target > info.committed_epoch:
                raise InvalidArgumentError(
                    f"job {job_id!r} has committed epoch {info.committed_epoch}, not {target}: wait for an epoch "
                    "the job has committed (JobProgress.committed_epoch)"
                )
            if info.status is not None and info.status.terminal:
                raise JobStateError(
                    f"job {job_id!r} is {info.status.value} with epoch {info.applied_epoch} of {target} applied: "
                    f"{info.failure_cause or 'no cause given'}"
                )
            if info.applied_epoch >= target:
                return info
            status = info.status.value if info.status is not None else "in an unknown status"
            progress["last"] = f"epoch {info.applied_epoch} of {target} applied, job {status}"
            raise UnavailableError(progress["last"])

        try:
            return call_with_retries(
                applied,
                what=f"waiting for job {job_id!r} to apply its epochs",
                policy=RetryPolicy.polling(0.05, deadline_s=timeout_s),
                waiter=self._waiter,
                is_transient=lambda exc: isinstance(exc, UnavailableError),
                clock=self._clock,
                log_level=logging.DEBUG,
            )
        except UnavailableError:
            raise UnavailableError(
                f"job {job_id!r} did not apply epoch {wanted[0] if wanted else '?'} within {timeout_s:.0f} s ({progress['last']}); a "
                "restarting job applies it once its slots are restored: wait longer, or see statectl job info"
            ) from None

    def trigger_checkpoint(
        self,
        job_id: JobId | str,
        *,
        savepoint: bool = False,
        target_directory: str = "",
        wait: bool = True,
        timeout_s: float = 600.0,
    ) -> jm_pb.CheckpointInfo:
        """Trigger a checkpoint (or a savepoint into ``target_directory``); with ``wait``, answer once it ended.

        Not retried: a second trigger would start a second checkpoint.
        """
        result: jm_pb.CheckpointInfo = self._jm_call(
            "TriggerCheckpoint",
            self.jobmanager.TriggerCheckpoint,
            jm_pb.TriggerCheckpointRequest(
                job_id=job_id,
                savepoint=savepoint,
                target_directory=target_directory,
                wait=wait,
                timeout_ms=int(timeout_s * 1000),
            ),
            timeout=timeout_s + 30,
            retry=False,
        )
        return result

    def begin_batch(self, job_id: JobId | str, query_id: str, batch_id: int) -> BatchStart:
        """Where batch ``batch_id`` of ``query_id`` stands: its job epoch and what to do (docs/exactly-once.md).

        Raises EpochGapError when the job's state cannot take the batch (it would skip epochs).
        """
        response: jm_pb.BeginBatchResponse = self._jm_call(
            "BeginBatch",
            self.jobmanager.BeginBatch,
            jm_pb.BeginBatchRequest(job_id=job_id, query_id=query_id, batch_id=batch_id),
        )
        self._store_routing(response.routing, fetched=True)
        return batch_start_from_proto(response, Routing.from_proto(response.routing))

    def commit_epoch(
        self,
        job_id: JobId | str,
        epoch: int,
        winners: Mapping[int, int] | Iterable[Winner],
        *,
        expected_routing_version: int,
        query_id: str = "",
        batch_id: int | None = None,
        checkpoint: bool = True,
        wait_for_checkpoint: bool = True,
        timeout_s: float = 600.0,
    ) -> EpochCommitted:
        """Commit job epoch ``epoch`` (batch ``batch_id`` of ``query_id``) with the winning attempt of each partition.

        ``winners`` is ``{partition: attempt}`` (no ledgers checked) or the winners with their
        ledgers (``EpochScope.winner()``). With ``wait_for_checkpoint`` the call answers once a
        completed checkpoint holds the epoch, or raises. Safe to call again: an epoch already
        committed only waits for durability.
        """
        if isinstance(winners, Mapping):
            attempts = [winner_to_proto(Winner(p, a)) for p, a in sorted(winners.items())]
        else:
            attempts = [winner_to_proto(w) for w in winners]
        request = jm_pb.CommitEpochRequest(
            job_id=job_id,
            epoch=epoch,
            checkpoint=checkpoint,
            wait_for_checkpoint=wait_for_checkpoint,
            expected_routing_version=expected_routing_version,
            query_id=query_id,
            batch_id=epoch if batch_id is None else batch_id,
            winners=attempts,
            timeout_ms=int(timeout_s * 1000),
        )
        result: jm_pb.CommitEpochResponse = self._jm_call(
            "CommitEpoch", self.jobmanager.CommitEpoch, request, timeout=timeout_s + 30, retry=False
        )
        return epoch_committed_from_proto(result)

    def routing(self, job_id: JobId | str, refresh: bool = False) -> Routing:
        """The job's routing table: cached, or fetched from the JobManager with ``refresh``.

        A cached table of a FAILED or CANCELED job is never trusted: the job may have been
        restored or resubmitted since (by another client or statectl), so it is fetched again.
        """
        routing = self._routing.get(job_id)
        if routing is None or refresh or routing.job_status in _TERMINAL:
            table: pb.RoutingTable = self._jm_call(
                "GetRouting", self.jobmanager.GetRouting, jm_pb.GetRoutingRequest(job_id=job_id)
            )
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
            if (
                fetched
                or current is None
                or routing.version >= current.version
                or routing.job_status != current.job_status
            ):
                self._routing[routing.job_id] = routing
        return self._routing[routing.job_id]

    def descriptor(self, job_id: JobId | str, operator_id: OperatorId | str, state: str) -> StateDescriptor:
        """The descriptor of state ``state``, cached after the first lookup (one GetJob per job).

        NotFoundError naming the known operators or states if the job has no such operator or state.
        """
        key = (job_id, operator_id, state)
        found = self._descriptors.get(key)
        if found is None:
            info = self.job_info(job_id)
            for op in info.operators:
                for d in op.states:
                    self._descriptors[(job_id, op.operator_id, d.name)] = state_descriptor_from_proto(d)
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
                    channel = open_channel(
                        address, self.settings.max_message_bytes, security=self.security, token=self._token
                    )
                    self._channels[address] = channel
                    stub = tm_grpc.KeyedStateStub(channel)
                    self._stubs[address] = stub
        return stub

    def keyed_call(
        self,
        job_id: JobId | str,
        operator_id: OperatorId | str,
        state: str,
        method: str,
        keys: list[bytes],
        build: Callable[[tm_pb.StateTarget, Part], tm_pb.KeyedRequest] | None = None,
        epoch: pb.EpochContext | EpochScope | None = None,
        *,
        columns: Mapping[str, Sequence[bytes]] | None = None,
        namespace: bytes = b"",
        return_values: bool = False,
    ) -> list[tuple[Part, Any]]:
        """Send one logical batch: group keys by owning subtask, split into requests, pipeline them.

        Without ``build`` each request carries the keys and ``columns`` (``values``, ``user_keys``,
        ``namespaces``: one item per key) of its positions, ``namespace`` and ``return_values``, in
        the columnar wire (version 2) to TaskManagers that speak it, else as repeated fields.
        ``build(target, indices)``, if given, makes the request for the keys at ``indices`` itself
        (always version 1): None = all keys (every key has the same owner), a ``range`` = a
        contiguous slice, or a list of positions.
        Returns (indices, response) pairs.

        Before anything is sent, the whole call (``keys``, ``namespace`` and the ``columns`` the
        requests carry: ``values``, ``user_keys``) is checked against the size limits of the
        TaskManagers serving the job, so a call refused for one bad key changes nothing anywhere.

        Idempotent methods are retried on UNAVAILABLE and stale routing; others only when the
        server answered that it applied nothing. Inside an epoch scope with a pinned routing
        version (:class:`EpochScope`) every call goes out under that version, each write request
        carries a sequence number the slot stages once (so every write is safe to retry), and a
        routing that moved on fails the call with EpochConflictError: the batch must run again.
        A direct write that fails after part of it was sent says in its error (and its
        ``outcome``) which keys were applied on which subtasks, which were not, and which are unknown.
        """
        if not keys:
            return []
        call = _Call.plan(
            job_id,
            operator_id,
            state,
            method,
            keys,
            build,
            as_scope(epoch),
            columns or {},
            namespace,
            self.settings.batch_size,
            refresh=job_id in self._suspect,
            return_values=return_values,
        )
        try:
            return self._rounds(call)
        except KeyedStateError as exc:
            ledger = call.ledger
            if ledger is None or not ledger.sent or call.sent_with is None:
                raise
            raise _with_outcome(exc, ledger, method, keys, call.sent_with, operator_id) from exc

    def _rounds(self, call: _Call) -> list[tuple[Part, Any]]:
        """Rounds of ``call`` until one completes it; the error of the round that gave up, unwrapped."""
        try:
            return call_with_retries(
                lambda: self._round(call),
                what=f"{call.method} of {call.job_id}/{call.operator_id}",
                policy=self._retry_policy,
                waiter=self._waiter,
                is_transient=_is_round_failure,
                immediate=_is_stale_round,
                clock=self._clock,
                log_level=logging.DEBUG,
            )
        except _RoundFailed as failed:
            raise failed.error from None

    def _round(self, call: _Call) -> list[tuple[Part, Any]]:
        """One round of a keyed call: everything on the first, the failed requests after; _RoundFailed to go again."""
        routing = self._routing_for(call.job_id, call.scope if call.pinned else None, call.refresh)
        call.refresh = True  # a later round is a retry: it fetches the table again
        if routing.job_status not in ("RUNNING", ""):
            _refuse_stopped(routing)
            raise _RoundFailed(UnavailableError(f"job {call.job_id!r} is {routing.job_status}"))
        if call.pending is None:
            check_limits(routing, call.method, call.keys, call.columns, call.namespace)
        if call.pending is not None and (call.pinned or (call.numbered and routing.version == call.sent_under)):
            # Same routing version: same owners, and the same sequence numbers, so a slot that
            # applied a request whose answer was lost does not stage it twice.
            units = call.pending
        else:
            units = self._units(
                routing, call.operator_id, call.method, call.keys, call.pending, call.scope if call.numbered else None
            )
        call.sent_under, call.sent_with = routing.version, routing
        sent, failed, error = _Pipeline(
            routing, call, units, self._stub, self._suspect, self.settings, self._wire
        ).run()
        call.results.extend(sent)
        if failed:
            call.pending = failed
            raise _RoundFailed(error)
        return call.results

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
        self,
        routing: Routing,
        operator_id: str,
        method: str,
        keys: list[bytes],
        pending: list[_Unit] | None,
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
        return [indices[a : a + batch] for a in range(0, len(indices), batch)]

    def stream_call(
        self,
        job_id: JobId | str,
        operator_id: OperatorId | str,
        method: str,
        subtask: int,
        request: tm_pb.ScanRequest,
        epoch: pb.EpochContext | EpochScope | None = None,
    ) -> Iterator[tm_pb.ScanChunk]:
        """A server-streaming scan of one subtask (retries before the first chunk only)."""
        scope = as_scope(epoch)
        pinned = scope if scope is not None and scope.routing_version > 0 else None
        if scope is not None:
            request.target.epoch.CopyFrom(scope.context)
        rpc = _SCAN_RPCS.get(method)
        if rpc is None:
            raise InvalidArgumentError(f"{method!r} is not a scan of the TaskManager ({', '.join(_SCAN_RPCS)})")
        attempts = [0]
        address = ""

        def open_stream() -> tuple[Iterator[tm_pb.ScanChunk], tm_pb.ScanChunk | None]:
            nonlocal address
            attempts[0] += 1
            routing = self._routing_for(job_id, pinned, refresh=attempts[0] > 1)
            _refuse_stopped(routing)
            address = routing.operator(operator_id).addresses[subtask]
            request.target.routing_version = routing.version
            try:
                stream = iter(rpc(self._stub(address))(request, timeout=self.settings.timeout_s * 10))
                return stream, next(stream, None)
            except grpc.RpcError as exc:
                raise from_rpc_error(exc, f"{method} on TaskManager {address}") from exc

        constant = RetryPolicy.polling(self.settings.backoff_s, max_attempts=self.settings.max_attempts)
        stream, first = call_with_retries(
            open_stream,
            what=f"{method} of {job_id}/{operator_id} subtask {subtask}",
            policy=constant,
            waiter=self._waiter,
            is_transient=_is_retryable_stream_error,
            clock=self._clock,
            log_level=logging.DEBUG,
        )
        if first is None:
            return
        yield first
        try:
            yield from stream
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, f"{method} on TaskManager {address}") from exc

    def subtask_of(self, job_id: JobId | str, operator_id: OperatorId | str, key: bytes) -> int:
        """The subtask of ``operator_id`` that owns the serialized ``key`` (its key group), by the cached
        routing; raises if the job is FAILED or CANCELED.
        """
        routing = self.routing(job_id)
        _refuse_stopped(routing)
        routes = routing.operator(operator_id)
        return routes.subtask_of[(_xxh64(key, HASH_SEED) & 0xFFFFFFFF) % routing.max_parallelism]

    def close(self) -> None:
        """Close every channel; a retry waiting out its backoff ends at once (the default waiter)."""
        self._closing.set()
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


def _refuse_stopped(routing: Routing) -> None:
    """Raise if the job is FAILED or CANCELED (a status routing() fetched just now, never a cached one).

    Not retried, and not a JobStateError (which callers retry): the job stays stopped until
    someone restores or resubmits it.
    """
    if routing.job_status in _TERMINAL:
        job_id = routing.job_id
        raise KeyedStateError(
            f"job {job_id!r} is {routing.job_status}; restore it (statectl job restore {job_id} --from PATH) or "
            f"submit it again, then retry (statectl job info {job_id} shows why it stopped)",
            reason=Reason.JOB_NOT_RUNNING,
        )


def _positions(part: Part, n_keys: int) -> Iterable[int]:
    return range(n_keys) if part is None else part


def _with_outcome(
    error: KeyedStateError,
    ledger: _Ledger,
    method: str,
    keys: list[bytes],
    routing: Routing,
    operator_id: str,
) -> KeyedStateError:
    """``error`` again, its message saying which keys of the failed call were applied on which subtasks."""
    n = len(keys)
    applied, unknown, not_applied = _positions_by_outcome(ledger, keys, routing, operator_id)
    done = set().union(*applied.values()) if applied else set()
    maybe = set().union(*unknown.values()) if unknown else set()
    if not done and not maybe:
        if ledger.requests <= 1 and len(not_applied) <= 1:
            return error  # one request, refused whole: the TaskManager's error says it all
        detail = (
            f"nothing of this {method} of {n} keys was applied on any subtask; send it again once the cause is fixed"
        )
    else:
        detail = _applied_in_part(method, n, applied, unknown, not_applied)
    message = f"{error.message}. {detail[0].upper()}{detail[1:]}"
    restated = error.with_message(message)
    restated.outcome = BatchOutcome(
        method,
        tuple(sorted(done)),
        tuple(sorted(set().union(*not_applied.values()) if not_applied else ())),
        tuple(sorted(maybe)),
    )
    return restated


_BySubtask = dict[int, set[int]]


def _positions_by_outcome(
    ledger: _Ledger, keys: list[bytes], routing: Routing, operator_id: str
) -> tuple[_BySubtask, _BySubtask, _BySubtask]:
    """The positions of ``keys`` per subtask: applied, outcome unknown (and not applied by another request), not applied.

    A key neither applied nor unknown was never sent (or refused): its subtask is the routing's owner of its key group.
    """
    n = len(keys)
    applied: _BySubtask = {}
    for unit in ledger.applied:
        applied.setdefault(unit.subtask, set()).update(_positions(unit.part, n))
    done = set().union(*applied.values()) if applied else set()
    unknown: _BySubtask = {}
    for unit in ledger.unknown:
        left = set(_positions(unit.part, n)) - done
        if left:
            unknown.setdefault(unit.subtask, set()).update(left)
    maybe = set().union(*unknown.values()) if unknown else set()
    not_applied: _BySubtask = {}
    table, m = routing.operator(operator_id).subtask_of, routing.max_parallelism
    for i in range(n):
        if i not in done and i not in maybe:
            not_applied.setdefault(table[(_xxh64(keys[i], HASH_SEED) & 0xFFFFFFFF) % m], set()).add(i)
    return applied, unknown, not_applied


def _applied_in_part(method: str, n: int, applied: _BySubtask, unknown: _BySubtask, not_applied: _BySubtask) -> str:
    """What the message says of a call some of whose keys were (or may have been) applied."""

    def groups(by_subtask: _BySubtask) -> str:
        return ", ".join(
            f"subtask {s} ({len(p)} key{'s' if len(p) != 1 else ''})" for s, p in sorted(by_subtask.items())
        )

    said = []
    if any(applied.values()):
        said.append(f"applied on {groups(applied)}")
    if unknown:  # (holds only non-empty groups)
        said.append(
            f"outcome unknown on {groups(unknown)} (no answer came back: the TaskManager may have "
            "applied them; read them back before sending them again)"
        )
    if not_applied:
        said.append(f"not applied on {groups(not_applied)}")
    return (
        f"this {method} of {n} keys was applied in part: {'; '.join(said)}. Send again only the keys not "
        "applied (error.outcome holds the positions of each group in the call), or a list append or reduce "
        "counts twice"
    )


def _first_over(items: Sequence[bytes], limit: int) -> int:
    """The position of the first item longer than ``limit`` (-1: none); C loops when none is."""
    if not items or max(map(len, items)) <= limit:
        return -1
    return next(i for i, item in enumerate(items) if len(item) > limit)


def _shown(item: bytes) -> str:
    return repr(item[:24]) + ("..." if len(item) > 24 else "")


def check_limits(
    routing: Routing,
    method: str,
    keys: Sequence[bytes],
    columns: Mapping[str, Sequence[bytes]],
    namespace: bytes,
) -> None:
    """Refuse a whole call that a TaskManager of the job would refuse in part (SizeLimitError), before sending any of it.

    The limits are those the TaskManagers reported (``state.limits.*``); one they did not report is not checked.
    """
    limits: Limits = routing.limits
    where = f"the TaskManagers of job {routing.job_id!r}"
    tail = "; nothing of the call was sent"
    key_limit = limits.max_key_bytes
    if key_limit:
        i = _first_over(keys, key_limit)
        if i >= 0:
            raise SizeLimitError(
                f"{method}: key #{i} of the call ({_shown(keys[i])}) has {len(keys[i])} bytes, more than "
                f"state.limits.max-key-bytes ({key_limit}) of {where}; use shorter keys (for example a hash of a long "
                f"key) or raise the limit{tail}"
            )
        if len(namespace) > key_limit:
            raise SizeLimitError(
                f"{method}: the namespace has {len(namespace)} bytes, more than state.limits.max-key-bytes "
                f"({key_limit}) of {where}; use a shorter namespace{tail}"
            )
        user_keys = columns.get("user_keys")
        i = _first_over(user_keys or (), key_limit)
        if user_keys and i >= 0:
            raise SizeLimitError(
                f"{method}: user key #{i} of the call ({_shown(user_keys[i])}) has {len(user_keys[i])} bytes, more "
                f"than state.limits.max-key-bytes ({key_limit}) of {where}; use shorter map keys or raise the limit{tail}"
            )
    value_limit = limits.max_value_bytes
    values = columns.get("values")
    if value_limit and values:
        i = _first_over(values, value_limit)
        if i >= 0:
            what = "list element" if method.startswith("List") else "operand" if method == "Reduce" else "value"
            raise SizeLimitError(
                f"{method}: the {what} of key #{i} ({_shown(keys[i])}) has {len(values[i])} bytes, more than "
                f"state.limits.max-value-bytes ({value_limit}) of {where}; split it (a list state stores elements "
                f"separately) or raise the limit{tail}"
            )
    elements = limits.max_list_elements
    if elements and method in ("ListAppend", "ListUpdate") and len(keys) > elements:
        key, count = Counter(keys).most_common(1)[0]
        if count > elements:
            raise SizeLimitError(
                f"{method}: {count} elements for key {_shown(key)} in one call, more than "
                f"state.limits.list.max-elements ({elements}) of {where}; clear or trim the list, or raise the limit{tail}"
            )


def check_lengths(what: str, **columns: Iterable[Any]) -> None:
    sizes = {name: len(col) for name, col in columns.items()}  # type: ignore[arg-type]
    if len(set(sizes.values())) > 1:
        detail = ", ".join(f"{n}={s}" for n, s in sizes.items())
        raise InvalidArgumentError(f"{what}: the columns must have equal lengths ({detail})")
