"""The executor client: talks to the JobManager for routing and to TaskManagers for state.

One :class:`StateClient` per process is enough (Spark reuses Python workers, so a module-level
client keeps its channels warm); it is thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import xxhash

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common._proto.v1 import jobmanager_pb2_grpc as jm_grpc
from keyedstate.common._proto.v1 import taskmanager_pb2 as tm_pb
from keyedstate.common._proto.v1 import taskmanager_pb2_grpc as tm_grpc
from keyedstate.common.auth import resolve_token, token_from_config
from keyedstate.common.client._epoch import EpochScope, as_scope
from keyedstate.common.client._routing import Limits, Routing
from keyedstate.common.config import Configuration
from keyedstate.common.config import options as o
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor
from keyedstate.common.errors import (
    BatchOutcome,
    EpochConflictError,
    InvalidArgumentError,
    KeyedStateError,
    NotFoundError,
    Reason,
    SizeLimitError,
    StaleRoutingError,
    UnavailableError,
)
from keyedstate.common.keygroups import HASH_SEED
from keyedstate.common.rpc.channels import open_channel
from keyedstate.common.rpc.status import REASON_KEY, from_rpc_error
from keyedstate.common.security.tls import REST, ChannelSecurity
from keyedstate.common.security.transport import TransportSecurity

logger = logging.getLogger(__name__)

_xxh64 = xxhash.xxh64_intdigest

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


def client_security(conf: Configuration) -> ChannelSecurity | None:
    """The client side of the rest plane from security.ssl.rest.* (None: TLS is off); checks the files now."""
    return TransportSecurity.from_config(conf, role="client").channel_security(REST)


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

    def __init__(
        self,
        jobmanager_address: str,
        settings: ClientSettings | None = None,
        security: ChannelSecurity | None = None,
        *,
        token: str | None = None,
    ) -> None:
        """``security``: TLS for every channel (None: plaintext); :meth:`from_config` builds it from the
        security.ssl.rest.* keys, :meth:`ChannelSecurity.from_pem` from PEM bytes.

        ``token``: sent with every call (security.auth.enabled). None: the token of this process's
        environment, from the file named by ``KEYEDSTATE_TOKEN_FILE`` or from ``KEYEDSTATE_TOKEN``
        (none there: calls carry no token)."""
        self.jobmanager_address = jobmanager_address
        self.settings = settings or ClientSettings()
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
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_config(cls, conf: Configuration) -> StateClient:
        address = f"{conf.get(o.JOBMANAGER_ADDRESS)}:{conf.get(o.JOBMANAGER_PORT)}"
        return cls(address, ClientSettings.from_config(conf), client_security(conf), token=token_from_config(conf))

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
        table = self._jm_call(
            "SubmitJob",
            jm_pb.SubmitJobRequest(
                job_id=job_id,
                operators=[op.to_proto() for op in operators],
                max_parallelism=max_parallelism,
                restore_path=restore_path,
                config={k: str(v) for k, v in (config or {}).items()},
            ),
            timeout=max(self.settings.timeout_s, 600.0),
        )
        return self._store_routing(table)

    def restore_job(self, job_id: str, restore_path: str) -> Routing:
        """Replace the state of job ``job_id`` with the checkpoint or savepoint at ``restore_path``.

        The JobManager verifies the source in full before it touches the job, so a bad path or a
        damaged checkpoint leaves the job as it was; a running job whose redeploy fails comes back
        as it was (see ``statectl job restore`` in the README). Not retried: the answer says what happened.
        """
        table = self._jm_call(
            "RestoreJob",
            jm_pb.RestoreJobRequest(job_id=job_id, restore_path=restore_path),
            timeout=max(self.settings.timeout_s, 600.0),
            retry=False,
        )
        return self._store_routing(table, fetched=True)

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
                active = [t for t in overview.taskmanagers if t.status == jm_pb.TASK_MANAGER_STATUS_ACTIVE]
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

    def trigger_checkpoint(
        self,
        job_id: str,
        *,
        savepoint: bool = False,
        target_directory: str = "",
        wait: bool = True,
        timeout_s: float = 600.0,
    ) -> jm_pb.CheckpointInfo:
        return self._jm_call(
            "TriggerCheckpoint",
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

    def begin_batch(self, job_id: str, query_id: str, batch_id: int) -> jm_pb.BeginBatchResponse:
        """Where batch ``batch_id`` of ``query_id`` stands: its job epoch and what to do (docs/exactly-once.md).

        Raises EpochGapError when the job's state cannot take the batch (it would skip epochs).
        """
        response = self._jm_call(
            "BeginBatch", jm_pb.BeginBatchRequest(job_id=job_id, query_id=query_id, batch_id=batch_id)
        )
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
        return self._jm_call("CommitEpoch", request, timeout=timeout_s + 30, retry=False)

    def routing(self, job_id: str, refresh: bool = False) -> Routing:
        """The job's routing table: cached, or fetched from the JobManager with ``refresh``.

        A cached table of a FAILED or CANCELED job is never trusted: the job may have been
        restored or resubmitted since (by another client or statectl), so it is fetched again.
        """
        routing = self._routing.get(job_id)
        if routing is None or refresh or routing.job_status in _TERMINAL:
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
            if (
                fetched
                or current is None
                or routing.version >= current.version
                or routing.job_status != current.job_status
            ):
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
                    channel = open_channel(
                        address, self.settings.max_message_bytes, security=self.security, token=self._token
                    )
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
        *,
        columns: Mapping[str, Sequence[bytes]] | None = None,
        namespace: bytes = b"",
    ) -> list[tuple[Part, Any]]:
        """Send one logical batch: group keys by owning subtask, split into requests, pipeline them.

        ``build(target, indices)`` makes the request for the keys at ``indices``: None = all keys
        (every key has the same owner), a ``range`` = a contiguous slice, or a list of positions.
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
        scope = as_scope(epoch)
        pinned = scope is not None and scope.routing_version > 0
        numbered = scope is not None and scope.numbered and method in WRITES
        idempotent = method in IDEMPOTENT or (numbered and pinned)
        # Requests of one subtask may overtake each other in flight; that is harmless for reads and
        # for writes that touch every key once (checked on the whole call, conservatively per key).
        order_free = method in READS or (len(keys) <= self.settings.batch_size) or len(set(keys)) == len(keys)
        # Direct writes account for every request, to say exactly what a failure left applied. (Epoch
        # writes are only staged: a failed task's attempt is never committed.)
        ledger = _Ledger() if scope is None and method in WRITES else None
        attempts = self.settings.max_attempts
        delay = self.settings.backoff_s
        pending: list[_Unit] | None = None  # None: first round, everything
        failed_units: list[_Unit] | None
        results: list[tuple[Part, Any]] = []
        refresh = job_id in self._suspect
        sent_under = -1  # the routing version the pending units were built for
        sent_with: Routing | None = None  # the routing the latest requests were sent under
        try:
            for attempt in range(1, attempts + 1):
                routing = self._routing_for(job_id, scope if pinned else None, refresh)
                if routing.job_status not in ("RUNNING", ""):
                    _refuse_stopped(routing)
                    failed_units = pending  # None: nothing was sent yet, everything goes next round
                    error: KeyedStateError = UnavailableError(f"job {job_id!r} is {routing.job_status}")
                else:
                    if pending is None:
                        check_limits(routing, method, keys, columns or {}, namespace)
                    if pending is not None and (pinned or (numbered and routing.version == sent_under)):
                        # Same routing version: same owners, and the same sequence numbers, so a slot that
                        # applied a request whose answer was lost does not stage it twice.
                        units = pending
                    else:
                        units = self._units(routing, operator_id, method, keys, pending, scope if numbered else None)
                    sent_under, sent_with = routing.version, routing
                    sent, failed_units, error = self._send_units(
                        routing,
                        operator_id,
                        state,
                        method,
                        units,
                        build,
                        scope,
                        numbered,
                        idempotent,
                        order_free,
                        pinned,
                        ledger,
                    )
                    results.extend(sent)
                    if not failed_units:
                        return results
                if attempt == attempts:
                    raise error
                logger.debug(
                    "retrying %s of %s/%s after %s (attempt %d)", method, job_id, operator_id, error.message, attempt
                )
                pending = failed_units
                refresh = True
                if not isinstance(error, StaleRoutingError):
                    time.sleep(delay)
                    delay = min(delay * 2, 5.0)
        except KeyedStateError as exc:
            if ledger is None or not ledger.sent or sent_with is None:
                raise
            raise _with_outcome(exc, ledger, method, keys, sent_with, operator_id) from exc
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
        ledger: _Ledger | None = None,
    ) -> tuple[list[tuple[Part, Any]], list[_Unit], KeyedStateError]:
        """Pipeline the requests of every subtask; returns (answers, units to retry, last error).

        Each request is built just before it is sent, so encoding the next batch overlaps the
        TaskManager applying the previous one. Up to ``max_in_flight`` requests per subtask are
        in flight when their order cannot matter (reads, or writes whose keys are all distinct);
        otherwise one at a time, so a repeated key's writes apply in the caller's order. After a
        retryable failure a subtask sends nothing more: its remaining requests are retried in
        order with the failed one.

        With a ``ledger`` (direct writes) a failure that ends the call stops sending, but the
        requests already in flight are waited for instead of cancelled: the ledger then knows
        which were applied, and the error raised at the end can say so.
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
                    job_id=routing.job_id,
                    operator_id=operator_id,
                    subtask_index=unit.subtask,
                    state_name=state,
                    routing_version=routing.version,
                    epoch=context,
                )
                address = routes.addresses[unit.subtask]
                lane = lanes[unit.subtask] = _Lane(target, address, getattr(self._stub(address), method), deque())
            lane.parts.append(unit)
        sent: list[tuple[Part, Any]] = []
        failed: list[_Unit] = []
        last_error: KeyedStateError = UnavailableError("no error")
        fatal: list[tuple[KeyedStateError, grpc.RpcError]] = []  # the failure that ends the call (ledger only)
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
            if ledger is not None:
                ledger.sent = True
            try:
                sent.append((unit.part, future.result()))
                if ledger is not None:
                    ledger.applied.append(unit)
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
                if ledger is not None and not _not_applied(exc):
                    ledger.unknown.append(unit)  # until a retry applies it
                retryable = isinstance(error, (StaleRoutingError, UnavailableError))
                if not fatal and retryable and (idempotent or _not_applied(exc)):
                    failed.append(unit)
                    failed.extend(lane.parts)  # never sent, so certainly not applied
                    lane.parts.clear()
                    last_error = error
                    return
                if retryable:
                    self._suspect.add(routing.job_id)  # the owner may be gone: the next call fetches the table
                    error = UnavailableError(
                        f"{error.message}. The outcome of this {method} is unknown (the TaskManager may have applied "
                        "it), so it was not retried; use epoch transactions for exactly-once updates"
                    )
                if ledger is None:
                    for _lane, _unit, f in in_flight:  # the caller gets the error now; stop the rest
                        f.cancel()
                    raise error from exc
                if not fatal:
                    fatal.append((error, exc))
                    for other in lanes.values():  # send nothing more; learn what the requests in flight did
                        other.parts.clear()

        while True:
            for lane in lanes.values():
                while lane.parts and lane.in_flight < per_subtask:
                    unit = lane.parts.popleft()
                    in_flight.append((lane, unit, lane.call.future(request_for(lane, unit), timeout=timeout)))
                    lane.in_flight += 1
                    if ledger is not None:
                        ledger.requests += 1
            if not in_flight:
                if fatal:
                    error, cause = fatal[0]
                    raise error from cause
                return sent, failed, last_error
            drain_one()

    def stream_call(
        self,
        job_id: str,
        operator_id: str,
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
        for attempt in range(1, self.settings.max_attempts + 1):
            routing = self._routing_for(job_id, pinned, refresh=attempt > 1)
            _refuse_stopped(routing)
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
                if (
                    first
                    and isinstance(error, (StaleRoutingError, UnavailableError))
                    and attempt < self.settings.max_attempts
                ):
                    time.sleep(self.settings.backoff_s)
                    continue
                raise error from exc

    def subtask_of(self, job_id: str, operator_id: str, key: bytes) -> int:
        routing = self.routing(job_id)
        _refuse_stopped(routing)
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
    applied: dict[int, set[int]] = {}
    for unit in ledger.applied:
        applied.setdefault(unit.subtask, set()).update(_positions(unit.part, n))
    done = set().union(*applied.values()) if applied else set()
    unknown: dict[int, set[int]] = {}
    for unit in ledger.unknown:
        left = set(_positions(unit.part, n)) - done
        if left:
            unknown.setdefault(unit.subtask, set()).update(left)
    maybe = set().union(*unknown.values()) if unknown else set()
    not_applied: dict[int, set[int]] = {}
    table, m = routing.operator(operator_id).subtask_of, routing.max_parallelism
    for i in range(n):
        if i not in done and i not in maybe:
            not_applied.setdefault(table[(_xxh64(keys[i], HASH_SEED) & 0xFFFFFFFF) % m], set()).add(i)

    def groups(by_subtask: dict[int, set[int]]) -> str:
        return ", ".join(
            f"subtask {s} ({len(p)} key{'s' if len(p) != 1 else ''})" for s, p in sorted(by_subtask.items())
        )

    if not done and not maybe:
        if ledger.requests <= 1 and len(not_applied) <= 1:
            return error  # one request, refused whole: the TaskManager's error says it all
        detail = (
            f"nothing of this {method} of {n} keys was applied on any subtask; send it again once the cause is fixed"
        )
    else:
        said = []
        if done:
            said.append(f"applied on {groups(applied)}")
        if maybe:
            said.append(
                f"outcome unknown on {groups(unknown)} (no answer came back: the TaskManager may have "
                "applied them; read them back before sending them again)"
            )
        if not_applied:
            said.append(f"not applied on {groups(not_applied)}")
        detail = (
            f"this {method} of {n} keys was applied in part: {'; '.join(said)}. Send again only the keys not "
            "applied (error.outcome holds the positions of each group in the call), or a list append or reduce "
            "counts twice"
        )
    message = f"{error.message}. {detail[0].upper()}{detail[1:]}"
    restated = error.with_message(message)
    restated.outcome = BatchOutcome(
        method,
        tuple(sorted(done)),
        tuple(sorted(set().union(*not_applied.values()) if not_applied else ())),
        tuple(sorted(maybe)),
    )
    return restated


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
