"""One task attempt's transaction on a slot: its writes are staged, its reads merge them with committed state.

The transaction implements :class:`~keyedstate.taskmanager.state.access.KeyedStateAccess`, like
the backend, so the KeyedState servicer serves an epoch-scoped call exactly like a direct one.
Batches are validated by the slot's one ``RequestValidator`` (state kind, sizes, key-group
ownership) before anything is staged, and each batch is staged with one atomic ``WriteBatch``: a refused batch stages
nothing, and a client may retry it.

Reads see the state committed through the slot's last committed epoch plus this attempt's own
staged writes, never another attempt's. ``scan_keys`` is the exception: it lists committed keys
only (keys first created by this attempt appear after the commit). Streaming scans are merged
chunk by chunk, without one snapshot across chunks, like direct scans. Staged values carry no
TTL timestamp: a commit writes them with the commit time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import cast

import rocksdict

from keyedstate.common.descriptors import StateKind
from keyedstate.taskmanager.epochs import records as r
from keyedstate.taskmanager.epochs.attempt import TaskAttempt
from keyedstate.taskmanager.epochs.slot import SlotEpochs, Stager
from keyedstate.taskmanager.epochs.staging import SCAN_CHUNK
from keyedstate.taskmanager.state import layout
from keyedstate.taskmanager.state.validation import ANY_KIND, LIST, MAP, READABLE_VALUE, REDUCING, VALUE, StateHandle

logger = logging.getLogger(__name__)

_ENTRY_END = b"\x02"  # prefix + _ENTRY_END bounds the entries (prefix + ENTRY + ...) of one list or map


def _entries_range(staged_prefix: bytes) -> tuple[bytes, bytes]:
    return staged_prefix + r.ENTRY, staged_prefix + _ENTRY_END


def _subset(keys: list[bytes], ns: bytes | list[bytes], indices: list[int]) -> tuple[list[bytes], bytes | list[bytes]]:
    sub_ns = ns if isinstance(ns, bytes) else [ns[i] for i in indices]
    return [keys[i] for i in indices], sub_ns


class EpochTransaction:
    """The state calls of one task attempt (``TaskAttempt``) on one slot (a ``KeyedStateAccess``).

    The backend's validator is used on purpose: an epoch-scoped batch must be refused for
    exactly the reasons a direct one would be, so a commit never meets a mutation the backend
    rejects for its shape. Committed state is read through the backend's public calls.
    """

    def __init__(self, slot_epochs: SlotEpochs, attempt: TaskAttempt, sequence: int = 0) -> None:
        self._se = slot_epochs
        self._b = slot_epochs.backend
        self._v = slot_epochs.backend.validation
        self.attempt = attempt
        self.sequence = sequence
        """The write request's sequence number (0: unnumbered, as reads are): staged once per attempt."""

    def __repr__(self) -> str:
        return f"EpochTransaction({self._se.subtask}, {self.attempt})"

    def _staged_keys(
        self, st: StateHandle, kgs: list[int], keys: list[bytes], ns: bytes | list[bytes], max_len: int
    ) -> list[bytes]:
        base = r.state_prefix(self.attempt.prefix, self._se.state_ids[st.name])
        return [base + p for p in layout.build_prefixes(kgs, keys, ns, max_len)]

    def _staged_key(self, st: StateHandle, kg: int, key: bytes, namespace: bytes) -> bytes:
        return r.state_prefix(self.attempt.prefix, self._se.state_ids[st.name]) + layout.key_prefix(kg, key, namespace)

    def _scan_staged(self, begin: bytes, end: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Staged entries of ``[begin, end)``, a chunk at a time, each chunk read with commits kept out."""
        start = begin
        while True:
            with self._se.reading() as store:
                chunk = store.read_chunk(start, end) if store is not None else []
            yield from chunk
            if len(chunk) < SCAN_CHUNK:
                return
            start = chunk[-1][0] + b"\x00"

    # -- value and reducing -----------------------------------------------------------------
    def value_get(self, state: str, keys: list[bytes], namespaces: bytes | list[bytes]) -> list[bytes | None]:
        """Staged values of this attempt where it wrote them, committed ones elsewhere (reduce deltas folded in)."""
        b = self._b
        st, kgs, max_len, ns = self._v.batch(state, READABLE_VALUE, "ValueGet", keys, namespaces)
        if not keys:
            return []
        with self._se.reading() as store:
            if store is None:
                return b.value_get(state, keys, ns)
            staged = store.get(self._staged_keys(st, kgs, keys, ns, max_len))
            out: list[bytes | None] = [None] * len(keys)
            need: list[int] = []
            # value state stages PUT or CLEAR; reducing state DELTA, REPLACE or CLEAR (see records).
            set_tag = r.PUT_TAG if st.kind is StateKind.VALUE else r.REPLACE_TAG
            delta_tag = r.DELTA_TAG if st.kind is StateKind.REDUCING else -1
            for i, s in enumerate(staged):
                if s is None or s[0] == delta_tag:
                    need.append(i)
                elif s[0] == set_tag:
                    out[i] = s[1:]
                elif s[0] != r.CLEAR_TAG:
                    raise r.corrupt(f"{st.kind.value} record tagged {s[:1]!r}")
            if not need:
                return out
            committed = b.value_get(state, *_subset(keys, ns, need))
        reducer = st.reducer
        for i, c in zip(need, committed):
            s = staged[i]
            if s is None:
                out[i] = c
            else:
                assert reducer is not None
                out[i] = reducer.combine(c, s[1:])
        return out

    def value_put(self, state: str, keys: list[bytes], values: list[bytes], namespaces: bytes | list[bytes]) -> None:
        """Stage one value per key."""
        st, kgs, max_len, ns = self._v.batch(state, VALUE, "ValuePut", keys, namespaces, values=values)
        if not keys:
            return
        wb = rocksdict.WriteBatch(raw_mode=True)
        put = wb.put
        tag = r.PUT
        for k, v in zip(self._staged_keys(st, kgs, keys, ns, max_len), values):
            put(k, tag + v)
        with self._se.writing(self.attempt, self.sequence) as stager:
            if stager is not None:
                stager.write(wb)

    def clear(self, state: str, keys: list[bytes], namespaces: bytes | list[bytes]) -> None:
        """Stage the removal of every entry of each (key, namespace): a value, a whole list or map."""
        st, kgs, max_len, ns = self._v.batch(state, ANY_KIND, "Clear", keys, namespaces)
        if not keys:
            return
        wb = rocksdict.WriteBatch(raw_mode=True)
        for sk in self._staged_keys(st, kgs, keys, ns, max_len):
            if st.kind is StateKind.VALUE or st.kind is StateKind.REDUCING:
                wb.put(sk, r.CLEAR)
                continue
            # Entries staged before the clear are gone; the head records that committed ones go too.
            wb.delete_range(sk, layout.key_prefix_end(sk))
            wb.put(sk + r.HEAD, r.list_header(r.REPLACE, 0) if st.kind is StateKind.LIST else r.CLEAR)
        with self._se.writing(self.attempt, self.sequence) as stager:
            if stager is not None:
                stager.write(wb)

    def reduce(
        self, state: str, keys: list[bytes], operands: list[bytes], namespaces: bytes | list[bytes], return_values: bool
    ) -> list[bytes] | None:
        """Stage reduce operands (folded per key); optionally return each key's value after its operand."""
        st, kgs, max_len, ns = self._v.batch(state, REDUCING, "Reduce", keys, namespaces, operands=operands)
        if not keys:
            return [] if return_values else None
        sks = self._staged_keys(st, kgs, keys, ns, max_len)
        with self._se.writing(self.attempt, self.sequence) as stager:
            if stager is None:
                duplicate = True
            else:
                duplicate = False
                results = self._stage_reduce(stager, state, st, keys, ns, sks, operands, return_values)
        if duplicate:
            # Staged before (a retry whose answer was lost): answer with the values as they are now.
            # A reduced key always has a value, so no None comes back here.
            return cast("list[bytes]", self.value_get(state, keys, ns)) if return_values else None
        return results

    def _stage_reduce(
        self,
        stager: Stager,
        state: str,
        st: StateHandle,
        keys: list[bytes],
        ns: bytes | list[bytes],
        sks: list[bytes],
        operands: list[bytes],
        return_values: bool,
    ) -> list[bytes] | None:
        b = self._b
        reducer = st.reducer
        assert reducer is not None
        combine = reducer.combine
        store = stager.store
        distinct = list(dict.fromkeys(sks))
        current = dict(zip(distinct, store.get(distinct)))
        after: list[bytes] = []
        for sk, operand in zip(sks, operands):
            cur = current[sk]
            if cur is None:
                new = r.DELTA + operand
            elif cur[0] == r.DELTA_TAG or cur[0] == r.REPLACE_TAG:
                new = cur[:1] + combine(cur[1:], operand)
            elif cur[0] == r.CLEAR_TAG:
                new = r.REPLACE + operand
            else:
                raise r.corrupt(f"reducing record tagged {cur[:1]!r}")
            current[sk] = new
            if return_values:
                after.append(new)
        results: list[bytes] | None = None
        if return_values:
            # Read before staging: a failed read must leave the batch unstaged (so it can be retried).
            need = [i for i, a in enumerate(after) if a[0] == r.DELTA_TAG]
            committed = b.value_get(state, *_subset(keys, ns, need)) if need else []
            results = [a[1:] for a in after]
            for i, c in zip(need, committed):
                if c is not None:
                    results[i] = combine(c, results[i])
        wb = rocksdict.WriteBatch(raw_mode=True)
        for sk in distinct:
            wb.put(sk, current[sk])
        stager.write(wb)
        return results

    # -- list -------------------------------------------------------------------------------
    def list_append(self, state: str, keys: list[bytes], values: list[bytes], namespaces: bytes | list[bytes]) -> None:
        """Stage one appended element per key (keys may repeat; order is kept)."""
        v = self._v
        st, kgs, max_len, ns = v.batch(state, LIST, "ListAppend", keys, namespaces, values=values)
        if not keys:
            return
        sks = self._staged_keys(st, kgs, keys, ns, max_len)
        with self._se.writing(self.attempt, self.sequence) as stager:
            if stager is None:
                return  # staged before (a retry whose answer was lost)
            store = stager.store
            # One staged record per list and request: the request's elements of that list, in order.
            grouped: dict[bytes, list[bytes]] = {}
            for sk, value in zip(sks, values):
                elements = grouped.get(sk)
                if elements is None:
                    grouped[sk] = [value]
                else:
                    elements.append(value)
            heads = {
                sk: r.parse_list_header(h) if h is not None else (r.APPEND_TAG, 0)
                for sk, h in zip(grouped, store.get([sk + r.HEAD for sk in grouped]))
            }
            limit = v.limits.max_list_elements
            wb = rocksdict.WriteBatch(raw_mode=True)
            for sk, elements in grouped.items():
                tag, count = heads[sk]
                # Only the staged elements are checked here; committed + staged is checked by the commit.
                if count + len(elements) > limit:
                    self._refuse_append(sks, keys, heads)
                wb.put(r.element_key(sk + r.ENTRY, count), r.pack_elements(elements))
                wb.put(sk + r.HEAD, r.list_header(bytes((tag,)), count + len(elements)))
            stager.write(wb)

    def _refuse_append(self, sks: list[bytes], keys: list[bytes], heads: dict[bytes, tuple[int, int]]) -> None:
        """Raise the error of the first appended element, in request order, that passes the list limit."""
        counts = {sk: count for sk, (_tag, count) in heads.items()}
        for sk, key in zip(sks, keys):
            self._v.list_length(counts[sk], 1, key)
            counts[sk] += 1

    def list_update(self, state: str, keys: list[bytes], values: list[bytes], namespaces: bytes | list[bytes]) -> None:
        """Stage list replacements: each distinct (key, namespace) becomes the values given for it, in order."""
        v = self._v
        st, kgs, max_len, ns = v.batch(state, LIST, "ListUpdate", keys, namespaces, values=values)
        if not keys:
            return
        grouped: dict[bytes, tuple[bytes, list[bytes]]] = {}
        for sk, key, value in zip(self._staged_keys(st, kgs, keys, ns, max_len), keys, values):
            entry = grouped.get(sk)
            if entry is None:
                grouped[sk] = (key, [value])
            else:
                entry[1].append(value)
        wb = rocksdict.WriteBatch(raw_mode=True)
        for sk, (key, vs) in grouped.items():
            v.list_length(0, len(vs), key)
            wb.delete_range(sk, layout.key_prefix_end(sk))
            wb.put(sk + r.HEAD, r.list_header(r.REPLACE, len(vs)))
            wb.put(r.element_key(sk + r.ENTRY, 0), r.pack_elements(vs))
        with self._se.writing(self.attempt, self.sequence) as stager:
            if stager is not None:
                stager.write(wb)

    def list_get(self, state: str, keys: list[bytes], namespaces: bytes | list[bytes]) -> list[list[bytes]]:
        """Committed elements followed by this attempt's staged ones (only the staged ones after a staged replace)."""
        b = self._b
        st, kgs, max_len, ns = self._v.batch(state, LIST, "ListGet", keys, namespaces)
        if not keys:
            return []
        with self._se.reading() as store:
            if store is None:
                return b.list_get(state, keys, ns)
            sks = self._staged_keys(st, kgs, keys, ns, max_len)
            heads = store.get([sk + r.HEAD for sk in sks])
            need = [i for i, h in enumerate(heads) if h is None or r.parse_list_header(h)[0] == r.APPEND_TAG]
            out: list[list[bytes]] = [[] for _ in keys]
            if need:
                for i, lst in zip(need, b.list_get(state, *_subset(keys, ns, need))):
                    out[i] = lst
            limit = b.limits.max_list_response_bytes
            total = sum(len(e) for i in need for e in out[i])
            for i, h in enumerate(heads):
                if h is None:
                    continue
                for _k, packed in store.scan(*_entries_range(sks[i])):
                    for element in r.unpack_elements(packed):
                        total += len(element)
                        if total > limit:
                            raise self._v.list_too_large(state, limit)
                        out[i].append(element)
            return out

    def list_scan(self, state: str, key: bytes, namespace: bytes) -> Iterator[bytes]:
        """Stream one list (committed elements, then this attempt's staged ones), validated now."""
        st, kg = self._v.single_key(state, LIST, "ListScan", key, namespace)
        return self._list_scan(state, key, namespace, self._staged_key(st, kg, key, namespace))

    def _list_scan(self, state: str, key: bytes, namespace: bytes, sk: bytes) -> Iterator[bytes]:
        with self._se.reading() as store:
            head = store.get([sk + r.HEAD])[0] if store is not None else None
        if head is None or r.parse_list_header(head)[0] == r.APPEND_TAG:
            yield from self._b.list_scan(state, key, namespace)
        if head is not None:
            for _k, packed in self._scan_staged(*_entries_range(sk)):
                yield from r.unpack_elements(packed)

    # -- map --------------------------------------------------------------------------------
    def map_put(
        self,
        state: str,
        keys: list[bytes],
        user_keys: list[bytes],
        values: list[bytes],
        namespaces: bytes | list[bytes],
    ) -> None:
        self._stage_map(state, "MapPut", keys, user_keys, values, namespaces)

    def map_remove(
        self, state: str, keys: list[bytes], user_keys: list[bytes], namespaces: bytes | list[bytes]
    ) -> None:
        self._stage_map(state, "MapRemove", keys, user_keys, None, namespaces)

    def _stage_map(
        self,
        state: str,
        call: str,
        keys: list[bytes],
        user_keys: list[bytes],
        values: list[bytes] | None,
        namespaces: bytes | list[bytes],
    ) -> None:
        st, kgs, max_len, ns = self._v.batch(state, MAP, call, keys, namespaces, user_keys=user_keys, values=values)
        if not keys:
            return
        wb = rocksdict.WriteBatch(raw_mode=True)
        entry = r.ENTRY
        sks = self._staged_keys(st, kgs, keys, ns, max_len)
        if values is None:
            for sk, uk in zip(sks, user_keys):
                wb.put(sk + entry + uk, r.REMOVED)
        else:
            tag = r.PUT
            for sk, uk, v in zip(sks, user_keys, values):
                wb.put(sk + entry + uk, tag + v)
        with self._se.writing(self.attempt, self.sequence) as stager:
            if stager is not None:
                stager.write(wb)

    def map_get(
        self, state: str, keys: list[bytes], user_keys: list[bytes], namespaces: bytes | list[bytes]
    ) -> list[bytes | None]:
        """Staged entries of this attempt override committed ones; a staged clear hides the committed map."""
        return self._map_lookup(state, "MapGet", keys, user_keys, namespaces)

    def map_contains(
        self, state: str, keys: list[bytes], user_keys: list[bytes], namespaces: bytes | list[bytes]
    ) -> list[bool]:
        return [v is not None for v in self._map_lookup(state, "MapContains", keys, user_keys, namespaces)]

    def _map_lookup(
        self, state: str, call: str, keys: list[bytes], user_keys: list[bytes], namespaces: bytes | list[bytes]
    ) -> list[bytes | None]:
        b = self._b
        st, kgs, max_len, ns = self._v.batch(state, MAP, call, keys, namespaces, user_keys=user_keys)
        n = len(keys)
        if not n:
            return []
        with self._se.reading() as store:
            if store is None:
                return b.map_get(state, keys, user_keys, ns)
            sks = self._staged_keys(st, kgs, keys, ns, max_len)
            entry = r.ENTRY
            # One multi-get for the entries and the clear markers of their maps.
            found = store.get([sk + entry + uk for sk, uk in zip(sks, user_keys)] + [sk + r.HEAD for sk in sks])
            out: list[bytes | None] = [None] * n
            need: list[int] = []
            for i in range(n):
                e = found[i]
                if e is not None:
                    if e[0] == r.PUT_TAG:
                        out[i] = e[1:]
                elif found[n + i] is None:
                    need.append(i)
            if need:
                sub_keys, sub_ns = _subset(keys, ns, need)
                for i, c in zip(need, b.map_get(state, sub_keys, [user_keys[i] for i in need], sub_ns)):
                    out[i] = c
            return out

    def map_scan(
        self, state: str, key: bytes, namespace: bytes, keys_only: bool = False
    ) -> Iterator[tuple[bytes, bytes]]:
        """(user_key, value) of one map merged with this attempt's staged entries, sorted by user key."""
        st, kg = self._v.single_key(state, MAP, "MapScan", key, namespace)
        return self._map_scan(state, key, namespace, keys_only, self._staged_key(st, kg, key, namespace))

    def _map_scan(
        self, state: str, key: bytes, namespace: bytes, keys_only: bool, sk: bytes
    ) -> Iterator[tuple[bytes, bytes]]:
        with self._se.reading() as store:
            staged_any = store is not None
            cleared = store is not None and store.get([sk + r.HEAD])[0] is not None
        committed: Iterator[tuple[bytes, bytes]] = (
            iter(()) if cleared else self._b.map_scan(state, key, namespace, keys_only)
        )
        if not staged_any:
            yield from committed
            return
        strip = len(sk) + len(r.ENTRY)
        staged = ((k[strip:], v) for k, v in self._scan_staged(*_entries_range(sk)))
        c = next(committed, None)
        s = next(staged, None)
        while c is not None or s is not None:
            if s is None or (c is not None and c[0] < s[0]):
                yield c  # type: ignore[misc]  # not None: the loop runs while c or s is, and s is None or c < s
                c = next(committed, None)
                continue
            if c is not None and c[0] == s[0]:
                c = next(committed, None)  # the staged entry overrides the committed one
            if s[1][0] == r.PUT_TAG:
                yield (s[0], b"" if keys_only else s[1][1:])
            s = next(staged, None)

    # -- keys -------------------------------------------------------------------------------
    def scan_keys(self, state: str) -> Iterator[tuple[bytes, bytes]]:
        """Committed keys only: keys this attempt created show up once its epoch is committed."""
        return self._b.scan_keys(state)
