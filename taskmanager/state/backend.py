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
from keyedstate.taskmanager.state.limits import StateLimits
from keyedstate.taskmanager.state.metadata import COMMITTED_EPOCH, INTERNAL_META_PREFIX
from keyedstate.taskmanager.state.mutation import Mutation, MutationKind
from keyedstate.taskmanager.state.snapshot import LocalSnapshot, SnapshotManifest
from keyedstate.taskmanager.state.validation import (
    ANY_KIND,
    LIST,
    MAP,
    READABLE_VALUE,
    REDUCING,
    VALUE,
    RequestValidator,
    StateHandle,
)

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

_LIST_CHANGES = frozenset({MutationKind.LIST_APPEND, MutationKind.LIST_REPLACE, MutationKind.CLEAR})
"""The mutation kinds whose apply may meet ``state.limits.list.max-elements`` (a clear resets a list's count)."""

_MUTATION_CODES = {
    MutationKind.VALUE_PUT: (OP_VALUE_PUT, (StateKind.VALUE,)),
    MutationKind.CLEAR: (OP_CLEAR, tuple(StateKind)),
    MutationKind.REDUCE: (OP_REDUCE, (StateKind.REDUCING,)),
    MutationKind.LIST_APPEND: (OP_LIST_APPEND, (StateKind.LIST,)),
    MutationKind.LIST_REPLACE: (OP_LIST_REPLACE, (StateKind.LIST,)),
    MutationKind.MAP_PUT: (OP_MAP_PUT, (StateKind.MAP,)),
    MutationKind.MAP_REMOVE: (OP_MAP_REMOVE, (StateKind.MAP,)),
}


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
    """Counts calls inside a backend so close() can wait for them (no use-after-close)."""

    __slots__ = ("_closing", "_count", "_gate", "_subtask")

    def __init__(self, subtask: SubtaskId) -> None:
        self._subtask = subtask
        self._gate = threading.Condition(threading.Lock())
        self._count = 0
        self._closing = False

    @property
    def closing(self) -> bool:
        return self._closing

    def __enter__(self) -> None:
        with self._gate:
            if self._closing:
                raise UnavailableError(
                    f"the state backend of {self._subtask} is closed (slot released or shutting down); retry against the new owner",
                    reason=Reason.SHUTTING_DOWN,
                )
            self._count += 1

    def __exit__(self, *exc: object) -> None:
        with self._gate:
            self._count -= 1
            if self._count == 0:
                self._gate.notify_all()

    def close(self, timeout_s: float) -> tuple[bool, int]:
        """Refuse new calls and wait for those running: (first close, calls still running after the wait)."""
        with self._gate:
            if self._closing:
                return False, 0
            self._closing = True
            self._gate.wait_for(lambda: self._count == 0, timeout=timeout_s)
            return True, self._count


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
        self.validation = RequestValidator(subtask, key_groups, max_parallelism, limits, self._states)
        """The request checks of this slot, shared with the epoch transaction (one set of rules)."""
        self._op = _InFlight(subtask)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.subtask}, key_groups={self.key_groups})"

    # -- introspection ----------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Closed (or closing): every call is refused with UNAVAILABLE."""
        return self._op.closing

    def descriptor(self, state: str) -> StateDescriptor:
        """The declared state ``state`` (NotFoundError when the operator does not declare it)."""
        return self.validation.lookup(state).descriptor

    def descriptors(self) -> list[StateDescriptor]:
        """The states the operator declares (not the carried ones)."""
        return [h.descriptor for h in self._states.values()]

    def _all_handles(self) -> list[StateHandle]:
        return [*self._states.values(), *self._carried.values()]

    @staticmethod
    def _ns_iter(namespaces: bytes | list[bytes], n: int) -> Any:
        return repeat(namespaces, n) if isinstance(namespaces, bytes) else namespaces

    # -- value ------------------------------------------------------------------------------
    def value_get(self, state: str, keys: list[bytes], namespaces: bytes | list[bytes]) -> list[bytes | None]:
        """The value of each (key, namespace), None where unset; reducing state reads its current vector."""
        st, kgs, max_len, ns = self.validation.batch(state, READABLE_VALUE, "ValueGet", keys, namespaces)
        if not keys:
            return []
        with self._op:
            return self._value_get(st, kgs, keys, ns, max_len)

    def value_put(self, state: str, keys: list[bytes], values: list[bytes], namespaces: bytes | list[bytes]) -> None:
        """Set one value per key (a later duplicate key in the batch wins)."""
        st, kgs, max_len, ns = self.validation.batch(state, VALUE, "ValuePut", keys, namespaces, values=values)
        if not keys:
            return
        with self._op:
            self._value_put(st, kgs, keys, values, ns, max_len)

    def clear(self, state: str, keys: list[bytes], namespaces: bytes | list[bytes]) -> None:
        """Remove every entry of each (key, namespace): a value, a whole list or a whole map."""
        st, kgs, _, ns = self.validation.batch(state, ANY_KIND, "Clear", keys, namespaces)
        ops: list[Op] = [
            (OP_CLEAR, st, g, k, n, b"", b"", ()) for g, k, n in zip(kgs, keys, self._ns_iter(ns, len(keys)))
        ]
        self._run(ops)

    def reduce(
        self, state: str, keys: list[bytes], operands: list[bytes], namespaces: bytes | list[bytes], return_values: bool
    ) -> list[bytes] | None:
        """Fold each operand into the key's vector, in order; optionally return each new vector."""
        st, kgs, _, ns = self.validation.batch(state, REDUCING, "Reduce", keys, namespaces, operands=operands)
        ops: list[Op] = [
            (OP_REDUCE, st, g, k, n, b"", v, ())
            for g, k, v, n in zip(kgs, keys, operands, self._ns_iter(ns, len(keys)))
        ]
        results = self._run(ops)
        return results if return_values else None

    # -- list -------------------------------------------------------------------------------
    def list_append(self, state: str, keys: list[bytes], values: list[bytes], namespaces: bytes | list[bytes]) -> None:
        """Append one element per key (keys may repeat; order is kept)."""
        st, kgs, _, ns = self.validation.batch(state, LIST, "ListAppend", keys, namespaces, values=values)
        ops: list[Op] = [
            (OP_LIST_APPEND, st, g, k, n, b"", b"", (v,))
            for g, k, v, n in zip(kgs, keys, values, self._ns_iter(ns, len(keys)))
        ]
        self._run(ops)

    def list_get(self, state: str, keys: list[bytes], namespaces: bytes | list[bytes]) -> list[list[bytes]]:
        """Each key's whole list (bounded by ``state.limits.list.max-response-bytes``; see list_scan)."""
        st, kgs, max_len, ns = self.validation.batch(state, LIST, "ListGet", keys, namespaces)
        if not keys:
            return []
        with self._op:
            return self._list_get(st, kgs, keys, ns, max_len)

    def list_update(self, state: str, keys: list[bytes], values: list[bytes], namespaces: bytes | list[bytes]) -> None:
        """Replace lists: each distinct (key, namespace) becomes the values given for it, in order."""
        st, kgs, _, ns = self.validation.batch(state, LIST, "ListUpdate", keys, namespaces, values=values)
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
        st, kg = self.validation.single_key(state, LIST, "ListScan", key, namespace)
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
        """Set one map entry (user key -> value) per key."""
        st, kgs, _, ns = self.validation.batch(
            state, MAP, "MapPut", keys, namespaces, user_keys=user_keys, values=values
        )
        ops: list[Op] = [
            (OP_MAP_PUT, st, g, k, n, uk, v, ())
            for g, k, uk, v, n in zip(kgs, keys, user_keys, values, self._ns_iter(ns, len(keys)))
        ]
        self._run(ops)

    def map_get(
        self, state: str, keys: list[bytes], user_keys: list[bytes], namespaces: bytes | list[bytes]
    ) -> list[bytes | None]:
        """The value of each (key, user key), None where absent."""
        st, kgs, max_len, ns = self.validation.batch(state, MAP, "MapGet", keys, namespaces, user_keys=user_keys)
        if not keys:
            return []
        with self._op:
            return self._map_get(st, kgs, keys, user_keys, ns, max_len)

    def map_remove(
        self, state: str, keys: list[bytes], user_keys: list[bytes], namespaces: bytes | list[bytes]
    ) -> None:
        """Remove one map entry per key (absent entries are no error)."""
        st, kgs, _, ns = self.validation.batch(state, MAP, "MapRemove", keys, namespaces, user_keys=user_keys)
        ops: list[Op] = [
            (OP_MAP_REMOVE, st, g, k, n, uk, b"", ())
            for g, k, uk, n in zip(kgs, keys, user_keys, self._ns_iter(ns, len(keys)))
        ]
        self._run(ops)

    def map_contains(
        self, state: str, keys: list[bytes], user_keys: list[bytes], namespaces: bytes | list[bytes]
    ) -> list[bool]:
        """Whether each (key, user key) has an entry."""
        st, kgs, max_len, ns = self.validation.batch(state, MAP, "MapContains", keys, namespaces, user_keys=user_keys)
        if not keys:
            return []
        with self._op:
            return [v is not None for v in self._map_get(st, kgs, keys, user_keys, ns, max_len)]

    def map_scan(
        self, state: str, key: bytes, namespace: bytes, keys_only: bool = False
    ) -> Iterator[tuple[bytes, bytes]]:
        """(user_key, value) of one map sorted by user-key bytes; value is b"" with ``keys_only``."""
        st, kg = self.validation.single_key(state, MAP, "MapScan", key, namespace)
        return self._map_scan(st, kg, key, namespace, keys_only)

    def scan_keys(self, state: str) -> Iterator[tuple[bytes, bytes]]:
        """Every distinct (key, namespace) of ``state`` holding at least one live entry."""
        st = self.validation.state(state, ANY_KIND, "ScanKeys")
        return self._scan_keys(st)

    # -- mutations & metadata ---------------------------------------------------------------
    def apply(self, mutations: Sequence[Mutation], meta: dict[bytes, bytes] | None = None) -> int:
        """Apply logical mutations (and metadata writes) atomically; returns how many were applied.

        Everything is validated first; a bad mutation anywhere means nothing is written.
        """
        ops = self._mutation_ops(mutations)
        checked_meta = self._check_meta(meta)
        self._run(ops, checked_meta)
        return len(ops)

    def check_applicable(self, mutations: Sequence[Mutation]) -> None:
        """Raise what :meth:`apply` of ``mutations`` would raise on the current state; write nothing.

        An overlapped commit decides an epoch before it is applied, so its Prepare must meet every
        failure the apply could. Each staged mutation passed this backend's checks when it was
        staged (what :meth:`apply_validated` relies on too); the list lengths are the only checks
        that depend on the stored data, so only the mutations that can change a list are looked at
        (a reduce-only epoch costs nothing here).
        """
        ops = self._mutation_ops([m for m in mutations if m.kind in _LIST_CHANGES])
        with self._op:
            self._check_list_lengths(ops, {})

    def _mutation_ops(self, mutations: Sequence[Mutation]) -> list[Op]:
        ops: list[Op] = []
        for i, m in enumerate(mutations):
            try:
                ops.append(self._mutation_op(m))
            except (InvalidArgumentError, NotFoundError, WrongStateKindError, SizeLimitError, StaleRoutingError) as exc:
                raise exc.with_message(f"mutation #{i} ({m.kind.value} on {m.state!r}): {exc.message}") from exc
        return ops

    def _check_list_lengths(self, ops: Sequence[Op], cache: dict[str, Any]) -> None:
        """Refuse ``ops`` if applying them in order would grow a list past ``state.limits.list.max-elements``."""
        lengths: dict[tuple[str, bytes, bytes], int] = {}
        for code, st, kg, key, ns, _uk, _v, values in ops:
            if st.kind is not StateKind.LIST or code not in (OP_LIST_APPEND, OP_LIST_REPLACE, OP_CLEAR):
                continue
            slot = (st.name, key, ns)
            if code == OP_CLEAR:
                lengths[slot] = 0
                continue
            if code == OP_LIST_REPLACE:
                current = 0
            elif slot in lengths:
                current = lengths[slot]
            else:
                current = self._stored_list_length(st, kg, key, ns, cache)
            self.validation.list_length(current, len(values), key)
            lengths[slot] = current + len(values)

    @abstractmethod
    def _stored_list_length(self, st: StateHandle, kg: int, key: bytes, ns: bytes, cache: dict[str, Any]) -> int:
        """How many elements the stored list of (key, namespace) holds (``cache``: per-call readers, e.g. iterators)."""

    def apply_validated(self, ops: list[Op], meta: dict[bytes, bytes] | None = None) -> int:
        """Apply operations checked when they were staged (the epoch commit's fast path), atomically.

        The caller vouches that every op passed this backend's ``validation`` (state, kind, sizes,
        key groups); only the metadata and the list lengths, which depend on the stored data,
        are checked here, as :meth:`apply` checks them. Returns how many ops were applied.
        """
        checked_meta = self._check_meta(meta)
        self._run(ops, checked_meta)
        return len(ops)

    def _mutation_op(self, m: Mutation) -> Op:
        if not isinstance(m, Mutation):
            raise InvalidArgumentError(f"expected a Mutation, got {type(m).__name__}")
        code, kinds = _MUTATION_CODES[m.kind]
        v = self.validation
        st, kg = v.single_key(m.state, kinds, m.kind.value, m.key, m.namespace)
        if code in (OP_LIST_APPEND, OP_LIST_REPLACE):
            if m.value and not m.values:
                raise InvalidArgumentError(f"{m.kind.value} takes its elements in `values`, not `value`")
            v.values(list(m.values), len(m.values))
        elif code in (OP_VALUE_PUT, OP_REDUCE, OP_MAP_PUT):
            v.values([m.value], 1)
        if code in (OP_MAP_PUT, OP_MAP_REMOVE):
            v.user_keys([m.user_key], 1)
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
    def stats(self) -> dict[str, int]:
        """Backend counters for the metrics endpoint (names follow RocksDB properties, such as ``estimate-num-keys``)."""

    def close(self) -> None:
        """Wait for calls in flight, then release everything. Idempotent."""
        first, running = self._op.close(self._CLOSE_WAIT_S)
        if not first:
            return
        if running:
            logger.error("%s: %d calls still running after %.0f s; closing anyway", self, running, self._CLOSE_WAIT_S)
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
