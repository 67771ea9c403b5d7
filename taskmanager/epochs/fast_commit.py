"""The commit fast path: the winners' staged records applied as they are staged, for every state kind.

Every staged record was validated when it was staged (state, kind, key sizes, key-group
ownership, value sizes, reduce operands, staged list lengths: the slot's one
``RequestValidator``), and it already holds the main database's stored-key prefix (after the
attempt prefix and the state id, see :mod:`.records`). So a commit needs no Mutation objects, no
re-validation and no key re-encoding: one parse of the staged records (:func:`parse`), then

* RocksDB: one multi-get per reducing state for the current values, the records written
  straight into one WriteBatch of stored keys, with the committed-epoch marker
  (:func:`commit_fast` through ``RocksDBKeyedStateBackend.stored_write``);
* HashMap: the backend's operations built directly from the records and applied in one call
  (``KeyedStateBackend.apply_validated``).

The one data-dependent check, the length of a list (committed plus appended elements against
``state.limits.list.max-elements``), is made here as the general path makes it, with the same
error. The result is what ``KeyedStateBackend.apply`` of the folded mutations (:mod:`.fold`, the
general path and the reference of the differential test) writes: same order per key, same
``now`` for TTL stamps, same counts. A record the parse does not expect (corrupt staging) makes
:func:`commit_fast` return None with nothing written, and the caller takes the general path,
which raises the error it deserves.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from marshal import loads

from keyedstate.common.descriptors import StateKind
from keyedstate.taskmanager.epochs import records as r
from keyedstate.taskmanager.state import KeyedStateBackend, layout
from keyedstate.taskmanager.state.backend import (
    OP_CLEAR,
    OP_LIST_APPEND,
    OP_LIST_REPLACE,
    OP_MAP_PUT,
    OP_MAP_REMOVE,
    OP_REDUCE,
    OP_VALUE_PUT,
    Op,
)
from keyedstate.taskmanager.state.rocksdb import RocksDBKeyedStateBackend, StoredWrite
from keyedstate.taskmanager.state.validation import StateHandle

logger = logging.getLogger(__name__)

_SKIP = r.ATTEMPT_PREFIX_LEN + r.STATE_ID_BYTES
_ENTRY = r.ENTRY[0]
_HEAD = r.HEAD[0]
_VALUE, _REDUCING, _GROUPED = 0, 1, 2
_KIND_CODES = {
    StateKind.VALUE: _VALUE,
    StateKind.REDUCING: _REDUCING,
    StateKind.LIST: _GROUPED,
    StateKind.MAP: _GROUPED,
}


class _Unexpected(Exception):
    """A staged record the fast path does not expect; the general path reports it."""


class _Group:
    """The staged records of one list or map entry of one attempt: its header, then its entries."""

    __slots__ = ("elements", "head", "prefix", "st", "values")

    def __init__(self, st: StateHandle, prefix: bytes) -> None:
        self.st = st
        self.prefix = prefix
        """The stored-key prefix of (key group, key, namespace)."""
        self.head = -1
        """List: APPEND_TAG or REPLACE_TAG; map: CLEAR_TAG when the committed map was cleared; -1: no header."""
        self.elements: list[bytes] = []
        """List: the staged elements in order; map: the staged user keys, in order."""
        self.values: list[bytes | None] = []
        """Map: the staged value of each user key (None: removed)."""


@dataclass
class Parsed:
    """The winners' staged records, parsed once, per state (states are independent of each other).

    Per state the records keep their application order (partitions ascending, then staging
    order), which is all the general path's order decides: two records of one key meet in it.
    """

    singles: list[tuple[StateHandle, list[bytes], list[bytes]]]
    """Per value or reducing state with records: (state, stored keys, tagged staged values)."""
    groups: list[_Group]
    """The lists and maps, in application order."""
    applied: int
    """How many mutations the general path would count for these records."""


def _prefix_length(staged_key: bytes) -> int:
    """Length of the stored-key prefix starting at ``_SKIP``; raises _Unexpected when malformed."""
    pos = _SKIP + layout.KEY_GROUP_BYTES
    n = len(staged_key)
    if n > pos and staged_key[pos] < 0x80:  # one-byte length varints: the common case, inline
        key_end = pos + 1 + staged_key[pos]
        if n > key_end and staged_key[key_end] < 0x80:
            ns_end = key_end + 1 + staged_key[key_end]
            if ns_end <= n:
                return ns_end - _SKIP
            raise _Unexpected
    try:
        length = layout.prefix_length(staged_key[_SKIP:])
    except Exception as exc:
        raise _Unexpected from exc
    if _SKIP + length > n:
        raise _Unexpected
    return length


def parse(
    handles: Sequence[StateHandle], staged: Sequence[Sequence[tuple[bytes, bytes]]], reducer_sizes: dict[str, int]
) -> Parsed | None:
    """Parse the staged records of the winners (one list per winner, partitions ascending); None if unexpected.

    ``handles[i]`` is the state of state id ``i``; ``reducer_sizes`` the length of a staged
    DELTA/REPLACE value of each reducing state, by name.
    """
    try:
        return _parse(handles, staged, reducer_sizes)
    except (_Unexpected, EOFError, ValueError, TypeError):  # the last three: packed list elements unreadable
        return None


def _parse(
    handles: Sequence[StateHandle], staged: Sequence[Sequence[tuple[bytes, bytes]]], reducer_sizes: dict[str, int]
) -> Parsed:
    singles: list[tuple[StateHandle, list[bytes], list[bytes]]] = [(st, [], []) for st in handles]  # per state id
    groups: list[_Group] = []
    applied = 0
    # state id (as staged) -> (state, its kind's code, staged DELTA/REPLACE size, its keys, its values)
    by_sid = {
        i.to_bytes(r.STATE_ID_BYTES, "big"): (st, _KIND_CODES[st.kind], reducer_sizes.get(st.name, 0), keys, values)
        for i, (st, keys, values) in enumerate(singles)
    }
    for attempt_records in staged:
        group: _Group | None = None
        entries = b""  # staged-key prefix of the entries of ``group``
        elements: list[bytes] | None = None  # the elements of ``group`` when it is a list with its header
        for staged_key, value in attempt_records:
            if group is not None and staged_key.startswith(entries):
                if elements is not None:  # a list's packed elements (the bulk of a list-heavy epoch): inline
                    packed = loads(value)
                    if packed.__class__ is not list:
                        raise _Unexpected
                    elements += packed
                else:
                    _add_entry(group, staged_key[len(entries) :], value)
                continue
            entry = by_sid.get(staged_key[r.ATTEMPT_PREFIX_LEN : _SKIP])
            if entry is None or not value:
                raise _Unexpected
            st, code, size, keys, values = entry
            if code != _GROUPED:
                group = elements = None
                tag = value[0]
                if tag == r.CLEAR_TAG:
                    applied += 1
                elif code == _VALUE:
                    if tag != r.PUT_TAG:
                        raise _Unexpected
                    applied += 1
                elif len(value) != size:
                    raise _Unexpected
                elif tag == r.DELTA_TAG:
                    applied += 1
                elif tag == r.REPLACE_TAG:
                    applied += 2  # the general path folds it into a CLEAR and a REDUCE
                else:
                    raise _Unexpected
                keys.append(staged_key[_SKIP:])
                values.append(value)
                continue
            end = _SKIP + _prefix_length(staged_key)
            group = _Group(st, staged_key[_SKIP:end])
            entries = staged_key[:end] + r.ENTRY
            suffix = staged_key[end:]
            elements = None
            if suffix == r.HEAD:
                _set_head(group, value)
                if st.kind is StateKind.LIST:
                    elements = group.elements
            elif suffix[:1] == r.ENTRY:
                _add_entry(group, suffix[1:], value)
            else:
                raise _Unexpected
            groups.append(group)
    applied += sum(_group_count(g) for g in groups)
    return Parsed([single for single in singles if single[1]], groups, applied)


def _set_head(group: _Group, value: bytes) -> None:
    if group.st.kind is StateKind.LIST:
        if len(value) != 1 + r.SEQ_BYTES or value[0] not in (r.APPEND_TAG, r.REPLACE_TAG):
            raise _Unexpected
        group.head = value[0]
    elif value == r.CLEAR:
        group.head = r.CLEAR_TAG
    else:
        raise _Unexpected


def _add_entry(group: _Group, rest: bytes, value: bytes) -> None:
    """``rest``: the staged key after ``prefix + ENTRY`` (a list sequence number or a map user key)."""
    if group.st.kind is StateKind.LIST:
        raise _Unexpected  # elements without a header
    group.elements.append(rest)
    if value[:1] == r.PUT:
        group.values.append(value[1:])
    elif value == r.REMOVED:
        group.values.append(None)
    else:
        raise _Unexpected


def _group_count(group: _Group) -> int:
    if group.st.kind is StateKind.LIST:
        return 1 if group.head == r.REPLACE_TAG or group.elements else 0
    if group.head == r.CLEAR_TAG:
        return 1 + sum(1 for v in group.values if v is not None)
    return len(group.values)


def commit_fast(
    backend: KeyedStateBackend,
    states: Sequence[tuple[str, StateKind]],
    staged: Sequence[Sequence[tuple[bytes, bytes]]],
    meta: dict[bytes, bytes],
) -> int | None:
    """Apply the winners' staged records (one list per winner, partitions ascending) with ``meta``, atomically.

    Returns how many mutations the general path would have counted, or None (nothing written)
    when a record is not what staging writes.
    """
    handles = [backend.validation.lookup(name) for name, _ in states]
    sizes = {st.name: st.reducer.size + 1 for st in handles if st.reducer is not None}
    parsed = parse(handles, staged, sizes)
    if parsed is None:
        return None
    if isinstance(backend, RocksDBKeyedStateBackend):
        with backend.stored_write(meta) as write:
            _write_rocksdb(backend, write, parsed)
    else:
        backend.apply_validated(_ops(parsed), meta)
    logger.debug("fast commit of %d mutations on %s", parsed.applied, backend.subtask)
    return parsed.applied


def _write_rocksdb(backend: RocksDBKeyedStateBackend, write: StoredWrite, parsed: Parsed) -> None:
    """Every parsed record into ``write.batch``, stored keys as staged, in application order per state."""
    now, batch = write.now_ms, write.batch
    for st, keys, values in parsed.singles:
        header, handle, put, delete = st.codec.header(now), st.handle, batch.put, batch.delete
        reducer = st.reducer
        if reducer is None:  # value state: PUT or CLEAR, nothing to read
            for key, value in zip(keys, values):
                if value[0] == r.PUT_TAG:
                    put(key, header + value[1:], handle)
                else:
                    delete(key, handle)
            continue
        decode, combine = st.codec.decode, reducer.combine
        # The payload each key holds so far in this batch (None: cleared); a later record continues from it.
        latest: dict[bytes, bytes | None] = {}
        for key, value, current in zip(keys, values, backend.stored_get(st, keys)):
            tag = value[0]
            if tag == r.CLEAR_TAG:
                latest[key] = None
                delete(key, handle)
                continue
            if tag == r.DELTA_TAG:
                new = combine(latest[key] if key in latest else decode(current, now), value[1:])
            else:  # REPLACE: cleared, then reduced to the operand
                new = value[1:]
            latest[key] = new
            put(key, header + new, handle)
    headers: dict[str, bytes] = {}
    for group in parsed.groups:
        st = group.st
        group_header = headers.get(st.name)
        if group_header is None:
            group_header = headers[st.name] = st.codec.header(now)
        if st.kind is StateKind.LIST:
            _write_list(backend, write, group, group_header)
        else:
            _write_map(write, group, group_header)


def _write_list(backend: RocksDBKeyedStateBackend, write: StoredWrite, group: _Group, header: bytes) -> None:
    st, prefix, elements = group.st, group.prefix, group.elements
    limit = backend.limits.max_list_elements
    if group.head == r.REPLACE_TAG:
        if len(elements) > limit:
            backend.validation.list_length(0, len(elements), layout.decode_key(prefix).key)
        write.batch.delete_range(prefix, layout.key_prefix_end(prefix), st.handle)
        first = nxt = 0
    elif not elements:
        return
    else:
        first, nxt = write.list_bounds(st, prefix)
        if nxt - first + len(elements) > limit:
            backend.validation.list_length(nxt - first, len(elements), layout.decode_key(prefix).key)
    put, handle = write.batch.put, st.handle
    for element in elements:
        put(prefix + nxt.to_bytes(layout.SEQ_BYTES, "big"), header + element, handle)
        nxt += 1
    write.set_list_bounds(st, prefix, (first, nxt))


def _write_map(write: StoredWrite, group: _Group, header: bytes) -> None:
    st, prefix, batch = group.st, group.prefix, write.batch
    cleared = group.head == r.CLEAR_TAG
    if cleared:
        batch.delete_range(prefix, layout.key_prefix_end(prefix), st.handle)
    for user_key, value in zip(group.elements, group.values):
        if value is not None:
            batch.put(prefix + user_key, header + value, st.handle)
        elif not cleared:
            batch.delete(prefix + user_key, st.handle)


def _ops(parsed: Parsed) -> list[Op]:
    """The backend operations of the parsed records (the HashMap backend applies them in one call)."""
    ops: list[Op] = []
    append = ops.append
    for st, keys, values in parsed.singles:
        for stored_key, value in zip(keys, values):
            d = layout.decode_key(stored_key)
            kg, key, ns = d.key_group, d.key, d.namespace
            tag = value[0]
            if tag == r.CLEAR_TAG:
                append((OP_CLEAR, st, kg, key, ns, b"", b"", ()))
            elif tag == r.PUT_TAG:
                append((OP_VALUE_PUT, st, kg, key, ns, b"", value[1:], ()))
            else:
                if tag == r.REPLACE_TAG:  # reducing into a cleared entry starts from the operand
                    append((OP_CLEAR, st, kg, key, ns, b"", b"", ()))
                append((OP_REDUCE, st, kg, key, ns, b"", value[1:], ()))
    for group in parsed.groups:
        _group_ops(group, ops)
    return ops


def _group_ops(group: _Group, ops: list[Op]) -> None:
    st = group.st
    d = layout.decode_key(group.prefix)
    kg, key, ns = d.key_group, d.key, d.namespace
    if st.kind is StateKind.LIST:
        if group.head == r.REPLACE_TAG:
            ops.append((OP_LIST_REPLACE, st, kg, key, ns, b"", b"", tuple(group.elements)))
        elif group.elements:
            ops.append((OP_LIST_APPEND, st, kg, key, ns, b"", b"", tuple(group.elements)))
        return
    cleared = group.head == r.CLEAR_TAG
    if cleared:
        ops.append((OP_CLEAR, st, kg, key, ns, b"", b"", ()))
    for user_key, value in zip(group.elements, group.values):
        if value is not None:
            ops.append((OP_MAP_PUT, st, kg, key, ns, user_key, value, ()))
        elif not cleared:
            ops.append((OP_MAP_REMOVE, st, kg, key, ns, user_key, b"", ()))
