"""The HashMap backend: a slot's state in Python dicts, with the same semantics as RocksDB.

Tables map ``(key, namespace)`` to the stored value (value/reducing state), a list of stored
elements (list state) or a dict of user key to stored value (map state). Stored values carry
the same header as in RocksDB (:mod:`.values`), and snapshots are written as stored RocksDB
keys and values (:mod:`.snapshot`), so both backends restore each other's snapshots.

One lock guards everything. A batch is validated completely (including list lengths) before the
first change, and nothing after that can fail, so each batch applies atomically.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from itertools import repeat
from pathlib import Path
from typing import Any

from keyedstate.common.clock import Clock
from keyedstate.common.descriptors import StateDescriptor, StateKind
from keyedstate.common.errors import InvalidArgumentError, KeyedStateError, Reason, StorageError
from keyedstate.common.ids import KeyGroupRange, SubtaskId
from keyedstate.common.keygroups import key_group
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
)
from keyedstate.taskmanager.state.limits import StateLimits
from keyedstate.taskmanager.state.metadata import COMMITTED_EPOCH, HASHMAP_META_FILE, HASHMAP_STATE_FILE
from keyedstate.taskmanager.state.restore import merge_meta, plan_restore
from keyedstate.taskmanager.state.snapshot import LocalSnapshot, SnapshotReader, write_kvs
from keyedstate.taskmanager.state.validation import StateHandle
from keyedstate.taskmanager.state.values import ValueCodec

logger = logging.getLogger(__name__)


def _live(entry: Any, codec: ValueCodec, now: int) -> bool:
    expired = codec.is_expired
    if isinstance(entry, bytes):
        return not expired(entry, now)
    if isinstance(entry, list):
        return any(not expired(v, now) for v in entry)
    return any(not expired(v, now) for v in entry.values())


class HashMapKeyedStateBackend(KeyedStateBackend):
    """Keyed state on the Python heap (Flink's HashMapStateBackend)."""

    BACKEND_KIND = "hashmap"

    def __init__(
        self,
        subtask: SubtaskId,
        key_groups: KeyGroupRange,
        max_parallelism: int,
        states: Sequence[StateDescriptor],
        *,
        limits: StateLimits,
        clock: Clock,
        local_dir: Path | None = None,
        resources: Any = None,
        carried: Sequence[StateDescriptor] = (),
    ) -> None:
        super().__init__(subtask, key_groups, max_parallelism, states, limits=limits, clock=clock, carried=carried)
        self.local_dir = Path(local_dir) if local_dir is not None else None
        self._lock = threading.RLock()
        self._meta: dict[bytes, bytes] = {}
        for h in self._all_handles():
            h.store = {}
        self._sweep_state = 0
        self._sweep_keys: list[tuple[bytes, bytes]] | None = None
        self._sweep_pos = 0
        logger.info("created HashMap state of %s (key groups %s, states %s)", subtask, key_groups, sorted(self._states))

    # -- value ------------------------------------------------------------------------------
    def _value_get(
        self, st: StateHandle, kgs: list[int], keys: list[bytes], ns: bytes | list[bytes], max_len: int
    ) -> list[bytes | None]:
        tbl = st.store
        codec = st.codec
        with self._lock:
            if isinstance(ns, bytes):
                stored = [tbl.get((k, ns)) for k in keys]
            else:
                stored = [tbl.get(kn) for kn in zip(keys, ns)]
            if not codec.has_ttl:
                return codec.decode_many(stored, 0)
            now = self.clock.now_ms()
            out = codec.decode_many(stored, now)
            if codec.update_on_read:
                for k, n, s, d in zip(keys, self._ns_iter(ns, len(keys)), stored, out):
                    if d is not None:
                        tbl[(k, n)] = codec.refreshed(s, now)
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
        stored = st.codec.encode_many(values, self.clock.now_ms() if st.codec.has_ttl else 0)
        tkeys = zip(keys, repeat(ns)) if isinstance(ns, bytes) else zip(keys, ns)
        with self._lock:
            st.store.update(zip(tkeys, stored))

    # -- batched writes ---------------------------------------------------------------------
    def _stored_list_length(self, st: StateHandle, kg: int, key: bytes, ns: bytes, cache: dict[str, Any]) -> int:
        return len(st.store.get((key, ns), ()))

    def _execute(self, ops: list[Op], meta: dict[bytes, bytes] | None) -> list[bytes]:
        results: list[bytes] = []
        with self._lock:
            now = self.clock.now_ms()
            # Pass 1: the only data-dependent check (list lengths), before any change.
            self._check_list_lengths(ops, {})
            # Pass 2: apply; nothing below can fail on valid input.
            for code, st, _kg, key, ns, user_key, value, values in ops:
                tbl = st.store
                k = (key, ns)
                if code == OP_VALUE_PUT:
                    tbl[k] = st.codec.header(now) + value
                elif code == OP_REDUCE:
                    new = st.reducer.combine(st.codec.decode(tbl.get(k), now), value)  # type: ignore[union-attr]  # REDUCE ops exist only for reducing state, which has a reducer
                    tbl[k] = st.codec.header(now) + new
                    results.append(new)
                elif code == OP_LIST_APPEND:
                    header = st.codec.header(now)
                    lst = tbl.get(k)
                    if lst is None:
                        lst = tbl[k] = []
                    lst.extend(header + v for v in values)
                elif code == OP_LIST_REPLACE:
                    if values:
                        header = st.codec.header(now)
                        tbl[k] = [header + v for v in values]
                    else:
                        tbl.pop(k, None)
                elif code == OP_MAP_PUT:
                    m = tbl.get(k)
                    if m is None:
                        m = tbl[k] = {}
                    m[user_key] = st.codec.header(now) + value
                elif code == OP_MAP_REMOVE:
                    m = tbl.get(k)
                    if m is not None:
                        m.pop(user_key, None)
                        if not m:
                            del tbl[k]
                elif code == OP_CLEAR:
                    tbl.pop(k, None)
                else:  # pragma: no cover - codes come from the base class
                    raise KeyedStateError(f"unknown op code {code}", reason=Reason.INTERNAL)
            if meta:
                self._meta.update(meta)
        return results

    # -- list -------------------------------------------------------------------------------
    def _list_get(
        self, st: StateHandle, kgs: list[int], keys: list[bytes], ns: bytes | list[bytes], max_len: int
    ) -> list[list[bytes]]:
        codec = st.codec
        limit = self.limits.max_list_response_bytes
        total = 0
        out: list[list[bytes]] = []
        with self._lock:
            now = self.clock.now_ms() if codec.has_ttl else 0
            refresh: list[tuple[list[bytes], int, bytes]] = []
            for k, n in zip(keys, self._ns_iter(ns, len(keys))):
                elements: list[bytes] = []
                stored = st.store.get((k, n), ())
                for i, s in enumerate(stored):
                    d = codec.decode(s, now)
                    if d is None:
                        continue
                    total += len(d)
                    if total > limit:
                        raise self.validation.list_too_large(st.name, limit)
                    elements.append(d)
                    if codec.update_on_read:
                        refresh.append((stored, i, s))
                out.append(elements)
            for lst, i, s in refresh:
                lst[i] = codec.refreshed(s, now)
        return out

    def _list_scan(self, st: StateHandle, kg: int, key: bytes, namespace: bytes) -> Iterator[bytes]:
        codec = st.codec
        with self._op, self._lock:
            now = self.clock.now_ms() if codec.has_ttl else 0
            stored = st.store.get((key, namespace), [])
            items = []
            for i, s in enumerate(stored):
                d = codec.decode(s, now)
                if d is not None:
                    items.append(d)
                    if codec.update_on_read:
                        stored[i] = codec.refreshed(s, now)
        yield from items

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
        codec = st.codec
        tbl = st.store
        out: list[bytes | None] = []
        with self._lock:
            now = self.clock.now_ms() if codec.has_ttl else 0
            for k, uk, n in zip(keys, user_keys, self._ns_iter(ns, len(keys))):
                m = tbl.get((k, n))
                s = m.get(uk) if m is not None else None
                d = codec.decode(s, now)
                out.append(d)
                if d is not None and codec.update_on_read:
                    m[uk] = codec.refreshed(s, now)  # type: ignore[arg-type]  # d is not None, so the entry s exists
        return out

    def _map_scan(
        self, st: StateHandle, kg: int, key: bytes, namespace: bytes, keys_only: bool
    ) -> Iterator[tuple[bytes, bytes]]:
        codec = st.codec
        with self._op, self._lock:
            now = self.clock.now_ms() if codec.has_ttl else 0
            m = st.store.get((key, namespace), {})
            items = []
            for uk, s in sorted(m.items()):
                d = codec.decode(s, now)
                if d is not None:
                    items.append((uk, b"" if keys_only else d))
                    if codec.update_on_read:
                        m[uk] = codec.refreshed(s, now)
        yield from items

    def _scan_keys(self, st: StateHandle) -> Iterator[tuple[bytes, bytes]]:
        with self._op, self._lock:
            now = self.clock.now_ms()
            codec = st.codec
            if codec.has_ttl:
                keys = [kn for kn, e in st.store.items() if _live(e, codec, now)]
            else:
                keys = list(st.store)
        yield from keys

    # -- metadata ---------------------------------------------------------------------------
    def get_meta(self, key: bytes) -> bytes | None:
        with self._op, self._lock:
            return self._meta.get(key)

    # -- TTL --------------------------------------------------------------------------------
    def ttl_sweep(self, max_entries: int) -> int:
        """Examine up to ``max_entries`` stored values from where the last sweep stopped; returns how many expired.

        Raises InvalidArgumentError for ``max_entries`` below 1. Holds the backend's lock throughout: serving waits
        for the whole step, so keep ``max_entries`` small.
        """
        if max_entries < 1:
            raise InvalidArgumentError(f"ttl_sweep needs max_entries >= 1, got {max_entries}")
        handles = [h for h in self._all_handles() if h.codec.has_ttl]
        if not handles:
            return 0
        budget = max_entries
        deleted = 0
        finished = 0
        with self._op, self._lock:
            now = self.clock.now_ms()
            while budget > 0 and finished < len(handles):
                st = handles[self._sweep_state % len(handles)]
                tbl = st.store
                expired = st.codec.is_expired
                if self._sweep_keys is None:
                    self._sweep_keys = list(tbl)
                    self._sweep_pos = 0
                keys = self._sweep_keys
                while budget > 0 and self._sweep_pos < len(keys):
                    kn = keys[self._sweep_pos]
                    self._sweep_pos += 1
                    entry = tbl.get(kn)
                    if entry is None:
                        continue
                    if isinstance(entry, bytes):
                        budget -= 1
                        if expired(entry, now):
                            del tbl[kn]
                            deleted += 1
                    elif isinstance(entry, list):
                        budget -= len(entry)
                        kept = [v for v in entry if not expired(v, now)]
                        deleted += len(entry) - len(kept)
                        if not kept:
                            del tbl[kn]
                        elif len(kept) != len(entry):
                            entry[:] = kept
                    else:
                        budget -= len(entry)
                        gone = [uk for uk, v in entry.items() if expired(v, now)]
                        for uk in gone:
                            del entry[uk]
                        deleted += len(gone)
                        if not entry:
                            del tbl[kn]
                if self._sweep_pos >= len(keys):
                    self._sweep_state = (self._sweep_state + 1) % len(handles)
                    self._sweep_keys = None
                    finished += 1
        return deleted

    # -- metrics ----------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """``estimate-num-keys``: entries (each list element and map entry counted); ``num-keys-namespaces``: pairs."""
        entries = 0
        keys = 0
        with self._op, self._lock:
            for h in self._all_handles():
                keys += len(h.store)
                if h.kind is StateKind.LIST or h.kind is StateKind.MAP:
                    entries += sum(len(e) for e in h.store.values())
                else:
                    entries += len(h.store)
        return {"estimate-num-keys": entries, "num-keys-namespaces": keys}

    # -- snapshot / restore -----------------------------------------------------------------
    def snapshot(self, target_dir: Path) -> LocalSnapshot:
        """Copies the tables under the lock; ``materialize()`` writes the files afterwards."""
        target = Path(target_dir)
        if target.exists():
            raise InvalidArgumentError(
                f"snapshot directory {target} already exists; use a new directory per checkpoint"
            )
        try:
            target.mkdir(parents=True)
        except OSError as exc:
            raise StorageError(f"cannot create snapshot directory {target}: {exc.strerror or exc}") from exc
        copies: list[tuple[StateHandle, dict[tuple[bytes, bytes], Any]]] = []
        with self._op, self._lock:
            for h in self._all_handles():
                if h.kind is StateKind.LIST:
                    copies.append((h, {k: list(v) for k, v in h.store.items()}))
                elif h.kind is StateKind.MAP:
                    copies.append((h, {k: dict(v) for k, v in h.store.items()}))
                else:
                    copies.append((h, dict(h.store)))
            meta = dict(self._meta)
            manifest = self._manifest()
        max_parallelism = self.max_parallelism

        def write() -> None:
            for h, table in copies:
                write_kvs(target / HASHMAP_STATE_FILE.format(name=h.name), _records(h.kind, table, max_parallelism))
            write_kvs(target / HASHMAP_META_FILE, sorted(meta.items()))

        raw = meta.get(COMMITTED_EPOCH)
        # The epoch of the copy itself (taken under the same lock): commits may follow at once.
        epoch = int(raw) if raw and raw.isdigit() else None
        return LocalSnapshot(target, manifest, _pending=write, committed_epoch=epoch)

    @classmethod
    def restore(
        cls,
        subtask: SubtaskId,
        key_groups: KeyGroupRange,
        max_parallelism: int,
        states: Sequence[StateDescriptor],
        *,
        snapshot_dirs: Sequence[Path],
        local_dir: Path | None = None,
        limits: StateLimits,
        clock: Clock,
        resources: Any = None,
    ) -> HashMapKeyedStateBackend:
        """Load the entries of ``key_groups`` from local snapshots of either backend."""
        plan = plan_restore(snapshot_dirs, key_groups, max_parallelism, states)
        backend = cls(
            subtask,
            key_groups,
            max_parallelism,
            states,
            limits=limits,
            clock=clock,
            local_dir=local_dir,
            carried=plan.carried,
        )
        metas = []
        for part in plan.parts:
            with part.open() as reader:
                metas.append(reader.meta())
                if len(part.overlap):
                    backend._load(reader, part.overlap, {d.name for d in part.manifest.states})
        backend._meta.update(merge_meta(metas))
        logger.info(
            "restored HashMap state of %s key groups %s from %d snapshot(s)", subtask, key_groups, len(plan.parts)
        )
        return backend

    def _load(self, reader: SnapshotReader, overlap: KeyGroupRange, names: set[str]) -> None:
        decode = layout.decode_key
        with self._lock:
            for h in self._all_handles():
                if h.name not in names:
                    continue
                tbl = h.store
                for stored_key, value in reader.entries(h.name, overlap):
                    d = decode(stored_key)
                    k = (d.key, d.namespace)
                    if h.kind is StateKind.LIST:
                        # Entries arrive in key order, which is sequence order within a list.
                        tbl.setdefault(k, []).append(value)
                    elif h.kind is StateKind.MAP:
                        tbl.setdefault(k, {})[d.suffix] = value
                    else:
                        tbl[k] = value

    def _close(self) -> None:
        with self._lock:
            for h in self._all_handles():
                h.store = {}
            self._meta = {}
        logger.info("closed HashMap state of %s", self.subtask)


def _records(kind: StateKind, table: dict[tuple[bytes, bytes], Any], max_parallelism: int) -> list[tuple[bytes, bytes]]:
    """The stored RocksDB keys and values of one table, sorted (a list element's key is its index)."""
    records: list[tuple[bytes, bytes]] = []
    key_prefix = layout.key_prefix
    seq_bytes = layout.SEQ_BYTES
    for (key, ns), entry in table.items():
        prefix = key_prefix(key_group(key, max_parallelism), key, ns)
        if kind is StateKind.LIST:
            records.extend((prefix + i.to_bytes(seq_bytes, "big"), v) for i, v in enumerate(entry))
        elif kind is StateKind.MAP:
            records.extend((prefix + uk, v) for uk, v in entry.items())
        else:
            records.append((prefix, entry))
    records.sort()
    return records
