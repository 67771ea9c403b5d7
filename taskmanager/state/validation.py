"""The checks every state call passes before anything is read or written, written once.

A direct call (``KeyedStateBackend``) and an epoch-scoped one (the epoch transaction) must be
refused for exactly the same reasons with the same messages, so a commit never meets a mutation
the backend would reject for its shape. Both run the request through one
:class:`RequestValidator`: state name and kind, sizes, list lengths, key-group ownership.

The checks are per request (``min``/``max`` over the batch run in C); nothing here loops per
key in Python except to name the offending item once a check has already failed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from keyedstate.common.descriptors import StateDescriptor, StateKind
from keyedstate.common.errors import (
    InvalidArgumentError,
    NotFoundError,
    Reason,
    SizeLimitError,
    StaleRoutingError,
    WrongStateKindError,
)
from keyedstate.common.ids import KeyGroupRange, SubtaskId
from keyedstate.common.keygroups import key_groups as key_groups_of
from keyedstate.taskmanager.state.limits import StateLimits
from keyedstate.taskmanager.state.reducing import Reducer
from keyedstate.taskmanager.state.values import ValueCodec

VALUE = (StateKind.VALUE,)
READABLE_VALUE = (StateKind.VALUE, StateKind.REDUCING)
LIST = (StateKind.LIST,)
MAP = (StateKind.MAP,)
REDUCING = (StateKind.REDUCING,)
ANY_KIND = tuple(StateKind)
"""The state kinds each call applies to (ValueGet also reads reducing state)."""

_CALLS = {
    StateKind.VALUE: "ValueGet/ValuePut/Clear",
    StateKind.LIST: "ListAppend/ListGet/ListUpdate/ListScan/Clear",
    StateKind.MAP: "MapPut/MapGet/MapRemove/MapContains/MapScan/Clear",
    StateKind.REDUCING: "Reduce (ValueGet reads the current value)/Clear",
    StateKind.TIMERS: "the TimerService (MapPut/MapRemove/MapScan of its anchor keys)/Clear",
}

Namespaces = bytes | list[bytes]
"""One namespace for every key of a batch, or one per key."""

CheckedBatch = tuple["StateHandle", list[int], int, Namespaces]
"""A validated batch: the state, each key's key group, the longest key's length, the namespaces."""


class StateHandle:
    """One state of a slot as a backend sees it; ``store``/``handle`` belong to the backend."""

    __slots__ = ("codec", "descriptor", "handle", "kind", "name", "reducer", "store")

    def __init__(self, descriptor: StateDescriptor) -> None:
        self.descriptor = descriptor
        self.name = descriptor.name
        # Backends, snapshots and epochs handle a state by its stored layout (timers are map entries).
        self.kind = descriptor.kind.storage_kind
        self.codec = ValueCodec.for_descriptor(descriptor)
        self.reducer = Reducer(descriptor) if descriptor.kind is StateKind.REDUCING else None
        self.store: Any = None
        self.handle: Any = None


class RequestValidator:
    """The request checks of one slot (its states, key groups and limits)."""

    __slots__ = ("_kg_end", "_kg_start", "_states", "key_groups", "limits", "max_parallelism", "subtask")

    def __init__(
        self,
        subtask: SubtaskId,
        key_groups: KeyGroupRange,
        max_parallelism: int,
        limits: StateLimits,
        states: Mapping[str, StateHandle],
    ) -> None:
        self.subtask = subtask
        self.key_groups = key_groups
        self.max_parallelism = max_parallelism
        self.limits = limits
        self._states = states
        self._kg_start = key_groups.start
        self._kg_end = key_groups.end

    # -- whole requests -------------------------------------------------------------------------
    def batch(
        self,
        state: str,
        kinds: tuple[StateKind, ...],
        call: str,
        keys: Sequence[bytes],
        namespaces: bytes | Sequence[bytes],
        *,
        user_keys: Sequence[bytes] | None = None,
        values: Sequence[bytes] | None = None,
        operands: Sequence[bytes] | None = None,
    ) -> CheckedBatch:
        """Check a batched call as a whole, in the order its errors are reported: state, keys, user
        keys, values, reduce operands, namespaces."""
        st = self.state(state, kinds, call)
        kgs, max_len = self.keys(keys)
        n = len(keys)
        if user_keys is not None:
            self.user_keys(user_keys, n)
        if values is not None:
            self.values(values, n)
        if operands is not None:
            self.same_length("operands", operands, n)
            assert st.reducer is not None
            st.reducer.check_operands(operands)
        return st, kgs, max_len, self.namespaces(namespaces, n)

    def single_key(
        self, state: str, kinds: tuple[StateKind, ...], call: str, key: bytes, namespace: bytes
    ) -> tuple[StateHandle, int]:
        """Check a call on one (key, namespace), such as a scan; returns the state and the key group."""
        st = self.state(state, kinds, call)
        return st, self.single(key, namespace)

    # -- single checks ----------------------------------------------------------------------------
    def lookup(self, state: str) -> StateHandle:
        """The declared state ``state``, or NotFoundError naming the declared ones."""
        handle = self._states.get(state)
        if handle is None:
            known = ", ".join(sorted(self._states)) or "(none)"
            raise NotFoundError(
                f"unknown state {state!r} in {self.subtask}; the operator declares: {known}",
                reason=Reason.UNKNOWN_STATE,
            )
        return handle

    def state(self, state: str, kinds: tuple[StateKind, ...], call: str) -> StateHandle:
        """The declared state ``state`` if ``call`` applies to its kind."""
        handle = self.lookup(state)
        if handle.kind not in kinds:
            raise WrongStateKindError(
                f"{call} does not apply to state {state!r}: it is {handle.descriptor.kind.value} state; use {_CALLS[handle.descriptor.kind]}"
            )
        return handle

    def keys(self, keys: Sequence[bytes]) -> tuple[list[int], int]:
        """Key groups of the keys (checked to be this slot's) and the longest key's length."""
        if not keys:
            return [], 0
        limits = self.limits
        max_len = max(map(len, keys))
        if max_len > limits.max_key_bytes:
            i = next(i for i, k in enumerate(keys) if len(k) > limits.max_key_bytes)
            raise SizeLimitError(
                f"key #{i} has {len(keys[i])} bytes, more than state.limits.max-key-bytes ({limits.max_key_bytes}); "
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

    def namespaces(self, namespaces: bytes | Sequence[bytes], n: int) -> Namespaces:
        """One namespace for all ``n`` keys, or a list of exactly ``n``; each within the key size limit."""
        limit = self.limits.max_key_bytes
        if isinstance(namespaces, bytes):
            if len(namespaces) > limit:
                raise SizeLimitError(
                    f"namespace of {len(namespaces)} bytes exceeds state.limits.max-key-bytes ({limit}); use a shorter namespace"
                )
            return namespaces
        if isinstance(namespaces, (bytearray, memoryview)):
            return self.namespaces(bytes(namespaces), n)
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

    def same_length(self, what: str, items: Sequence[bytes], n: int) -> None:
        """Exactly one of ``what`` per key."""
        if len(items) != n:
            raise InvalidArgumentError(f"{len(items)} {what} for {n} keys; send exactly one per key")

    def values(self, values: Sequence[bytes], n: int, what: str = "values") -> None:
        """One value per key, each within the value size limit."""
        self.same_length(what, values, n)
        limit = self.limits.max_value_bytes
        if n and max(map(len, values)) > limit:
            i = next(i for i, v in enumerate(values) if len(v) > limit)
            raise SizeLimitError(
                f"{what[:-1]} #{i} has {len(values[i])} bytes, more than state.limits.max-value-bytes ({limit}); "
                "split it (a list state stores elements separately) or raise the limit"
            )

    def user_keys(self, user_keys: Sequence[bytes], n: int) -> None:
        """One map user key per key, each within the key size limit."""
        self.same_length("user keys", user_keys, n)
        limit = self.limits.max_key_bytes
        if n and max(map(len, user_keys)) > limit:
            i = next(i for i, k in enumerate(user_keys) if len(k) > limit)
            raise SizeLimitError(
                f"user key #{i} has {len(user_keys[i])} bytes, more than state.limits.max-key-bytes ({limit})"
            )

    def single(self, key: bytes, namespace: bytes) -> int:
        """Check one (key, namespace); returns its key group."""
        kgs, _ = self.keys([key])
        self.namespaces(namespace, 1)
        return kgs[0]

    def list_length(self, current: int, adding: int, key: bytes) -> None:
        """A list of ``current`` elements may take ``adding`` more."""
        limit = self.limits.max_list_elements
        if current + adding > limit:
            raise SizeLimitError(
                f"the list of key {key[:32]!r} would grow to {current + adding} elements, more than "
                f"state.limits.list.max-elements ({limit}); clear or trim it, or raise the limit"
            )

    def list_too_large(self, state: str, total: int) -> SizeLimitError:
        """The error of a ListGet whose answer would pass the response size limit."""
        return SizeLimitError(
            f"ListGet of state {state!r} would return more than {total} bytes, past "
            f"state.limits.list.max-response-bytes ({self.limits.max_list_response_bytes}); "
            "read such a list with ListState.scan(key), which streams a list of any size (the ListScan call), or raise the limit"
        )
