"""Typed state handles (value, list, map, reducing) over the StateClient.

Every method has a single-key form and a ``*_many`` form; the ``*_many`` forms are what a
Spark partition should use: they carry thousands of keys per call and pipeline the calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar, cast

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import taskmanager_pb2 as tm_pb
from keyedstate.common.client._client import Part, StateClient, check_lengths
from keyedstate.common.client._epoch import EpochScope, as_scope
from keyedstate.common.client._wire import answered_found, answered_lists, answered_values
from keyedstate.common.descriptors import StateDescriptor, StateKind
from keyedstate.common.errors import KeyedStateError, Reason, WrongStateKindError
from keyedstate.common.serializers import Serializer, get_serializer

K = TypeVar("K")
V = TypeVar("V")
UK = TypeVar("UK")


_HANDLE_NAMES = {
    StateKind.VALUE: "ValueState",
    StateKind.LIST: "ListState",
    StateKind.MAP: "MapState",
    StateKind.REDUCING: "ReducingState",
    StateKind.TIMERS: "TimerService",
}


def _scatter(n: int, results: list[tuple[Part, Any]], column: Callable[[Any], list[Any]]) -> list[Any]:
    """Put each response's ``column`` (one item per key it carried) back at the positions of those keys."""
    if len(results) == 1 and results[0][0] is None:
        return column(results[0][1])
    out: list[Any] = [None] * n
    for indices, response in results:
        values = column(response)
        if indices is None:
            out = values
        elif type(indices) is range:
            if len(values) != len(indices):
                raise KeyedStateError(
                    f"a TaskManager answered {len(values)} items for {len(indices)} keys", reason=Reason.INTERNAL
                )
            out[indices.start : indices.stop] = values
        else:
            for j, i in enumerate(indices):
                out[i] = values[j]
    return out


def _loads_found(serializer: Serializer[Any], values: list[bytes], found: list[bool]) -> list[Any]:
    """Deserialize the values that were found; None where a key had none."""
    if False not in found:
        return serializer.loads_many(values)  # the common case: one bulk call, no per-key branch
    loads = serializer.loads
    return [loads(v) if f else None for v, f in zip(values, found)]


class _Handle(Generic[K]):
    kind: StateKind

    def __init__(
        self,
        client: StateClient,
        job_id: str,
        operator_id: str,
        name: str,
        key_serializer: str | Serializer[Any] = "str",
        namespace: bytes = b"",
        epoch: pb.EpochContext | EpochScope | None = None,
    ) -> None:
        self.client = client
        self.job_id = job_id
        self.operator_id = operator_id
        self.name = name
        self.key_serializer: Serializer[Any] = get_serializer(key_serializer)
        self.namespace = namespace
        self.epoch = as_scope(epoch)
        descriptor = client.descriptor(job_id, operator_id, name)
        if descriptor.kind is not self.kind:
            raise WrongStateKindError(
                f"state {name!r} of operator {operator_id!r} is {descriptor.kind.value} state, not {self.kind.value}; "
                f"use {_HANDLE_NAMES[descriptor.kind]}"
            )
        self.descriptor: StateDescriptor = descriptor

    def _call(self, method: str, keys: list[bytes], **columns: list[bytes]) -> list[tuple[Part, Any]]:
        check_lengths(method, keys=keys, **columns)
        return self.client.keyed_call(
            self.job_id,
            self.operator_id,
            self.name,
            method,
            keys,
            None,
            self.epoch,
            columns=columns,
            namespace=self.namespace,
        )

    def _keys(self, keys: Sequence[Any]) -> list[bytes]:
        return self.key_serializer.dumps_many(list(keys))

    def clear_many(self, keys: Sequence[K]) -> None:
        self._call("Clear", self._keys(keys))

    def clear(self, key: K) -> None:
        self.clear_many([key])

    def keys(self) -> Iterator[K]:
        """Every key holding state (in the handle's namespace), across all subtasks.

        Scans the subtasks of the job's current routing (refreshed first: a rescale changes how
        many there are). If the job is redeployed while the scan runs, the scan raises
        StaleRoutingError at the end instead of returning a possibly incomplete key set.
        """
        from keyedstate.common.errors import StaleRoutingError

        routing = self.client.routing(self.job_id, refresh=True)
        for subtask in range(routing.operator(self.operator_id).parallelism):
            request = tm_pb.ScanRequest(
                target=tm_pb.StateTarget(
                    job_id=self.job_id, operator_id=self.operator_id, subtask_index=subtask, state_name=self.name
                )
            )
            for chunk in self.client.stream_call(
                self.job_id, self.operator_id, "ScanKeys", subtask, request, self.epoch
            ):
                for key, ns in zip(chunk.keys, chunk.namespaces):
                    if ns == self.namespace:
                        yield self.key_serializer.loads(key)
        now = self.client.routing(self.job_id, refresh=True)
        if now.version != routing.version:
            raise StaleRoutingError(
                f"job {self.job_id!r} was redeployed (routing v{routing.version} -> v{now.version}) while keys() "
                "scanned it; the keys seen may be incomplete: call keys() again"
            )


class ValueState(_Handle[K], Generic[K, V]):
    kind = StateKind.VALUE

    def __init__(
        self,
        client: StateClient,
        job_id: str,
        operator_id: str,
        name: str,
        key_serializer: str | Serializer[Any] = "str",
        value_serializer: str | Serializer[Any] = "pickle",
        namespace: bytes = b"",
        epoch: pb.EpochContext | EpochScope | None = None,
    ) -> None:
        super().__init__(client, job_id, operator_id, name, key_serializer, namespace, epoch)
        self.value_serializer: Serializer[Any] = get_serializer(value_serializer)

    def get_many(self, keys: Sequence[K]) -> list[V | None]:
        """The value of each key, in order; None where a key has none.

        One pipelined batch per subtask: what a Spark partition should use instead of :meth:`get` in a loop.
        """
        kb = self._keys(keys)
        results = self._call("ValueGet", kb)
        values = _scatter(len(kb), results, answered_values)
        found = _scatter(len(kb), results, answered_found)
        return _loads_found(self.value_serializer, values, found)

    def get(self, key: K) -> V | None:
        """The value of ``key``, or None when it has none (one round trip: prefer :meth:`get_many` in loops)."""
        return self.get_many([key])[0]

    def put_many(self, keys: Sequence[K], values: Sequence[V]) -> None:
        """Set ``values[i]`` as the value of ``keys[i]``; InvalidArgumentError if the lengths differ."""
        self._call("ValuePut", self._keys(keys), values=self.value_serializer.dumps_many(list(values)))

    def put(self, key: K, value: V) -> None:
        """Set the value of ``key`` (one round trip: prefer :meth:`put_many` in loops)."""
        self.put_many([key], [value])

    def put_all(self, mapping: dict[K, V]) -> None:
        """:meth:`put_many` over the items of ``mapping``."""
        self.put_many(list(mapping.keys()), list(mapping.values()))


class ListState(_Handle[K], Generic[K, V]):
    kind = StateKind.LIST

    def __init__(
        self,
        client: StateClient,
        job_id: str,
        operator_id: str,
        name: str,
        key_serializer: str | Serializer[Any] = "str",
        value_serializer: str | Serializer[Any] = "pickle",
        namespace: bytes = b"",
        epoch: pb.EpochContext | EpochScope | None = None,
    ) -> None:
        super().__init__(client, job_id, operator_id, name, key_serializer, namespace, epoch)
        self.value_serializer: Serializer[Any] = get_serializer(value_serializer)

    def append_many(self, keys: Sequence[K], values: Sequence[V]) -> None:
        """Append values[i] to the list of keys[i] (keys may repeat; order is kept)."""
        self._call("ListAppend", self._keys(keys), values=self.value_serializer.dumps_many(list(values)))

    def append(self, key: K, value: V) -> None:
        """Append ``value`` to the list of ``key`` (one round trip: prefer :meth:`append_many` in loops)."""
        self.append_many([key], [value])

    def get_many(self, keys: Sequence[K]) -> list[list[V]]:
        """The whole list of each key, in order; an empty list where a key has none.

        Each list travels in one message: use :meth:`scan` for a list that may be very long.
        """
        kb = self._keys(keys)
        lists = _scatter(len(kb), self._call("ListGet", kb), answered_lists)
        loads = self.value_serializer.loads
        return [[loads(e) for e in elements] for elements in lists]

    def get(self, key: K) -> list[V]:
        """The whole list of ``key`` (empty when it has none); :meth:`scan` streams a very long one."""
        return self.get_many([key])[0]

    def update(self, key: K, values: Sequence[V]) -> None:
        """Replace the list of ``key`` (an empty sequence clears it)."""
        if not values:
            self.clear(key)
            return
        self._call("ListUpdate", self._keys([key] * len(values)), values=self.value_serializer.dumps_many(list(values)))

    def scan(self, key: K) -> Iterator[V]:
        """Stream a list of any size, in chunks."""
        kb = self.key_serializer.dumps(key)
        subtask = self.client.subtask_of(self.job_id, self.operator_id, kb)
        request = tm_pb.ScanRequest(
            target=tm_pb.StateTarget(
                job_id=self.job_id, operator_id=self.operator_id, subtask_index=subtask, state_name=self.name
            ),
            has_key=True,
            key=kb,
            namespace=self.namespace,
        )
        loads = self.value_serializer.loads
        for chunk in self.client.stream_call(self.job_id, self.operator_id, "ListScan", subtask, request, self.epoch):
            for e in chunk.values:
                yield loads(e)


class MapState(_Handle[K], Generic[K, UK, V]):
    kind = StateKind.MAP

    def __init__(
        self,
        client: StateClient,
        job_id: str,
        operator_id: str,
        name: str,
        key_serializer: str | Serializer[Any] = "str",
        user_key_serializer: str | Serializer[Any] = "str",
        value_serializer: str | Serializer[Any] = "pickle",
        namespace: bytes = b"",
        epoch: pb.EpochContext | EpochScope | None = None,
    ) -> None:
        super().__init__(client, job_id, operator_id, name, key_serializer, namespace, epoch)
        self.user_key_serializer: Serializer[Any] = get_serializer(user_key_serializer)
        self.value_serializer: Serializer[Any] = get_serializer(value_serializer)

    def put_many(self, keys: Sequence[K], user_keys: Sequence[UK], values: Sequence[V]) -> None:
        """Set entry ``user_keys[i]`` of the map of ``keys[i]`` to ``values[i]``; the three sequences must
        have equal lengths (InvalidArgumentError).
        """
        self._call(
            "MapPut",
            self._keys(keys),
            user_keys=self.user_key_serializer.dumps_many(list(user_keys)),
            values=self.value_serializer.dumps_many(list(values)),
        )

    def put(self, key: K, user_key: UK, value: V) -> None:
        """Set entry ``user_key`` of the map of ``key`` (one round trip: prefer :meth:`put_many` in loops)."""
        self.put_many([key], [user_key], [value])

    def get_many(self, keys: Sequence[K], user_keys: Sequence[UK]) -> list[V | None]:
        """The value of entry ``user_keys[i]`` in the map of ``keys[i]``, for every i; None where it is missing."""
        kb = self._keys(keys)
        results = self._call("MapGet", kb, user_keys=self.user_key_serializer.dumps_many(list(user_keys)))
        values = _scatter(len(kb), results, answered_values)
        found = _scatter(len(kb), results, answered_found)
        return _loads_found(self.value_serializer, values, found)

    def get(self, key: K, user_key: UK) -> V | None:
        """The value of entry ``user_key`` in the map of ``key``, or None (prefer :meth:`get_many` in loops)."""
        return self.get_many([key], [user_key])[0]

    def remove_many(self, keys: Sequence[K], user_keys: Sequence[UK]) -> None:
        """Delete entry ``user_keys[i]`` from the map of ``keys[i]``, for every i."""
        self._call("MapRemove", self._keys(keys), user_keys=self.user_key_serializer.dumps_many(list(user_keys)))

    def remove(self, key: K, user_key: UK) -> None:
        """Delete entry ``user_key`` from the map of ``key`` (prefer :meth:`remove_many` in loops)."""
        self.remove_many([key], [user_key])

    def contains_many(self, keys: Sequence[K], user_keys: Sequence[UK]) -> list[bool]:
        """Whether the map of ``keys[i]`` has entry ``user_keys[i]``, for every i (values are not transferred)."""
        kb = self._keys(keys)
        results = self._call("MapContains", kb, user_keys=self.user_key_serializer.dumps_many(list(user_keys)))
        return [bool(f) for f in _scatter(len(kb), results, answered_found)]

    def contains(self, key: K, user_key: UK) -> bool:
        """Whether the map of ``key`` has entry ``user_key`` (prefer :meth:`contains_many` in loops)."""
        return self.contains_many([key], [user_key])[0]

    def items(self, key: K) -> Iterator[tuple[UK, V]]:
        """Stream the entries of one key's map, ordered by serialized user key."""
        for uk, v in self._scan(key, keys_only=False):
            yield uk, cast(V, v)  # with keys_only=False every entry carries its value

    def user_keys(self, key: K) -> Iterator[UK]:
        """Stream the user keys of one key's map, ordered by serialized user key (values are not transferred)."""
        for uk, _ in self._scan(key, keys_only=True):
            yield uk

    def _scan(self, key: K, keys_only: bool) -> Iterator[tuple[UK, V | None]]:
        kb = self.key_serializer.dumps(key)
        subtask = self.client.subtask_of(self.job_id, self.operator_id, kb)
        request = tm_pb.ScanRequest(
            target=tm_pb.StateTarget(
                job_id=self.job_id, operator_id=self.operator_id, subtask_index=subtask, state_name=self.name
            ),
            has_key=True,
            key=kb,
            namespace=self.namespace,
            keys_only=keys_only,
        )
        uk_loads = self.user_key_serializer.loads
        v_loads = self.value_serializer.loads
        for chunk in self.client.stream_call(self.job_id, self.operator_id, "MapScan", subtask, request, self.epoch):
            if keys_only:
                for uk in chunk.user_keys:
                    yield uk_loads(uk), None
            else:
                for uk, v in zip(chunk.user_keys, chunk.values):
                    yield uk_loads(uk), v_loads(v)


class ReducingState(_Handle[K]):
    """Server-side reduce: ``add`` sends operands and the TaskManager folds them (SUM/MIN/MAX per field).

    A read-modify-write (count += 1, sum += amount) becomes one blind call.
    """

    kind = StateKind.REDUCING

    def __init__(
        self,
        client: StateClient,
        job_id: str,
        operator_id: str,
        name: str,
        key_serializer: str | Serializer[Any] = "str",
        namespace: bytes = b"",
        epoch: pb.EpochContext | EpochScope | None = None,
    ) -> None:
        super().__init__(client, job_id, operator_id, name, key_serializer, namespace, epoch)
        self._format = self.descriptor.vector_format
        self.fields = tuple(f.name for f in self.descriptor.reduce_fields)

    def add_many(
        self, keys: Sequence[K], operands: Sequence[Sequence[float | int]], return_values: bool = False
    ) -> list[tuple[Any, ...]] | None:
        """Fold ``operands[i]`` into the state of ``keys[i]`` on the TaskManager, in one blind call per batch.

        An operand holds one number per reduce field, in :attr:`fields` order (InvalidArgumentError
        otherwise). ``return_values``: also return each key's reduced tuple after its operand was
        folded in; without it the result is None.
        """
        pack = self._format.pack
        try:
            encoded = [pack(*op) for op in operands]
        except Exception as exc:
            from keyedstate.common.errors import InvalidArgumentError

            raise InvalidArgumentError(
                f"reducing state {self.name!r} takes operands of {len(self.fields)} numbers {self.fields}: {exc}"
            ) from exc
        kb = self._keys(keys)
        check_lengths("Reduce", keys=kb, operands=encoded)
        results = self.client.keyed_call(
            self.job_id,
            self.operator_id,
            self.name,
            "Reduce",
            kb,
            None,
            self.epoch,
            columns={"values": encoded},
            namespace=self.namespace,
            return_values=return_values,
        )
        if not return_values:
            return None
        unpack = self._format.unpack
        return [unpack(v) for v in _scatter(len(kb), results, answered_values)]

    def add(self, key: K, operand: Sequence[float | int]) -> None:
        """Fold one operand into the state of ``key`` (one round trip: prefer :meth:`add_many` in loops)."""
        self.add_many([key], [operand])

    def get_many(self, keys: Sequence[K]) -> list[tuple[Any, ...] | None]:
        """The reduced tuple of each key (one number per field, in :attr:`fields` order); None where a key has none."""
        kb = self._keys(keys)
        results = self._call("ValueGet", kb)
        values = _scatter(len(kb), results, answered_values)
        found = _scatter(len(kb), results, answered_found)
        unpack = self._format.unpack
        return [unpack(v) if f else None for v, f in zip(values, found)]

    def get(self, key: K) -> tuple[Any, ...] | None:
        """The reduced tuple of ``key``, or None when nothing was added (prefer :meth:`get_many` in loops)."""
        return self.get_many([key])[0]
