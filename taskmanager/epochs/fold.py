"""Turning one attempt's staged records into the logical mutations a commit applies.

The staged records are already folded per entry (see :mod:`.records`), so each staged value,
list or map becomes one mutation, except where the staged writes started with a clear: then a
``CLEAR`` precedes the entry's puts, and both apply in order in the same atomic batch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence

from keyedstate.common.descriptors import StateKind
from keyedstate.taskmanager.epochs import records as r
from keyedstate.taskmanager.state import layout
from keyedstate.taskmanager.state.mutation import Mutation, MutationKind

logger = logging.getLogger(__name__)

_ENTRY = r.ENTRY[0]


def fold_attempt(staged: Iterable[tuple[bytes, bytes]], states: Sequence[tuple[str, StateKind]]) -> Iterator[Mutation]:
    """Mutations of the staged ``(key, value)`` pairs of one attempt, in staged-key order.

    ``states[i]`` is the (name, kind) of state id ``i``.
    """
    group: _Group | None = None
    skip = r.ATTEMPT_PREFIX_LEN + r.STATE_ID_BYTES
    n_states = len(states)
    single_kinds = (StateKind.VALUE, StateKind.REDUCING)
    for staged_key, value in staged:
        sid = int.from_bytes(staged_key[r.ATTEMPT_PREFIX_LEN : skip], "big")
        if sid >= n_states:
            raise r.corrupt(f"state id {sid} of a slot with {n_states} states")
        key, ns, suffix = _split(staged_key, skip)
        name, kind = states[sid]
        if kind in single_kinds:
            if group is not None:
                yield from group.mutations()
                group = None
            yield from _single(name, kind, key, ns, value)
            continue
        if group is not None and (group.sid != sid or group.key != key or group.namespace != ns):
            yield from group.mutations()
            group = None
        if group is None:
            group = _Group(sid, name, kind, key, ns)
        group.add(suffix, value)
    if group is not None:
        yield from group.mutations()


def _split(staged_key: bytes, start: int) -> tuple[bytes, bytes, bytes]:
    """(key, namespace, suffix) of the layout key at ``start`` (after the key-group bytes)."""
    pos = start + layout.KEY_GROUP_BYTES
    if len(staged_key) > pos and staged_key[pos] < 0x80:
        # One-byte length varints (keys and namespaces under 128 bytes): the common case, inline.
        key_end = pos + 1 + staged_key[pos]
        if len(staged_key) > key_end and staged_key[key_end] < 0x80:
            ns_end = key_end + 1 + staged_key[key_end]
            if ns_end <= len(staged_key):
                return staged_key[pos + 1 : key_end], staged_key[key_end + 1 : ns_end], staged_key[ns_end:]
    decoded = layout.decode_key(staged_key[start:])
    return decoded.key, decoded.namespace, decoded.suffix


def _single(name: str, kind: StateKind, key: bytes, ns: bytes, value: bytes) -> tuple[Mutation, ...]:
    tag = value[0] if value else -1
    if tag == r.CLEAR_TAG:
        return (Mutation(MutationKind.CLEAR, name, key, ns),)
    if kind is StateKind.VALUE and tag == r.PUT_TAG:
        return (Mutation(MutationKind.VALUE_PUT, name, key, ns, value=value[1:]),)
    if kind is StateKind.REDUCING and tag == r.DELTA_TAG:
        return (Mutation(MutationKind.REDUCE, name, key, ns, value=value[1:]),)
    if kind is StateKind.REDUCING and tag == r.REPLACE_TAG:
        # Reducing into a cleared entry starts from the operand, so clear-then-reduce replaces.
        return (
            Mutation(MutationKind.CLEAR, name, key, ns),
            Mutation(MutationKind.REDUCE, name, key, ns, value=value[1:]),
        )
    raise r.corrupt(f"{kind.value} record tagged {value[:1]!r}")


class _Group:
    """The staged records of one list or map entry (header first, then its entries)."""

    __slots__ = ("elements", "head", "key", "kind", "name", "namespace", "puts", "sid")

    def __init__(self, sid: int, name: str, kind: StateKind, key: bytes, namespace: bytes) -> None:
        self.sid = sid
        self.name = name
        self.kind = kind
        self.key = key
        self.namespace = namespace
        self.head: bytes | None = None
        self.elements: list[bytes] = []
        self.puts: list[tuple[bytes, bytes | None]] = []

    def add(self, suffix: bytes, value: bytes) -> None:
        if suffix == r.HEAD:
            self.head = value
        elif suffix and suffix[0] == _ENTRY:
            if self.kind is StateKind.LIST:
                self.elements += r.unpack_elements(value)
            elif value[:1] == r.PUT:
                self.puts.append((suffix[1:], value[1:]))
            elif value == r.REMOVED:
                self.puts.append((suffix[1:], None))
            else:
                raise r.corrupt(f"map entry tagged {value[:1]!r}")
        else:
            raise r.corrupt(f"{self.kind.value} record with suffix {suffix[:9]!r}")

    def mutations(self) -> Iterator[Mutation]:
        key, ns, name = self.key, self.namespace, self.name
        if self.kind is StateKind.LIST:
            if self.head is None:
                raise r.corrupt("list elements without a header")
            tag, _count = r.parse_list_header(self.head)
            values = tuple(self.elements)
            if tag == r.APPEND_TAG:
                if values:
                    yield Mutation(MutationKind.LIST_APPEND, name, key, ns, values=values)
            else:
                yield Mutation(MutationKind.LIST_REPLACE, name, key, ns, values=values)
            return
        cleared = False
        if self.head is not None:
            if self.head != r.CLEAR:
                raise r.corrupt(f"map marker {self.head[:8]!r}")
            cleared = True
            yield Mutation(MutationKind.CLEAR, name, key, ns)
        for user_key, value in self.puts:
            if value is not None:
                yield Mutation(MutationKind.MAP_PUT, name, key, ns, user_key=user_key, value=value)
            elif not cleared:
                yield Mutation(MutationKind.MAP_REMOVE, name, key, ns, user_key=user_key)
