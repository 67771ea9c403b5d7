"""The KeyedState service: executors' state calls, translated onto a slot's backend."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc

from keyedstate.common._proto.v1 import taskmanager_pb2 as pb
from keyedstate.common._proto.v1 import taskmanager_pb2_grpc as pb_grpc
from keyedstate.common.errors import ConfigError, InvalidArgumentError
from keyedstate.common.ids import JobId, OperatorId
from keyedstate.common.lease import Lease
from keyedstate.common.rpc.status import rpc_method
from keyedstate.taskmanager.epochs import EpochManager
from keyedstate.taskmanager.metrics import TaskManagerMetrics
from keyedstate.taskmanager.rpc.wire import (
    KeyedColumns,
    found_response,
    keyed_columns,
    lists_response,
    reduced_response,
    values_response,
    write_response,
)
from keyedstate.taskmanager.slots import SlotTable
from keyedstate.taskmanager.state.access import KeyedStateAccess

_DEFAULT_CHUNK = 1000
_MAX_CHUNK = 100_000


def _chunk_size(request: pb.ScanRequest) -> int:
    if request.chunk_size < 0 or request.chunk_size > _MAX_CHUNK:
        raise InvalidArgumentError(
            f"chunk_size must be between 0 (server default) and {_MAX_CHUNK}, got {request.chunk_size}"
        )
    return request.chunk_size or _DEFAULT_CHUNK


def _chunks(items: Iterable[tuple[bytes, ...]], size: int, fields: tuple[str, ...]) -> Iterator[pb.ScanChunk]:
    """Stream ``items`` (tuples of ``len(fields)`` columns) as ScanChunks of ``size`` entries."""
    columns: list[list[bytes]] = [[] for _ in fields]
    for item in items:
        for column, value in zip(columns, item):
            column.append(value)
        if len(columns[0]) >= size:
            yield pb.ScanChunk(**dict(zip(fields, columns)))
            columns = [[] for _ in fields]
    if columns[0]:
        yield pb.ScanChunk(**dict(zip(fields, columns)))


_FENCE_MAX_WAIT_S = 30.0
"""How long a call of epoch E waits for E-1 when it carries no deadline."""
_FENCE_MARGIN = 0.8
"""Of the call's remaining time, the part it may wait: the refusal must reach the client before its deadline."""


def _fence_wait_s(context: grpc.ServicerContext) -> float:
    """How long the read fence may hold this call (see ``SlotEpochs.await_previous_epoch``)."""
    remaining: float | None = context.time_remaining()  # None without a deadline (the stubs say float)
    if remaining is None:
        return _FENCE_MAX_WAIT_S
    return max(0.0, min(_FENCE_MAX_WAIT_S, remaining * _FENCE_MARGIN))


def _served(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Check the lease after the call applied, before answering (see :class:`KeyedStateServicer`)."""

    @functools.wraps(fn)
    def wrapper(self: KeyedStateServicer, request: Any, context: grpc.ServicerContext) -> Any:
        response = fn(self, request, context)
        self._lease.check_after(fn.__name__)
        return response

    return wrapper


_DIRECT_WRITES = frozenset({"ValuePut", "Clear", "Reduce", "ListAppend", "ListUpdate", "MapPut", "MapRemove"})


class KeyedStateServicer(pb_grpc.KeyedStateServicer):
    """Serves state calls only under the TaskManager's lease, and only to callers of the slot's routing version.

    The lease is checked when a call starts and again after it applied, before it is answered:
    a TaskManager paused in the middle of a call (a stopped process, a long GC, a frozen VM)
    whose lease ran out meanwhile answers UNAVAILABLE instead of acknowledging a write that a
    new owner of the key group would never see.
    """

    def __init__(
        self, slots: SlotTable, metrics: TaskManagerMetrics, lease: Lease, transactions: EpochManager | None = None
    ) -> None:
        self._slots = slots
        self._metrics = metrics
        self._lease = lease
        self._transactions = transactions

    def add_to(self, server: grpc.Server) -> None:
        """Serve this service on ``server`` (the client plane's)."""
        pb_grpc.add_KeyedStateServicer_to_server(self, server)

    def _backend(
        self, target: pb.StateTarget, method: str, keys: int, context: grpc.ServicerContext
    ) -> KeyedStateAccess:
        self._metrics.record_request(method, keys)
        self._lease.check(method)
        slot = self._slots.lookup(
            JobId(target.job_id), OperatorId(target.operator_id), target.subtask_index, target.routing_version
        )
        if target.HasField("epoch"):
            # Epoch-scoped calls go to the task attempt's transaction: writes staged, reads merged.
            if self._transactions is None:
                raise InvalidArgumentError(
                    "this TaskManager does not accept epoch-scoped calls; send the call without `epoch` "
                    "(direct, at-least-once writes)"
                )
            return self._transactions.view(slot, target.epoch, _fence_wait_s(context))
        if slot.changelog is not None and method in _DIRECT_WRITES:
            # A restore rebuilds a changelog slot from its log, which only epoch commits write:
            # a direct write would be served now and silently lost at the next failover.
            raise ConfigError(
                f"{method} without `epoch` on {slot.subtask}: job {target.job_id!r} runs with "
                "state.changelog.enabled, whose checkpoints log only epoch commits; write within an epoch "
                "(EpochContext, as the PySpark helper does), or submit the job without state.changelog.enabled"
            )
        return slot.require_backend()

    def _open(
        self, request: pb.KeyedRequest, method: str, context: grpc.ServicerContext
    ) -> tuple[KeyedColumns, KeyedStateAccess]:
        """The request's columns (either wire version) and the backend or epoch view it goes to."""
        columns = keyed_columns(request)
        return columns, self._backend(request.target, method, len(columns.keys), context)

    def _stream(self, chunks: Iterator[pb.ScanChunk], method: str) -> Iterator[pb.ScanChunk]:
        for chunk in chunks:
            self._lease.check(method)
            yield chunk

    # -- value ------------------------------------------------------------------------------
    @rpc_method
    @_served
    def ValueGet(self, request: pb.KeyedRequest, context: grpc.ServicerContext) -> pb.ValuesResponse:
        """Read value state for a batch of keys (``found`` tells an absent value from an empty one)."""
        c, backend = self._open(request, "ValueGet", context)
        return values_response(backend.value_get(request.target.state_name, c.keys, c.namespaces), c.packed)

    @rpc_method
    @_served
    def ValuePut(self, request: pb.KeyedRequest, context: grpc.ServicerContext) -> pb.WriteResponse:
        """Overwrite value state for a batch of keys."""
        c, backend = self._open(request, "ValuePut", context)
        backend.value_put(request.target.state_name, c.keys, c.values, c.namespaces)
        return write_response(len(c.keys))

    @rpc_method
    @_served
    def Clear(self, request: pb.KeyedRequest, context: grpc.ServicerContext) -> pb.WriteResponse:
        """Remove the (key, namespace) entries of a state of any kind."""
        c, backend = self._open(request, "Clear", context)
        backend.clear(request.target.state_name, c.keys, c.namespaces)
        return write_response(len(c.keys))

    @rpc_method
    @_served
    def Reduce(self, request: pb.KeyedRequest, context: grpc.ServicerContext) -> pb.ValuesResponse:
        """Fold ``values[i]`` into the reducing state of ``keys[i]``; answers the new values only if ``return_values``."""
        c, backend = self._open(request, "Reduce", context)
        result = backend.reduce(request.target.state_name, c.keys, c.values, c.namespaces, request.return_values)
        return reduced_response(result, c.packed)

    # -- list -------------------------------------------------------------------------------
    @rpc_method
    @_served
    def ListAppend(self, request: pb.KeyedRequest, context: grpc.ServicerContext) -> pb.WriteResponse:
        """Append ``values[i]`` to the list state of ``keys[i]``."""
        c, backend = self._open(request, "ListAppend", context)
        backend.list_append(request.target.state_name, c.keys, c.values, c.namespaces)
        return write_response(len(c.keys))

    @rpc_method
    @_served
    def ListGet(self, request: pb.KeyedRequest, context: grpc.ServicerContext) -> pb.ListsResponse:
        """Read whole lists, bounded by ``state.limits.list.max-response-bytes`` (past it use ListScan)."""
        c, backend = self._open(request, "ListGet", context)
        return lists_response(backend.list_get(request.target.state_name, c.keys, c.namespaces), c.packed)

    @rpc_method
    @_served
    def ListUpdate(self, request: pb.KeyedRequest, context: grpc.ServicerContext) -> pb.WriteResponse:
        """Replace each listed key's list with the values given for it (keys may repeat)."""
        c, backend = self._open(request, "ListUpdate", context)
        backend.list_update(request.target.state_name, c.keys, c.values, c.namespaces)
        return write_response(len(c.keys))

    @rpc_method
    def ListScan(self, request: pb.ScanRequest, context: grpc.ServicerContext) -> Iterator[pb.ScanChunk]:
        """Stream one key's list in chunks of ``chunk_size`` elements, checking the lease before each chunk."""
        backend = self._backend(request.target, "ListScan", 1, context)
        chunk = _chunk_size(request)
        if not request.has_key:
            raise InvalidArgumentError("ListScan needs has_key=true and the key whose list to stream")
        elements = backend.list_scan(request.target.state_name, request.key, request.namespace)
        yield from self._stream(_chunks(((e,) for e in elements), chunk, ("values",)), "ListScan")

    # -- map --------------------------------------------------------------------------------
    @rpc_method
    @_served
    def MapPut(self, request: pb.KeyedRequest, context: grpc.ServicerContext) -> pb.WriteResponse:
        """Put ``user_keys[i] -> values[i]`` into the map state of ``keys[i]``."""
        c, backend = self._open(request, "MapPut", context)
        backend.map_put(request.target.state_name, c.keys, c.user_keys, c.values, c.namespaces)
        return write_response(len(c.keys))

    @rpc_method
    @_served
    def MapGet(self, request: pb.KeyedRequest, context: grpc.ServicerContext) -> pb.ValuesResponse:
        """Read ``user_keys[i]`` from the map state of ``keys[i]`` (``found`` marks present entries)."""
        c, backend = self._open(request, "MapGet", context)
        values = backend.map_get(request.target.state_name, c.keys, c.user_keys, c.namespaces)
        return values_response(values, c.packed)

    @rpc_method
    @_served
    def MapRemove(self, request: pb.KeyedRequest, context: grpc.ServicerContext) -> pb.WriteResponse:
        """Remove ``user_keys[i]`` from the map state of ``keys[i]``."""
        c, backend = self._open(request, "MapRemove", context)
        backend.map_remove(request.target.state_name, c.keys, c.user_keys, c.namespaces)
        return write_response(len(c.keys))

    @rpc_method
    @_served
    def MapContains(self, request: pb.KeyedRequest, context: grpc.ServicerContext) -> pb.ValuesResponse:
        """Whether the map state of ``keys[i]`` holds ``user_keys[i]`` (answered in ``found``)."""
        c, backend = self._open(request, "MapContains", context)
        found = backend.map_contains(request.target.state_name, c.keys, c.user_keys, c.namespaces)
        return found_response(found, c.packed)

    @rpc_method
    def MapScan(self, request: pb.ScanRequest, context: grpc.ServicerContext) -> Iterator[pb.ScanChunk]:
        """Stream one key's map entries (only user keys with ``keys_only``) in chunks, checking the lease per chunk."""
        backend = self._backend(request.target, "MapScan", 1, context)
        chunk = _chunk_size(request)
        if not request.has_key:
            raise InvalidArgumentError("MapScan needs has_key=true and the key whose map to stream")
        entries = backend.map_scan(request.target.state_name, request.key, request.namespace, request.keys_only)
        if request.keys_only:
            yield from self._stream(_chunks(((user_key,) for user_key, _ in entries), chunk, ("user_keys",)), "MapScan")
        else:
            yield from self._stream(_chunks(entries, chunk, ("user_keys", "values")), "MapScan")

    @rpc_method
    def ScanKeys(self, request: pb.ScanRequest, context: grpc.ServicerContext) -> Iterator[pb.ScanChunk]:
        """Stream every (key, namespace) of one state in the subtask, in chunks."""
        backend = self._backend(request.target, "ScanKeys", 1, context)
        chunk = _chunk_size(request)
        yield from self._stream(
            _chunks(backend.scan_keys(request.target.state_name), chunk, ("keys", "namespaces")), "ScanKeys"
        )
