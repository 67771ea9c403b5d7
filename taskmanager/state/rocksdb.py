"""The RocksDB backend: one embedded RocksDB per slot (rocksdict, raw mode), one column family per state.

Concurrency: RocksDB serves point reads and scans from any thread. Every write goes through one
``WriteBatch`` per call under the slot's write lock, which also serializes the read-modify-write
paths (reduce, list sequence numbers, TTL refresh-on-read), so a batch is atomic and no update
is lost between two concurrent calls.

rocksdict traps handled here (see the field notes): the same ``Options(raw_mode=True)`` on
every open; options passed to every column family explicitly; no rocksdict iterator survives
between two chunks of a scan, and every column-family object is dropped before ``close()``,
because a live one keeps the DB's LOCK file held.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from itertools import islice
from operator import itemgetter
from pathlib import Path
from typing import Any, cast

import rocksdict

from keyedstate.common.clock import Clock
from keyedstate.common.descriptors import StateDescriptor, StateKind
from keyedstate.common.errors import (
    ConfigError,
    IncompatibleCheckpointError,
    InvalidArgumentError,
    KeyedStateError,
    Reason,
    StorageError,
)
from keyedstate.common.ids import KeyGroupRange, SubtaskId
from keyedstate.taskmanager.state import layout
from keyedstate.taskmanager.state.backend import (
    OP_CLEAR,
    OP_LIST_APPEND,
    OP_LIST_REPLACE,
    OP_MAP_PUT,
    OP_MAP_REMOVE,
    OP_REDUCE,
    OP_VALUE_PUT,
    KeyedStateBackend,
    Op,
    check_compatible,
    slot_db_dir,
)
from keyedstate.taskmanager.state.limits import StateLimits
from keyedstate.taskmanager.state.metadata import (
    COMMITTED_EPOCH,
    DEFAULT_CF,
    INTERNAL_META_PREFIX,
    META_CF,
    META_KEY_GROUPS,
    META_LAYOUT,
    META_MAX_PARALLELISM,
    META_STATES,
    SNAPSHOT_MANIFEST,
    decode_states,
    encode_states,
)
from keyedstate.taskmanager.state.resources import DEFAULT_RESOURCES, RocksDBResources
from keyedstate.taskmanager.state.restore import RestorePart, RestorePlan, merge_meta, plan_restore
from keyedstate.taskmanager.state.snapshot import LocalSnapshot
from keyedstate.taskmanager.state.validation import StateHandle

logger = logging.getLogger(__name__)

_SCAN_CHUNK = 1024
_SORT_MIN = 4096  # measured: sorting a WriteBatch pays off from a few thousand keys
_LIST_CACHE_MAX = 65_536
_SEQ_MAX = b"\xff" * layout.SEQ_BYTES
_VALUE_KINDS = (StateKind.VALUE, StateKind.REDUCING)
_first = itemgetter(0)
_PREFLUSH_MIN_BYTES = 256 << 10
"""Memtable bytes below which the cut flushes them itself (a few ms) and no pre-flush is needed."""
_PREFLUSH_ROUNDS = 3


def _read_chunk(cf: rocksdict.Rdict, start: bytes, end: bytes | None, n: int) -> list[tuple[bytes, bytes]]:
    """Up to ``n`` entries in ``[start, end)``; the iterator is gone when this returns."""
    ro = rocksdict.ReadOptions()
    if end is not None:
        ro.set_iterate_upper_bound(end)
    it = cf.items(from_key=start, read_opt=ro)
    try:
        return list(islice(cast("Iterator[tuple[bytes, bytes]]", it), n))  # raw mode: bytes only
    finally:
        del it


class StoredWrite:
    """One atomic write of already-encoded stored keys, open inside :meth:`RocksDBKeyedStateBackend.stored_write`."""

    __slots__ = ("_bounds", "_load_bounds", "batch", "now_ms")

    def __init__(
        self, now_ms: int, batch: rocksdict.WriteBatch, load_bounds: Callable[[StateHandle, bytes], tuple[int, int]]
    ) -> None:
        self.now_ms = now_ms
        """The one timestamp of the write (TTL headers and expiry), taken under the write lock as ``apply`` takes it."""
        self.batch = batch
        """Put and delete stored keys here, naming each state's column family (``StateHandle.handle``)."""
        self._load_bounds = load_bounds
        self._bounds: dict[tuple[str, bytes], tuple[int, int]] = {}

    def list_bounds(self, st: StateHandle, prefix: bytes) -> tuple[int, int]:
        """(first seq, next seq) of the list at ``prefix`` as this write leaves it so far."""
        bounds = self._bounds.get((st.name, prefix))
        return bounds if bounds is not None else self._load_bounds(st, prefix)

    def set_list_bounds(self, st: StateHandle, prefix: bytes, bounds: tuple[int, int]) -> None:
        """Record the list's bounds after the puts this write made to it."""
        self._bounds[(st.name, prefix)] = bounds

    @property
    def new_list_bounds(self) -> dict[tuple[str, bytes], tuple[int, int]]:
        """The bounds of every list this write changed (the backend caches them once it is written)."""
        return self._bounds


def check_local_dir(local_dir: Path, db_dir: Path) -> None:
    """Create the slot's directory, or fail naming the config key when it cannot be written."""
    try:
        db_dir.parent.mkdir(parents=True, exist_ok=True)
        probe = db_dir.parent / ".write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"state.backend.rocksdb.localdir {local_dir} cannot be written ({exc.strerror or exc}); "
            "point it to a writable local directory with enough space"
        ) from exc


class RocksDBKeyedStateBackend(KeyedStateBackend):
    """Keyed state in an embedded RocksDB at ``local_dir/<instance>/db``.

    Opening a directory that already holds a DB keeps its data (close/reopen, local recovery);
    key groups outside the new range are deleted and the declared states are checked against
    the stored ones.
    """

    BACKEND_KIND = "rocksdb"

    def __init__(
        self,
        subtask: SubtaskId,
        key_groups: KeyGroupRange,
        max_parallelism: int,
        states: Sequence[StateDescriptor],
        *,
        local_dir: Path,
        limits: StateLimits,
        clock: Clock,
        resources: RocksDBResources | None = None,
        carried: Sequence[StateDescriptor] = (),
    ) -> None:
        super().__init__(subtask, key_groups, max_parallelism, states, limits=limits, clock=clock, carried=carried)
        self._resources = resources or DEFAULT_RESOURCES
        self.local_dir = Path(local_dir)
        self.db_dir = slot_db_dir(self.local_dir, subtask)
        check_local_dir(self.local_dir, self.db_dir)
        self._write_lock = threading.RLock()
        self._wopts = rocksdict.WriteOptions()
        # (state, list prefix) -> (first seq, next seq) of lists touched recently; only
        # mutated under the write lock, and only after the batch that changed it was written.
        self._list_bounds: dict[tuple[str, bytes], tuple[int, int]] = {}
        self._sweep_state = 0
        self._sweep_from: bytes | None = None
        self._db: rocksdict.Rdict | None = None
        self._meta: rocksdict.Rdict | None = None
        self._meta_h: Any = None
        self._open()

    # -- opening ----------------------------------------------------------------------------
    def _open(self) -> None:
        db_dir = self.db_dir
        existing: list[str] = []
        if (db_dir / "CURRENT").exists():
            try:
                existing = rocksdict.Rdict.list_cf(str(db_dir), RocksDBResources.plain_options())
            except Exception as exc:
                raise StorageError(f"cannot read the column families of the RocksDB at {db_dir}: {exc}") from exc
        names = (set(existing) | {META_CF} | {h.name for h in self._all_handles()}) - {DEFAULT_CF}
        try:
            self._db = rocksdict.Rdict(
                str(db_dir),
                self._resources.db_options(),
                column_families={n: self._resources.column_family_options() for n in sorted(names)},
            )
        except Exception as exc:
            hint = (
                "another backend (or process) has it open; release that slot first"
                if "lock" in str(exc).lower()
                else "check the directory and free space"
            )
            raise StorageError(f"cannot open RocksDB at {db_dir} for {self.subtask}: {exc}; {hint}") from exc
        try:
            self._meta = self._db.get_column_family(META_CF)
            self._meta_h = self._db.get_column_family_handle(META_CF)
            self._adopt_stored(set(existing))
            for h in self._all_handles():
                h.store = self._db.get_column_family(h.name)
                h.handle = self._db.get_column_family_handle(h.name)
            self._clip_to_range()
            self._write_internal_meta()
        except BaseException:
            self._release()
            raise
        logger.info(
            "opened RocksDB state of %s at %s (key groups %s, states %s%s)",
            self.subtask,
            db_dir,
            self.key_groups,
            sorted(self._states),
            ", reopened existing data" if existing else "",
        )

    def _adopt_stored(self, existing: set[str]) -> None:
        """Check declared states against what the DB holds; adopt undeclared stored states."""
        assert self._meta is not None
        raw_mp = self._meta.get(META_MAX_PARALLELISM)
        if raw_mp is not None and int(raw_mp) != self.max_parallelism:
            raise IncompatibleCheckpointError(
                f"the RocksDB at {self.db_dir} was written with max parallelism {int(raw_mp)}, not {self.max_parallelism}; "
                "the max parallelism of a job is fixed for its life"
            )
        raw_states = self._meta.get(META_STATES)
        stored = {d.name: d for d in decode_states(raw_states)} if raw_states else {}
        for name, d in stored.items():
            if name in self._states:
                check_compatible(self._states[name].descriptor, d, f"the local RocksDB at {self.db_dir}")
            elif name not in self._carried and name in existing:
                self._carried[name] = StateHandle(d)
        unknown = existing - set(stored) - {META_CF, DEFAULT_CF} - set(self._states)
        if unknown:
            logger.warning(
                "RocksDB at %s has column families %s without descriptors; leaving them untouched",
                self.db_dir,
                sorted(unknown),
            )

    def _clip_to_range(self) -> None:
        assert self._meta is not None
        raw = self._meta.get(META_KEY_GROUPS)
        if raw is None:
            return
        start, end = (int(x) for x in raw.decode().split(","))
        if KeyGroupRange(start, end) == self.key_groups:
            return
        for h in self._all_handles():
            for begin, stop in layout.outside_ranges(self.key_groups):
                h.store.delete_range(begin, stop)
        logger.info(
            "clipped RocksDB state of %s from key groups [%d, %d] to %s", self.subtask, start, end, self.key_groups
        )

    def _write_internal_meta(self) -> None:
        wb = rocksdict.WriteBatch(raw_mode=True)
        wb.set_default_column_family(self._meta_h)
        wb.put(META_LAYOUT, str(layout.LAYOUT_VERSION).encode())
        wb.put(META_MAX_PARALLELISM, str(self.max_parallelism).encode())
        wb.put(META_KEY_GROUPS, f"{self.key_groups.start},{self.key_groups.end}".encode())
        wb.put(META_STATES, encode_states([h.descriptor for h in self._all_handles()]))
        self._write(wb)

    # -- low-level helpers ------------------------------------------------------------------
    def _write(self, wb: rocksdict.WriteBatch) -> None:
        assert self._db is not None
        try:
            self._db.write(wb, self._wopts)
        except Exception as exc:
            raise StorageError(
                f"RocksDB write of {self.subtask} failed: {exc}; check the disk of {self.db_dir}"
            ) from exc

    def _refresh(self, st: StateHandle, stored_keys: list[bytes], seen: list[bytes], now: int) -> None:
        """ON_READ_AND_WRITE: move the timestamps of values just read to ``now``.

        Only values still exactly as read are rewritten, so a concurrent write always wins.
        """
        if not stored_keys:
            return
        codec = st.codec
        with self._write_lock:
            current = st.store.get(stored_keys)
            wb = rocksdict.WriteBatch(raw_mode=True)
            wb.set_default_column_family(st.handle)
            for k, old, cur in zip(stored_keys, seen, current):
                if cur == old:
                    wb.put(k, codec.refreshed(old, now))
            if len(wb):
                self._write(wb)

    # -- value ------------------------------------------------------------------------------
    def _value_get(
        self, st: StateHandle, kgs: list[int], keys: list[bytes], ns: bytes | list[bytes], max_len: int
    ) -> list[bytes | None]:
        uniform = layout.uniform_stored_keys(kgs, keys, ns, max_len, sort=False)
        stored_keys = uniform[0] if uniform is not None else layout.build_prefixes(kgs, keys, ns, max_len)
        stored = st.store.get(stored_keys)
        codec = st.codec
        if not codec.has_ttl:
            return codec.decode_many(stored, 0)
        now = self.clock.now_ms()
        out = codec.decode_many(stored, now)
        if codec.update_on_read:
            live = [(k, s) for k, s, d in zip(stored_keys, stored, out) if d is not None]
            self._refresh(st, [k for k, _ in live], [s for _, s in live], now)
        return out

    def _value_put(
        self,
        st: StateHandle,
        kgs: list[int],
        keys: list[bytes],
        values: list[bytes],
        ns: bytes | list[bytes],
        max_len: int,
    ) -> None:
        header = st.codec.header(self.clock.now_ms() if st.codec.has_ttl else 0)
        wb = rocksdict.WriteBatch(raw_mode=True)
        wb.set_default_column_family(st.handle)
        uniform = layout.uniform_stored_keys(kgs, keys, ns, max_len, sort=True)
        if uniform is not None:
            # Keys of one length (the common shape): stored keys built and sorted in numpy, the
            # sorted batch inserted into the memtable faster; the stable sort keeps a repeated key's
            # last write last. deque(map(...)) runs the puts without a Python-level loop.
            stored_keys, order = uniform
            assert order is not None
            deque(map(wb.put, stored_keys, layout.prefixed_in_order(header, values, order)), maxlen=0)
        else:
            stored_keys = layout.build_prefixes(kgs, keys, ns, max_len)
            pairs: Any = zip(stored_keys, values)
            if len(stored_keys) >= _SORT_MIN:
                # In large batches, memtable inserts in key order save more than the sort costs (in
                # small ones they do not); the sort is stable, so a repeated key's last write wins.
                pairs = sorted(pairs, key=_first)
            put = wb.put
            for k, v in pairs:
                put(k, header + v)
        with self._write_lock:
            self._write(wb)

    # -- writes of stored keys (the epoch commit's fast path) --------------------------------
    @contextmanager
    def stored_write(self, meta: dict[bytes, bytes]) -> Iterator[StoredWrite]:
        """One WriteBatch of stored keys, written with ``meta`` atomically when the block ends without raising.

        For callers that hold stored keys validated earlier (the staged records of an epoch
        commit): the in-flight gate and the write lock are held for the whole block, as
        :meth:`apply` holds them, so reads through :meth:`stored_get` inside it see no
        concurrent write, and nothing is written if the block raises.
        """
        checked = self._check_meta(meta)
        iters: dict[str, Any] = {}
        with self._op, self._write_lock:
            write = StoredWrite(
                self.clock.now_ms(),
                rocksdict.WriteBatch(raw_mode=True),
                lambda st, prefix: self._list_bounds_of(st, prefix, iters),
            )
            try:
                yield write
            finally:
                iters.clear()  # no iterator may outlive the call (it would pin the DB)
            self._commit_batch(write.batch, checked, write.new_list_bounds)

    def stored_get(self, st: StateHandle, stored_keys: list[bytes]) -> list[bytes | None]:
        """The stored values (format header included) of stored keys of one state, in one multi-get."""
        return cast("list[bytes | None]", st.store.get(stored_keys))

    # -- batched writes ---------------------------------------------------------------------
    def _list_bounds_of(self, st: StateHandle, prefix: bytes, iters: dict[str, Any]) -> tuple[int, int]:
        """(first seq, next seq) of a stored list: a bounded forward and reverse seek."""
        cached = self._list_bounds.get((st.name, prefix))
        if cached is not None:
            return cached
        it = iters.get(st.name)
        if it is None:
            it = iters[st.name] = st.store.iter()
        it.seek_for_prev(prefix + _SEQ_MAX)
        if not it.valid() or not it.key().startswith(prefix):
            return (0, 0)
        last = int.from_bytes(it.key()[-layout.SEQ_BYTES :], "big")
        it.seek(prefix)
        first = int.from_bytes(it.key()[-layout.SEQ_BYTES :], "big")
        return (first, last + 1)

    def _stored_list_length(self, st: StateHandle, kg: int, key: bytes, ns: bytes, cache: dict[str, Any]) -> int:
        first, nxt = self._list_bounds_of(st, layout.key_prefix(kg, key, ns), cache)
        return nxt - first

    def _reduce_bases(self, ops: list[Op]) -> dict[tuple[str, bytes], bytes | None]:
        """Current stored values of every reduced key of ``ops``, read in one multi-get per state."""
        key_prefix = layout.key_prefix
        base: dict[tuple[str, bytes], bytes | None] = {}
        reduce_keys: dict[str, tuple[StateHandle, list[bytes]]] = {}
        for code, st, kg, key, ns, *_ in ops:
            if code == OP_REDUCE:
                reduce_keys.setdefault(st.name, (st, []))[1].append(key_prefix(kg, key, ns))
        for name, (st, sks) in reduce_keys.items():
            base.update(zip(((name, k) for k in sks), st.store.get(sks)))
        return base

    def _commit_batch(
        self,
        wb: rocksdict.WriteBatch,
        meta: dict[bytes, bytes] | None,
        bounds: dict[tuple[str, bytes], tuple[int, int]],
    ) -> None:
        """Write the batch (with the metadata writes) and remember the lists' new bounds (write lock held)."""
        if meta:
            for k, v in meta.items():
                wb.put(k, v, self._meta_h)
        self._write(wb)
        if bounds:
            if len(self._list_bounds) + len(bounds) > _LIST_CACHE_MAX:
                self._list_bounds.clear()
            self._list_bounds.update(bounds)

    def _execute(self, ops: list[Op], meta: dict[bytes, bytes] | None) -> list[bytes]:
        results: list[bytes] = []  # the new vector of every REDUCE op, in order
        key_prefix = layout.key_prefix
        with self._write_lock:
            now = self.clock.now_ms()
            base = self._reduce_bases(ops)
            wb = rocksdict.WriteBatch(raw_mode=True)
            # Values this batch wrote so far: a later REDUCE of the same key continues from them.
            overlay: dict[tuple[str, bytes], bytes | None] = {}
            bounds: dict[tuple[str, bytes], tuple[int, int]] = {}
            iters: dict[str, Any] = {}
            try:
                for code, st, kg, key, ns, user_key, value, values in ops:
                    prefix = key_prefix(kg, key, ns)
                    h = st.handle
                    if code == OP_VALUE_PUT:
                        stored = st.codec.header(now) + value
                        wb.put(prefix, stored, h)
                        overlay[(st.name, prefix)] = stored
                    elif code == OP_REDUCE:
                        slot = (st.name, prefix)
                        # A key reduced earlier in this batch continues from that value.
                        current = overlay[slot] if slot in overlay else base[slot]
                        new = st.reducer.combine(st.codec.decode(current, now), value)  # type: ignore[union-attr]  # REDUCE ops exist only for reducing state, which has a reducer
                        stored = st.codec.header(now) + new
                        wb.put(prefix, stored, h)
                        overlay[slot] = stored
                        results.append(new)
                    elif code == OP_MAP_PUT:
                        wb.put(prefix + user_key, st.codec.header(now) + value, h)
                    elif code == OP_MAP_REMOVE:
                        wb.delete(prefix + user_key, h)
                    elif code == OP_LIST_APPEND:
                        slot = (st.name, prefix)
                        first, nxt = bounds.get(slot) or self._list_bounds_of(st, prefix, iters)
                        self.validation.list_length(nxt - first, len(values), key)
                        header = st.codec.header(now)
                        for v in values:
                            wb.put(prefix + nxt.to_bytes(layout.SEQ_BYTES, "big"), header + v, h)
                            nxt += 1
                        bounds[slot] = (first, nxt)
                    elif code == OP_LIST_REPLACE:
                        self.validation.list_length(0, len(values), key)
                        # The batch applies in order, so the puts after the range delete survive it.
                        wb.delete_range(prefix, layout.key_prefix_end(prefix), h)
                        header = st.codec.header(now)
                        for i, v in enumerate(values):
                            wb.put(prefix + i.to_bytes(layout.SEQ_BYTES, "big"), header + v, h)
                        bounds[(st.name, prefix)] = (0, len(values))
                    elif code == OP_CLEAR:
                        if st.kind in _VALUE_KINDS:
                            wb.delete(prefix, h)
                            overlay[(st.name, prefix)] = None
                        else:
                            wb.delete_range(prefix, layout.key_prefix_end(prefix), h)
                            if st.kind is StateKind.LIST:
                                bounds[(st.name, prefix)] = (0, 0)
                    else:  # pragma: no cover - codes come from the base class
                        raise KeyedStateError(f"unknown op code {code}", reason=Reason.INTERNAL)
            finally:
                iters.clear()
            self._commit_batch(wb, meta, bounds)
        return results

    # -- list -------------------------------------------------------------------------------
    def _list_get(
        self, st: StateHandle, kgs: list[int], keys: list[bytes], ns: bytes | list[bytes], max_len: int
    ) -> list[list[bytes]]:
        prefixes = layout.build_prefixes(kgs, keys, ns, max_len)
        codec = st.codec
        now = self.clock.now_ms() if codec.has_ttl else 0
        limit = self.limits.max_list_response_bytes
        total = 0
        out: list[list[bytes]] = []
        seen_keys: list[bytes] = []
        seen_values: list[bytes] = []
        for prefix in prefixes:
            elements: list[bytes] = []
            end = layout.prefix_end(prefix)
            start = prefix
            while True:
                chunk = _read_chunk(st.store, start, end, _SCAN_CHUNK)
                for k, v in chunk:
                    d = codec.decode(v, now)
                    if d is None:
                        continue
                    total += len(d)
                    if total > limit:
                        raise self.validation.list_too_large(st.name, limit)
                    elements.append(d)
                    if codec.update_on_read:
                        seen_keys.append(k)
                        seen_values.append(v)
                if len(chunk) < _SCAN_CHUNK:
                    break
                start = chunk[-1][0] + b"\x00"
            out.append(elements)
        if seen_keys:
            self._refresh(st, seen_keys, seen_values, now)
        return out

    def _scan(
        self,
        st: StateHandle,
        begin: bytes,
        end: bytes | None,
        emit: Callable[[bytes, bytes, int], Any],
        refresh: bool = True,
    ) -> Iterator[Any]:
        """Chunked scan of ``[begin, end)``; ``emit(key, value, now)`` returns an item or None (skip)."""
        start = begin
        codec = st.codec
        refresh = refresh and codec.update_on_read
        while True:
            with self._op:
                chunk = _read_chunk(st.store, start, end, _SCAN_CHUNK)
                now = self.clock.now_ms() if codec.has_ttl else 0
                items = []
                live_keys: list[bytes] = []
                live_values: list[bytes] = []
                for k, v in chunk:
                    item = emit(k, v, now)
                    if item is not None:
                        items.append(item)
                        if refresh:
                            live_keys.append(k)
                            live_values.append(v)
                if live_keys:
                    self._refresh(st, live_keys, live_values, now)
            yield from items
            if len(chunk) < _SCAN_CHUNK:
                return
            start = chunk[-1][0] + b"\x00"

    def _list_scan(self, st: StateHandle, kg: int, key: bytes, namespace: bytes) -> Iterator[bytes]:
        prefix = layout.key_prefix(kg, key, namespace)
        decode = st.codec.decode
        return self._scan(st, prefix, layout.prefix_end(prefix), lambda k, v, now: decode(v, now))

    # -- map --------------------------------------------------------------------------------
    def _map_get(
        self,
        st: StateHandle,
        kgs: list[int],
        keys: list[bytes],
        user_keys: list[bytes],
        ns: bytes | list[bytes],
        max_len: int,
    ) -> list[bytes | None]:
        prefixes = layout.build_prefixes(kgs, keys, ns, max_len)
        stored_keys = [p + uk for p, uk in zip(prefixes, user_keys)]
        stored = st.store.get(stored_keys)
        codec = st.codec
        now = self.clock.now_ms() if codec.has_ttl else 0
        out = codec.decode_many(stored, now)
        if codec.update_on_read:
            live = [(k, s) for k, s, d in zip(stored_keys, stored, out) if d is not None]
            self._refresh(st, [k for k, _ in live], [s for _, s in live], now)
        return out

    def _map_scan(
        self, st: StateHandle, kg: int, key: bytes, namespace: bytes, keys_only: bool
    ) -> Iterator[tuple[bytes, bytes]]:
        prefix = layout.key_prefix(kg, key, namespace)
        n = len(prefix)
        decode = st.codec.decode

        def emit(k: bytes, v: bytes, now: int) -> tuple[bytes, bytes] | None:
            d = decode(v, now)
            if d is None:
                return None
            return (k[n:], b"" if keys_only else d)

        return self._scan(st, prefix, layout.prefix_end(prefix), emit)

    # -- keys -------------------------------------------------------------------------------
    def _scan_keys(self, st: StateHandle) -> Iterator[tuple[bytes, bytes]]:
        begin, end = layout.key_group_bounds(self.key_groups)
        is_expired = st.codec.is_expired
        current: list[Any] = [None, False]  # prefix being visited, whether it was emitted

        def emit(k: bytes, v: bytes, now: int) -> tuple[bytes, bytes] | None:
            prefix = current[0]
            if prefix is not None and k.startswith(prefix):
                if current[1] or is_expired(v, now):
                    return None
            else:
                prefix = k[: layout.prefix_length(k)]
                current[0], current[1] = prefix, False
                if is_expired(v, now):
                    return None
            current[1] = True
            decoded = layout.decode_key(k)
            return (decoded.key, decoded.namespace)

        # Listing keys is not a read of their values: it never moves TTL timestamps.
        return self._scan(st, begin, end, emit, refresh=False)

    # -- metadata ---------------------------------------------------------------------------
    def get_meta(self, key: bytes) -> bytes | None:
        with self._op:
            assert self._meta is not None
            return self._meta.get(key)

    # -- TTL --------------------------------------------------------------------------------
    def ttl_sweep(self, max_entries: int) -> int:
        """Examine up to ``max_entries`` entries of the slot's key groups from where the last sweep stopped.

        Returns how many expired entries it deleted; raises InvalidArgumentError for ``max_entries`` below 1.
        """
        if max_entries < 1:
            raise InvalidArgumentError(f"ttl_sweep needs max_entries >= 1, got {max_entries}")
        handles = [h for h in self._all_handles() if h.codec.has_ttl]
        if not handles:
            return 0
        begin, end = layout.key_group_bounds(self.key_groups)
        budget = max_entries
        deleted = 0
        finished_states = 0
        with self._op:
            while budget > 0 and finished_states < len(handles):
                st = handles[self._sweep_state % len(handles)]
                want = min(budget, _SCAN_CHUNK)
                chunk = _read_chunk(st.store, self._sweep_from or begin, end, want)
                budget -= len(chunk)
                now = self.clock.now_ms()
                expired = [k for k, v in chunk if st.codec.is_expired(v, now)]
                if expired:
                    deleted += self._delete_if_expired(st, expired, now)
                if len(chunk) < want:
                    self._sweep_state = (self._sweep_state + 1) % len(handles)
                    self._sweep_from = None
                    finished_states += 1
                else:
                    self._sweep_from = chunk[-1][0] + b"\x00"
        if deleted:
            logger.debug("TTL sweep of %s deleted %d expired entries", self.subtask, deleted)
        return deleted

    def _delete_if_expired(self, st: StateHandle, keys: list[bytes], now: int) -> int:
        with self._write_lock:
            current = st.store.get(keys)
            wb = rocksdict.WriteBatch(raw_mode=True)
            wb.set_default_column_family(st.handle)
            n = 0
            for k, v in zip(keys, current):
                # Re-checked under the lock: a write since the scan made the entry live again.
                if v is not None and st.codec.is_expired(v, now):
                    wb.delete(k)
                    n += 1
            if n:
                self._write(wb)
                if st.kind is StateKind.LIST:
                    self._list_bounds = {k: b for k, b in self._list_bounds.items() if k[0] != st.name}
            return n

    # -- metrics ----------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Summed RocksDB properties of every column family, plus the shared block cache and write buffer manager."""
        per_cf = ("estimate-num-keys", "cur-size-all-mem-tables", "total-sst-files-size", "estimate-live-data-size")
        out = dict.fromkeys(per_cf, 0)
        with self._op:
            assert self._db is not None and self._meta is not None
            for store in [h.store for h in self._all_handles()] + [self._meta]:
                for name in per_cf:
                    out[name] += store.property_int_value(f"rocksdb.{name}") or 0
            out["block-cache-usage"] = self._db.property_int_value("rocksdb.block-cache-usage") or 0
            out["block-cache-capacity"] = self._resources.shared().capacity_bytes
            out["num-running-compactions"] = self._db.property_int_value("rocksdb.num-running-compactions") or 0
            out["num-running-flushes"] = self._db.property_int_value("rocksdb.num-running-flushes") or 0
            out["write-buffer-manager-usage"] = self._resources.shared().write_buffer_manager.get_usage()
        return out

    def native_metrics(self, properties: Sequence[str]) -> list[tuple[str, str, int]]:
        """``(column family, property, value)`` of each RocksDB ``property`` (without ``rocksdb.``) of each column family.

        What Flink's RocksDB native metrics read: every property per column family (a DB-wide
        one, such as ``is-write-stopped``, shows the same value in each).
        """
        out: list[tuple[str, str, int]] = []
        with self._op:
            assert self._db is not None and self._meta is not None
            for name, store in [(h.name, h.store) for h in self._all_handles()] + [(META_CF, self._meta)]:
                for prop in properties:
                    out.append((name, prop, store.property_int_value(f"rocksdb.{prop}") or 0))
        return out

    # -- snapshot / restore -----------------------------------------------------------------
    def snapshot(self, target_dir: Path) -> LocalSnapshot:
        """A RocksDB checkpoint (memtables flushed, SST files hard-linked) plus the manifest; ready on return.

        The checkpoint is cut under the write lock, so it holds the state at one instant during
        this call. Flushing a full memtable takes hundreds of milliseconds; it is done first,
        while writes go on, so that the cut itself only flushes what arrived meanwhile.
        ``blocked_ms`` of the result is how long writes waited for the cut.
        """
        target = Path(target_dir)
        if target.exists():
            raise InvalidArgumentError(
                f"snapshot directory {target} already exists; use a new directory per checkpoint"
            )
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(
                f"cannot create the parent of snapshot directory {target}: {exc.strerror or exc}"
            ) from exc
        with self._op:
            assert self._db is not None and self._meta is not None
            self._preflush()
            with self._write_lock:
                t0 = time.perf_counter()
                checkpoint = rocksdict.Checkpoint(self._db)
                try:
                    checkpoint.create_checkpoint(str(target))
                except Exception as exc:
                    shutil.rmtree(target, ignore_errors=True)
                    raise StorageError(f"RocksDB checkpoint of {self.subtask} into {target} failed: {exc}") from exc
                finally:
                    del checkpoint
                raw = self._meta.get(COMMITTED_EPOCH)
                blocked_ms = (time.perf_counter() - t0) * 1000
        snapshot = LocalSnapshot(
            target, self._manifest(), blocked_ms=blocked_ms, committed_epoch=int(raw) if raw and raw.isdigit() else None
        )
        snapshot.materialize()
        return snapshot

    def _preflush(self) -> None:
        """Flush the memtables without the write lock (writes go on), so the cut has little left to flush."""
        assert self._meta is not None
        stores = [h.store for h in self._all_handles()] + [self._meta]
        for _ in range(_PREFLUSH_ROUNDS):
            pending = sum(s.property_int_value("rocksdb.cur-size-all-mem-tables") or 0 for s in stores)
            if pending < _PREFLUSH_MIN_BYTES:
                return
            t0 = time.perf_counter()
            for store in stores:
                store.flush(True)
            logger.debug(
                "pre-flush of %s before a snapshot: %d bytes in %.0f ms",
                self.subtask,
                pending,
                (time.perf_counter() - t0) * 1000,
            )

    @classmethod
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
        resources: RocksDBResources | None = None,
    ) -> RocksDBKeyedStateBackend:
        """Build the slot's DB from local snapshots, keeping only ``key_groups``.

        The RocksDB snapshot with the largest overlap becomes the DB itself (SST files hard-linked,
        foreign key groups removed with ``delete_range``); the others contribute their overlap as
        SST files written in key order and ingested. Existing local data of the slot is replaced,
        so the slot's previous backend must be closed first.
        """
        plan = plan_restore(snapshot_dirs, key_groups, max_parallelism, states)
        db_dir = slot_db_dir(Path(local_dir), subtask)
        check_local_dir(Path(local_dir), db_dir)
        shutil.rmtree(db_dir, ignore_errors=True)
        rocks = [p for p in plan.contributing if p.manifest.backend == cls.BACKEND_KIND]
        base = max(rocks, key=lambda p: len(p.overlap), default=None)
        if base is not None:
            _copy_checkpoint(base.directory, db_dir)
        backend = cls(
            subtask,
            key_groups,
            max_parallelism,
            states,
            local_dir=local_dir,
            limits=limits,
            clock=clock,
            resources=resources,
            carried=plan.carried,
        )
        try:
            backend._ingest_parts(plan, base, db_dir.parent / "restore-staging")
        except BaseException:
            backend.close()
            raise
        logger.info(
            "restored %s key groups %s from %d snapshot(s) (%s as base)",
            subtask,
            key_groups,
            len(plan.parts),
            base.directory if base else "no RocksDB snapshot",
        )
        return backend

    def _ingest_parts(self, plan: RestorePlan, base: RestorePart | None, staging: Path) -> None:
        """Restore step two: ingest each snapshot's overlap but the base's (the DB already is the base), then
        merge every snapshot's user metadata (the base's included)."""
        metas = []
        shutil.rmtree(staging, ignore_errors=True)
        for part in plan.parts:
            with part.open() as reader:
                metas.append(reader.meta())
                if part is base or not len(part.overlap):
                    continue
                names = {d.name for d in part.manifest.states}
                for st in self._all_handles():
                    if st.name in names:
                        self._ingest(st, reader.entries(st.name, part.overlap), staging)
        shutil.rmtree(staging, ignore_errors=True)
        self._replace_user_meta(merge_meta(metas))

    def _ingest(self, st: StateHandle, entries: Iterator[tuple[bytes, bytes]], staging: Path) -> None:
        """Write sorted entries to an SST file and ingest it into the state's column family."""
        staging.mkdir(parents=True, exist_ok=True)
        path = staging / f"{st.name}-{len(list(staging.iterdir()))}.sst"
        writer = rocksdict.SstFileWriter(RocksDBResources.plain_options())
        writer.open(str(path))
        count = 0
        for k, v in entries:
            writer[k] = v
            count += 1
        if not count:
            del writer
            path.unlink(missing_ok=True)
            return
        writer.finish()
        del writer
        opts = rocksdict.IngestExternalFileOptions()
        opts.set_move_files(True)
        with self._write_lock:
            try:
                st.store.ingest_external_file([str(path)], opts)
            except Exception as exc:
                raise StorageError(f"ingesting restored state {st.name!r} into {self.db_dir} failed: {exc}") from exc
        self._list_bounds.clear()

    def _replace_user_meta(self, meta: dict[bytes, bytes]) -> None:
        assert self._meta is not None
        wb = rocksdict.WriteBatch(raw_mode=True)
        wb.set_default_column_family(self._meta_h)
        for k in cast("list[bytes]", list(self._meta.keys())):  # raw mode: bytes keys
            if not k.startswith(INTERNAL_META_PREFIX) and k not in meta:
                wb.delete(k)
        for k, v in meta.items():
            wb.put(k, v)
        with self._write_lock:
            self._write(wb)

    # -- closing ----------------------------------------------------------------------------
    def _release(self) -> None:
        for h in self._all_handles():
            h.store = None
            h.handle = None
        self._meta = None
        self._meta_h = None
        self._list_bounds.clear()
        if self._db is not None:
            try:
                self._db.close()
            finally:
                self._db = None

    def _close(self) -> None:
        with self._write_lock:
            if self._db is None:
                return
            try:
                self._db.flush()
            except Exception:
                logger.exception("flushing RocksDB of %s before close failed", self.subtask)
            self._release()
        logger.info("closed RocksDB state of %s", self.subtask)


def _copy_checkpoint(source: Path, db_dir: Path) -> None:
    """Make ``db_dir`` a copy of a checkpoint: SST files hard-linked (immutable), the rest copied.

    MANIFEST, CURRENT, OPTIONS and WAL files change when the DB opens, so they must not be
    shared with the snapshot (which may still be uploading or kept for local recovery).
    """
    db_dir.mkdir(parents=True)
    for entry in os.scandir(source):
        if not entry.is_file() or entry.name == SNAPSHOT_MANIFEST:
            continue
        target = db_dir / entry.name
        if entry.name.endswith(".sst"):
            try:
                os.link(entry.path, target)
                continue
            except OSError:
                pass  # another file system: copy instead
        shutil.copy2(entry.path, target)
