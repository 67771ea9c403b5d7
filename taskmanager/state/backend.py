"""The keyed-state backend of one slot: the abstract API, and the validation both backends share.

A backend holds the state of ONE (job, operator, subtask). Every batched call is validated as
a whole (state name and kind, sizes, list lengths, key-group ownership) before anything is
written, and then written atomically: a batch either applies completely or not at all.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from itertools import repeat
from pathlib import Path
from typing import Any, ClassVar

from keyedstate.common.clock import Clock
from keyedstate.common.descriptors import StateDescriptor, StateKind
from keyedstate.common.errors import (
    IncompatibleCheckpointError,
    InvalidArgumentError,
    KeyedStateError,
    NotFoundError,
    Reason,
    SizeLimitError,
    StaleRoutingError,
    UnavailableError,
    WrongStateKindError,
)
from keyedstate.common.ids import KeyGroupRange, SubtaskId
from keyedstate.common.keygroups import UPPER_BOUND_MAX_PARALLELISM
from keyedstate.common.keygroups import key_groups as key_groups_of
from keyedstate.taskmanager.state.limits import StateLimits
from keyedstate.taskmanager.state.metadata import COMMITTED_EPOCH, INTERNAL_META_PREFIX
from keyedstate.taskmanager.state.mutation import Mutation, MutationKind
from keyedstate.taskmanager.state.reducing import Reducer
from keyedstate.taskmanager.state.snapshot import LocalSnapshot, SnapshotManifest
from keyedstate.taskmanager.state.values import ValueCodec

logger = logging.getLogger(__name__)

# Internal op codes (tuples of ints are cheaper than Mutation objects on the batch paths).
OP_VALUE_PUT = 0
OP_CLEAR = 1
OP_REDUCE = 2
OP_LIST_APPEND = 3
OP_LIST_REPLACE = 4
OP_MAP_PUT = 5
OP_MAP_REMOVE = 6

# (code, state handle, key group, key, namespace, user key, value, values)
Op = tuple[int, "StateHandle", int, bytes, bytes, bytes, bytes, tuple[bytes, ...]]

_MUTATION_CODES = {
    MutationKind.VALUE_PUT: (OP_VALUE_PUT, (StateKind.VALUE,)),
    MutationKind.CLEAR: (OP_CLEAR, tuple(StateKind)),
    MutationKind.REDUCE: (OP_REDUCE, (StateKind.REDUCING,)),
    MutationKind.LIST_APPEND: (OP_LIST_APPEND, (StateKind.LIST,)),
    MutationKind.LIST_REPLACE: (OP_LIST_REPLACE, (StateKind.LIST,)),
    MutationKind.MAP_PUT: (OP_MAP_PUT, (StateKind.MAP,)),
    MutationKind.MAP_REMOVE: (OP_MAP_REMOVE, (StateKind.MAP,)),
}

_CALLS = {
    StateKind.VALUE: "ValueGet/ValuePut/Clear",
    StateKind.LIST: "ListAppend/ListGet/ListUpdate/ListScan/Clear",
    StateKind.MAP: "MapPut/MapGet/MapRemove/MapContains/MapScan/Clear",
    StateKind.REDUCING: "Reduce (ValueGet reads the current value)/Clear",
}

_VALUE = (StateKind.VALUE,)
_READABLE_VALUE = (StateKind.VALUE, StateKind.REDUCING)
_LIST = (StateKind.LIST,)
_MAP = (StateKind.MAP,)
_REDUCING = (StateKind.REDUCING,)
_ANY = tuple(StateKind)


class StateHandle:
    """One state of a slot as a backend sees it; ``store``/``handle`` belong to the backend."""

    __slots__ = ("codec", "descriptor", "handle", "kind", "name", "reducer", "store")

    def __init__(self, descriptor: StateDescriptor) -> None:
        self.descriptor = descriptor
        self.name = descriptor.name
        self.kind = descriptor.kind
        self.codec = ValueCodec.for_descriptor(descriptor)
        self.reducer = Reducer(descriptor) if descriptor.kind is StateKind.REDUCING else None
        self.store: Any = None
        self.handle: Any = None


def slot_db_dir(local_dir: Path, subtask: SubtaskId) -> Path:
    """Where a slot's working RocksDB lives."""
    return Path(local_dir) / subtask.instance_dir_name() / "db"


def check_compatible(declared: StateDescriptor, stored: StateDescriptor, where: str) -> None:
    """Raise unless state written as ``stored`` can be served as ``declared``."""
    if declared.kind is not stored.kind:
        raise IncompatibleCheckpointError(
            f"state {declared.name!r} is {stored.kind.value} state in {where} but the job declares it as "
            f"{declared.kind.value}; keep the kind or give the new state another name"
        )
    if declared.kind is StateKind.REDUCING and declared.vector_format.format != stored.vector_format.format:
        raise IncompatibleCheckpointError(
            f"reducing state {declared.name!r} has fields {[f.type.value for f in stored.reduce_fields]} in {where} but the "
            f"job declares {[f.type.value for f in declared.reduce_fields]}; keep the field types or use a new state name"
        )


class _InFlight:
    """Counts calls inside the backend so close() can wait for them (no use-after-close)."""

    __slots__ = ("_backend",)

    def __init__(self, backend: KeyedStateBackend) -> None:
        self._backend = backend

    def __enter__(self) -> None:
        b = self._backend
        with b._gate:
            if b._closing:
                raise UnavailableError(
                    f"the state backend of {b.subtask} is closed (slot released or shutting down); retry against the new owner",
                    reason=Reason.SHUTTING_DOWN,
                )
            b._inflight += 1

    def __exit__(self, *exc: object) -> None:
        b = self._backend
        with b._gate:
            b._inflight -= 1
            if b._inflight == 0:
                b._gate.notify_all()


class KeyedStateBackend(ABC):
    """State of ONE slot = one (job, operator, subtask): one RocksDB with one column family per state name.

    Thread-safe: the gRPC server calls it from many threads. ``namespaces`` is one ``bytes``
    for all keys of a batch or a list with one per key; keys are serialized key bytes.
    """

    BACKEND_KIND: ClassVar[str]
    _CLOSE_WAIT_S = 60.0

    def __init__(
        self,
        subtask: SubtaskId,
        key_groups: KeyGroupRange,
        max_parallelism: int,
        states: Sequence[StateDescriptor],
        *,
        limits: StateLimits,
        clock: Clock,
        carried: Sequence[StateDescriptor] = (),
    ) -> None:
        if not 1 <= max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
            raise InvalidArgumentError(f"max parallelism {max_parallelism} is outside 1..{UPPER_BOUND_MAX_PARALLELISM}")
        if len(key_groups) == 0 or key_groups.start < 0 or key_groups.end >= max_parallelism:
            raise InvalidArgumentError(
                f"key-group range {key_groups} of {subtask} must be non-empty and inside [0, {max_parallelism - 1}]"
            )
        names = [s.name for s in states]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"{subtask} declares a state name twice: {sorted(names)}")
        self.subtask = subtask
        self.key_groups = key_groups
        self.max_parallelism = max_parallelism
        self.limits = limits
        self.clock = clock
        self._states: dict[str, StateHandle] = {s.name: StateHandle(s) for s in states}
        # States found in restored data but no longer declared: kept (and snapshotted) so a later
        # job version can declare them again, but not served.
        self._carried: dict[str, StateHandle] = {s.name: StateHandle(s) for s in carried if s.name not in self._states}
        self._kg_start = key_groups.start
        self._kg_end = key_groups.end
        self._gate = threading.Condition(threading.Lock())
        self._inflight = 0
        self._closing = False
        self._op = _InFlight(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.subtask}, key_groups={self.key_groups})"

    # -- introspection ----------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closing

    def descriptor(self, state: str) -> StateDescriptor:
        return self._lookup(state).descriptor

    def descriptors(self) -> list[StateDescriptor]:
        return [h.descriptor for h in self._states.values()]

    def _all_handles(self) -> list[StateHandle]:
        return [*self._states.values(), *self._carried.values()]

    # -- validation -------------------------------------------------------------------------
    def _lookup(self, state: str) -> StateHandle:
        handle = self._states.get(state)
        if handle is None:
            known = ", ".join(sorted(self._states)) or "(none)"
            raise NotFoundError(
                f"unknown state {state!r} in {self.subtask}; the operator declares: {known}",
                reason=Reason.UNKNOWN_STATE,
            )
        return handle

    def _state(self, state: str, kinds: tuple[StateKind, ...], call: str) -> StateHandle:
        handle = self._lookup(state)
        if handle.kind not in kinds:
            raise WrongStateKindError(
                f"{call} does not apply to state {state!r}: it is {handle.kind.value} state; use {_CALLS[handle.kind]}"
            )
        return handle

    def _check_keys(self, keys: Sequence[bytes]) -> tuple[list[int], int]:
        """Key groups of the keys (checked to be this slot's) and the longest key's length."""
        if not keys:
            return [], 0
        max_len = max(map(len, keys))
        if max_len > self.limits.max_key_bytes:
            i = next(i for i, k in enumerate(keys) if len(k) > self.limits.max_key_bytes)
            raise SizeLimitError(
                f"key #{i} has {len(keys[i])} bytes, more than state.limits.max-key-bytes ({self.limits.max_key_bytes}); "
                "use shorter keys (for example a hash of a long key) or raise the limit"
            )
        kgs = key_groups_of(keys if isinstance(keys, list) else list(keys), self.max_parallelism)
        # The range is contiguous, so min/max (C loops) check every key at once.
        if min(kgs) < self._kg_start or max(kgs) > self._kg_end:
            i = next(i for i, g in enumerate(kgs) if not self._kg_start <= g <= self._kg_end)
            raise StaleRoutingError(
                f"key #{i} belongs to key group {kgs[i]}, which {self.subtask} does not own (it owns {self.key_groups}); "
                "the routing table is stale: refresh it and resend"
            )
        return kgs, max_len

    def _check_namespaces(self, namespaces: bytes | Sequence[bytes], n: int) -> bytes | list[bytes]:
        limit = self.limits.max_key_bytes
        if isinstance(namespaces, bytes):
            if len(namespaces) > limit:
                raise SizeLimitError(
                    f"namespace of {len(namespaces)} bytes exceeds state.limits.max-key-bytes ({limit}); use a shorter namespace"
                )
            return namespaces
        if isinstance(namespaces, (bytearray, memoryview)):
            return self._check_namespaces(bytes(namespaces), n)
        if not isinstance(namespaces, (list, tuple)):
            raise InvalidArgumentError(f"namespaces must be bytes or a list of bytes, got {type(namespaces).__name__}")
        if len(namespaces) != n:
            raise InvalidArgumentError(
                f"{len(namespaces)} namespaces for {n} keys; send one namespace per key, or a single one for all"
            )
        if n and max(map(len, namespaces)) > limit:
            i = next(i for i, ns in enumerate(namespaces) if len(ns) > limit)
            raise SizeLimitError(
                f"namespace #{i} has {len(namespaces[i])} bytes, more than state.limits.max-key-bytes ({limit})"
            )
        return list(namespaces)

    def _check_same_length(self, what: str, items: Sequence[bytes], n: int) -> None:
        if len(items) != n:
            raise InvalidArgumentError(f"{len(items)} {what} for {n} keys; send exactly one per key")

    def _check_values(self, values: Sequence[bytes], n: int, what: str = "values") -> None:
        self._check_same_length(what, values, n)
        limit = self.limits.max_value_bytes
        if n and max(map(len, values)) > limit:
            i = next(i for i, v in enumerate(values) if len(v) > limit)
            raise SizeLimitError(
                f"{what[:-1]} #{i} has {len(values[i])} bytes, more than state.limits.max-value-bytes ({limit}); "
                "split it (a list state stores elements separately) or raise the limit"
            )

    def _check_user_keys(self, user_keys: Sequence[bytes], n: int) -> None:
        self._check_same_length("user keys", user_keys, n)
        limit = self.limits.max_key_bytes
        if n and max(map(len, user_keys)) > limit:
            i = next(i for i, k in enumerate(user_keys) if len(k) > limit)
            raise SizeLimitError(
                f"user key #{i} has {len(user_keys[i])} bytes, more than state.limits.max-key-bytes ({limit})"
            )

    def _check_single(self, key: bytes, namespace: bytes) -> int:
        kgs, _ = self._check_keys([key])
        self._check_namespaces(namespace, 1)
        return kgs[0]

    def _check_list_length(self, current: int, adding: int, key: bytes) -> None:
        limit = self.limits.max_list_elements
        if current + adding > limit:
            raise SizeLimitError(
                f"the list of key {key[:32]!r} would grow to {current + adding} elements, more than "
                f"state.limits.list.max-elements ({limit}); clear or trim it, or raise the limit"
            )

    def _list_too_large(self, state: str, total: int) -> SizeLimitError:
        return SizeLimitError(
            f"ListGet of state {state!r} would return more than {total} bytes, past "
            f"state.limits.list.max-response-bytes ({self.limits.max_list_response_bytes}); "
            "read such a list with ListState.scan(key), which streams a list of any size (the ListScan call), or raise the limit"
        )

    @staticmethod
    def _ns_iter(namespaces: bytes | list[bytes], n: int) -> Any:
        return repeat(namespaces, n) if isinstance(namespaces, bytes) else namespaces

    # -- value ------------------------------------------------------------------------------
    def value_get(self, state: str, keys: list[bytes], namespaces: bytes | list[bytes]) -> list[bytes | None]:
        st = self._state(state, _READABLE_VALUE, "ValueGet")
        kgs, max_len = self._check_keys(keys)
        ns = self._check_namespaces(namespaces, len(keys))
        if not keys:
            return []
        with self._op:
            return self._value_get(st, kgs, keys, ns, max_len)

    def value_put(self, state: str, keys: list[bytes], values: list[bytes], namespaces: bytes | list[bytes]) -> None:
        st = self._state(state, _VALUE, "ValuePut")
        kgs, max_len = self._check_keys(keys)
        self._check_values(values, len(keys))
        ns = self._check_namespaces(namespaces, len(keys))
        if not keys:
            return
        with self._op:
            self._value_put(st, kgs, keys, values, ns, max_len)

    def clear(self, state: str, keys: list[bytes], namespaces: bytes | list[bytes]) -> None:
        """Remove every entry of each (key, namespace): a value, a whole list or a whole map."""
        st = self._state(state, _ANY, "Clear")
        kgs, _ = self._check_keys(keys)
        ns = self._check_namespaces(namespaces, len(keys))
        ops: list[Op] = [
            (OP_CLEAR, st, g, k, n, b"", b"", ()) for g, k, n in zip(kgs, keys, self._ns_iter(ns, len(keys)))
        ]
        self._run(ops)

    def reduce(
        self, state: str, keys: list[bytes], operands: list[bytes], namespaces: bytes | list[bytes], return_values: bool
    ) -> list[bytes] | None:
        """Fold each operand into the key's vector, in order; optionally return each new vector."""
        st = self._state(state, _REDUCING, "Reduce")
        kgs, _ = self._check_keys(keys)
        self._check_same_length("operands", operands, len(keys))
        assert st.reducer is not None
        st.reducer.check_operands(operands)
        ns = self._check_namespaces(namespaces, len(keys))
        ops: list[Op] = [
            (OP_REDUCE, st, g, k, n, b"", v, ())
            for g, k, v, n in zip(kgs, keys, operands, self._ns_iter(ns, len(keys)))
        ]
        results = self._run(ops)
        return results if return_values else None

    # -- list -------------------------------------------------------------------------------
    def list_append(self, state: str, keys: list[bytes], values: list[bytes], namespaces: bytes | list[bytes]) -> None:
        """Append one element per key (keys may repeat; order is kept)."""
        st = self._state(state, _LIST, "ListAppend")
        kgs, _ = self._check_keys(keys)
        self._check_values(values, len(keys))
        ns = self._check_namespaces(namespaces, len(keys))
        ops: list[Op] = [
            (OP_LIST_APPEND, st, g, k, n, b"", b"", (v,))
            for g, k, v, n in zip(kgs, keys, values, self._ns_iter(ns, len(keys)))
        ]
        self._run(ops)

    def list_get(self, state: str, keys: list[bytes], namespaces: bytes | list[bytes]) -> list[list[bytes]]:
        st = self._state(state, _LIST, "ListGet")
        kgs, max_len = self._check_keys(keys)
        ns = self._check_namespaces(namespaces, len(keys))
        if not keys:
            return []
        with self._op:
            return self._list_get(st, kgs, keys, ns, max_len)

    def list_update(self, state: str, keys: list[bytes], values: list[bytes], namespaces: bytes | list[bytes]) -> None:
        """Replace lists: each distinct (key, namespace) becomes the values given for it, in order."""
        st = self._state(state, _LIST, "ListUpdate")
        kgs, _ = self._check_keys(keys)
        self._check_values(values, len(keys))
        ns = self._check_namespaces(namespaces, len(keys))
        grouped: dict[tuple[bytes, bytes], tuple[int, list[bytes]]] = {}
        for g, k, v, n in zip(kgs, keys, values, self._ns_iter(ns, len(keys))):
            entry = grouped.get((k, n))
            if entry is None:
                grouped[(k, n)] = (g, [v])
            else:
                entry[1].append(v)
        ops: list[Op] = [(OP_LIST_REPLACE, st, g, k, n, b"", b"", tuple(vs)) for (k, n), (g, vs) in grouped.items()]
        self._run(ops)

    def list_scan(self, state: str, key: bytes, namespace: bytes) -> Iterator[bytes]:
        """Stream one list of any size (validated now, read lazily in chunks)."""
        st = self._state(state, _LIST, "ListScan")
        kg = self._check_single(key, namespace)
        return self._list_scan(st, kg, key, namespace)

    # -- map --------------------------------------------------------------------------------
    def map_put(
        self,
        state: str,
        keys: list[bytes],
        user_keys: list[bytes],
        values: list[bytes],
        namespaces: bytes | list[bytes],
    ) -> None:
        st = self._state(state, _MAP, "MapPut")
        kgs, _ = self._check_keys(keys)
        self._check_user_keys(user_keys, len(keys))
        self._check_values(values, len(keys))
        ns = self._check_namespaces(namespaces, len(keys))
        ops: list[Op] = [
            (OP_MAP_PUT, st, g, k, n, uk, v, ())
            for g, k, uk, v, n in zip(kgs, keys, user_keys, values, self._ns_iter(ns, len(keys)))
        ]
        self._run(ops)

    def map_get(
        self, state: str, keys: list[bytes], user_keys: list[bytes], namespaces: bytes | list[bytes]
    ) -> list[bytes | None]:
        st = self._state(state, _MAP, "MapGet")
        kgs, max_len = self._check_keys(keys)
        self._check_user_keys(user_keys, len(keys))
        ns = self._check_namespaces(namespaces, len(keys))
        if not keys:
            return []
        with self._op:
            return self._map_get(st, kgs, keys, user_keys, ns, max_len)

    def map_remove(
        self, state: str, keys: list[bytes], user_keys: list[bytes], namespaces: bytes | list[bytes]
    ) -> None:
        st = self._state(state, _MAP, "MapRemove")
        kgs, _ = self._check_keys(keys)
        self._check_user_keys(user_keys, len(keys))
        ns = self._check_namespaces(namespaces, len(keys))
        ops: list[Op] = [
            (OP_MAP_REMOVE, st, g, k, n, uk, b"", ())
            for g, k, uk, n in zip(kgs, keys, user_keys, self._ns_iter(ns, len(keys)))
        ]
        self._run(ops)

    def map_contains(
        self, state: str, keys: list[bytes], user_keys: list[bytes], namespaces: bytes | list[bytes]
    ) -> list[bool]:
        st = self._state(state, _MAP, "MapContains")
        kgs, max_len = self._check_keys(keys)
        self._check_user_keys(user_keys, len(keys))
        ns = self._check_namespaces(namespaces, len(keys))
        if not keys:
            return []
        with self._op:
            return [v is not None for v in self._map_get(st, kgs, keys, user_keys, ns, max_len)]

    def map_scan(
        self, state: str, key: bytes, namespace: bytes, keys_only: bool = False
    ) -> Iterator[tuple[bytes, bytes]]:
        """(user_key, value) of one map sorted by user-key bytes; value is b"" with ``keys_only``."""
        st = self._state(state, _MAP, "MapScan")
        kg = self._check_single(key, namespace)
        return self._map_scan(st, kg, key, namespace, keys_only)

    def scan_keys(self, state: str) -> Iterator[tuple[bytes, bytes]]:
        """Every distinct (key, namespace) of ``state`` holding at least one live entry."""
        st = self._state(state, _ANY, "ScanKeys")
        return self._scan_keys(st)

    # -- mutations & metadata ---------------------------------------------------------------
    def apply(self, mutations: Sequence[Mutation], meta: dict[bytes, bytes] | None = None) -> int:
        """Apply logical mutations (and metadata writes) atomically; returns how many were applied.

        Everything is validated first; a bad mutation anywhere means nothing is written.
        """
        ops: list[Op] = []
        for i, m in enumerate(mutations):
            try:
                ops.append(self._mutation_op(m))
            except (InvalidArgumentError, NotFoundError, WrongStateKindError, SizeLimitError, StaleRoutingError) as exc:
                raise exc.with_message(f"mutation #{i} ({m.kind.value} on {m.state!r}): {exc.message}") from exc
        checked_meta = self._check_meta(meta)
        self._run(ops, checked_meta)
        return len(ops)

    def _mutation_op(self, m: Mutation) -> Op:
        if not isinstance(m, Mutation):
            raise InvalidArgumentError(f"expected a Mutation, got {type(m).__name__}")
        code, kinds = _MUTATION_CODES[m.kind]
        st = self._state(m.state, kinds, m.kind.value)
        kg = self._check_single(m.key, m.namespace)
        if code in (OP_LIST_APPEND, OP_LIST_REPLACE):
            if m.value and not m.values:
                raise InvalidArgumentError(f"{m.kind.value} takes its elements in `values`, not `value`")
            self._check_values(list(m.values), len(m.values))
        elif code in (OP_VALUE_PUT, OP_REDUCE, OP_MAP_PUT):
            self._check_values([m.value], 1)
        if code in (OP_MAP_PUT, OP_MAP_REMOVE):
            self._check_user_keys([m.user_key], 1)
        if code == OP_REDUCE:
            assert st.reducer is not None
            st.reducer.check_operands([m.value])
        return (code, st, kg, m.key, m.namespace, m.user_key, m.value, tuple(m.values))

    def _check_meta(self, meta: dict[bytes, bytes] | None) -> dict[bytes, bytes] | None:
        if not meta:
            return None
        for k, v in meta.items():
            if not isinstance(k, bytes) or not isinstance(v, bytes) or not k:
                raise InvalidArgumentError("meta keys and values must be bytes (keys non-empty)")
            if k.startswith(INTERNAL_META_PREFIX):
                raise InvalidArgumentError(f"meta key {k!r} is reserved for the backend (keys starting with 0x00)")
        return dict(meta)

    def _run(self, ops: list[Op], meta: dict[bytes, bytes] | None = None) -> list[bytes]:
        if not ops and not meta:
            return []
        with self._op:
            return self._execute(ops, meta)

    @abstractmethod
    def get_meta(self, key: bytes) -> bytes | None:
        """A slot metadata value (for example :data:`.metadata.COMMITTED_EPOCH`)."""

    def committed_epoch(self) -> int:
        """The last epoch committed into this slot (-1: none); written atomically with the epoch's data."""
        raw = self.get_meta(COMMITTED_EPOCH)
        if not raw:
            return -1
        try:
            return int(raw.decode("ascii"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise KeyedStateError(
                f"slot {self.subtask} has a malformed committed epoch {raw[:32]!r} in its metadata",
                reason=Reason.INTERNAL,
            ) from exc

    # -- backend primitives (called after validation, inside the in-flight gate) ------------
    @abstractmethod
    def _value_get(
        self, st: StateHandle, kgs: list[int], keys: list[bytes], ns: bytes | list[bytes], max_len: int
    ) -> list[bytes | None]: ...

    @abstractmethod
    def _value_put(
        self,
        st: StateHandle,
        kgs: list[int],
        keys: list[bytes],
        values: list[bytes],
        ns: bytes | list[bytes],
        max_len: int,
    ) -> None: ...

    @abstractmethod
    def _execute(self, ops: list[Op], meta: dict[bytes, bytes] | None) -> list[bytes]:
        """Apply ops in order, atomically; returns the new vector of every REDUCE op."""

    @abstractmethod
    def _list_get(
        self, st: StateHandle, kgs: list[int], keys: list[bytes], ns: bytes | list[bytes], max_len: int
    ) -> list[list[bytes]]: ...

    @abstractmethod
    def _list_scan(self, st: StateHandle, kg: int, key: bytes, namespace: bytes) -> Iterator[bytes]: ...

    @abstractmethod
    def _map_get(
        self,
        st: StateHandle,
        kgs: list[int],
        keys: list[bytes],
        user_keys: list[bytes],
        ns: bytes | list[bytes],
        max_len: int,
    ) -> list[bytes | None]: ...

    @abstractmethod
    def _map_scan(
        self, st: StateHandle, kg: int, key: bytes, namespace: bytes, keys_only: bool
    ) -> Iterator[tuple[bytes, bytes]]: ...

    @abstractmethod
    def _scan_keys(self, st: StateHandle) -> Iterator[tuple[bytes, bytes]]: ...

    # -- lifecycle --------------------------------------------------------------------------
    @abstractmethod
    def snapshot(self, target_dir: Path) -> LocalSnapshot:
        """The synchronous part of a checkpoint into ``target_dir`` (which must not exist)."""

    @classmethod
    @abstractmethod
    def restore(
        cls,
        subtask: SubtaskId,
        key_groups: KeyGroupRange,
        max_parallelism: int,
        states: Sequence[StateDescriptor],
        *,
        snapshot_dirs: Sequence[Path],
        local_dir: Path,
        limits: StateLimits,
        clock: Clock,
        resources: Any = None,
    ) -> KeyedStateBackend:
        """A backend for ``key_groups`` built from local snapshots, keeping only its key groups."""

    @abstractmethod
    def ttl_sweep(self, max_entries: int) -> int:
        """Examine up to ``max_entries`` entries from where the last sweep stopped; delete the expired."""

    @abstractmethod
    def stats(self) -> dict[str, int]: ...

    def close(self) -> None:
        """Wait for calls in flight, then release everything. Idempotent."""
        with self._gate:
            if self._closing:
                return
            self._closing = True
            if not self._gate.wait_for(lambda: self._inflight == 0, timeout=self._CLOSE_WAIT_S):
                logger.error(
                    "%s: %d calls still running after %.0f s; closing anyway", self, self._inflight, self._CLOSE_WAIT_S
                )
        self._close()

    @abstractmethod
    def _close(self) -> None: ...

    # -- shared snapshot helpers ------------------------------------------------------------
    def _manifest(self) -> SnapshotManifest:
        return SnapshotManifest(
            backend=self.BACKEND_KIND,
            subtask=self.subtask,
            key_groups=self.key_groups,
            max_parallelism=self.max_parallelism,
            states=tuple(h.descriptor for h in self._all_handles()),
            created_ms=self.clock.now_ms(),
        )
