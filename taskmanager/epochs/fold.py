"""Turning one attempt's staged records into the logical mutations a commit applies.

The staged records are already folded per entry (see :mod:`.records`), so each staged value,
list or map becomes one mutation, except where the staged writes started with a clear: then a
``CLEAR`` precedes the entry's puts, and both apply in order in the same atomic batch.
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator, Sequence

from keyedstate.common.descriptors import StateKind
from keyedstate.taskmanager.epochs import records as r
from keyedstate.taskmanager.state import layout
from keyedstate.taskmanager.state.mutation import Mutation, MutationKind

logger = logging.getLogger(__name__)

_HEAD = r.HEAD[0]
_ENTRY = r.ENTRY[0]


def fold_attempt(
    staged: Iterable[tuple[bytes, bytes]], states: Sequence[tuple[str, StateKind]]
) -> Iterator[Mutation]:
    """Mutations of the staged ``(key, value)`` pairs of one attempt, in staged-key order.

    ``states[i]`` is the (name, kind) of state id ``i``.
    """
    group: _Group | None = None
    for key, value in staged:
        rest = key[r.ATTEMPT_PREFIX_LEN:]
        sid = int.from_bytes(rest[: r.STATE_ID_BYTES], "big")
        if sid >= len(states):
            raise r.corrupt(f"state id {sid} of a slot with {len(states)} states")
        stored = rest[r.STATE_ID_BYTES:]
        plen = layout.prefix_length(stored)
        prefix, suffix = stored[:plen], stored[plen:]
        if group is not None and (group.sid != sid or group.prefix != prefix):
            yield from group.mutations()
            group = None
        name, kind = states[sid]
        if kind is StateKind.VALUE or kind is StateKind.REDUCING:
            yield from _single(name, kind, prefix, value)
            continue
        if group is None:
            group = _Group(sid, name, kind, prefix)
        group.add(suffix, value)
    if group is not None:
        yield from group.mutations()


def _decoded(prefix: bytes) -> tuple[bytes, bytes]:
    k = layout.decode_key(prefix)
    return k.key, k.namespace


def _single(name: str, kind: StateKind, prefix: bytes, value: bytes) -> Iterator[Mutation]:
    key, ns = _decoded(prefix)
    tag = value[0] if value else -1
    if tag == r.CLEAR_TAG:
        yield Mutation(MutationKind.CLEAR, name, key, ns)
    elif kind is StateKind.VALUE and tag == r.PUT_TAG:
        yield Mutation(MutationKind.VALUE_PUT, name, key, ns, value=value[1:])
    elif kind is StateKind.REDUCING and tag == r.DELTA_TAG:
        yield Mutation(MutationKind.REDUCE, name, key, ns, value=value[1:])
    elif kind is StateKind.REDUCING and tag == r.REPLACE_TAG:
        # Reducing into a cleared entry starts from the operand, so clear-then-reduce replaces.
        yield Mutation(MutationKind.CLEAR, name, key, ns)
        yield Mutation(MutationKind.REDUCE, name, key, ns, value=value[1:])
    else:
        raise r.corrupt(f"{kind.value} record tagged {value[:1]!r}")


class _Group:
    """The staged records of one list or map entry (header first, then its entries)."""

    __slots__ = ("sid", "name", "kind", "prefix", "head", "elements", "puts")

    def __init__(self, sid: int, name: str, kind: StateKind, prefix: bytes) -> None:
        self.sid = sid
        self.name = name
        self.kind = kind
        self.prefix = prefix
        self.head: bytes | None = None
        self.elements: list[bytes] = []
        self.puts: list[tuple[bytes, bytes | None]] = []

    def add(self, suffix: bytes, value: bytes) -> None:
        if suffix == r.HEAD:
            self.head = value
        elif suffix and suffix[0] == _ENTRY:
            if self.kind is StateKind.LIST:
                self.elements.append(value)
            elif value[:1] == r.PUT:
                self.puts.append((suffix[1:], value[1:]))
            elif value == r.REMOVED:
                self.puts.append((suffix[1:], None))
            else:
                raise r.corrupt(f"map entry tagged {value[:1]!r}")
        else:
            raise r.corrupt(f"{self.kind.value} record with suffix {suffix[:9]!r}")

    def mutations(self) -> Iterator[Mutation]:
        key, ns = _decoded(self.prefix)
        name = self.name
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
