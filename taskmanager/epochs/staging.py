"""The staging database of one slot: an embedded RocksDB (raw mode) holding uncommitted writes.

Staged writes live on disk, not on the heap, so a partition of any size can be staged whatever
the slot's backend (HashMap slots stage in RocksDB too). Staging is not part of checkpoints and
does not survive the slot: it is created empty and deleted when the slot goes away, so the WAL
is off (a crashed TaskManager loses its slots, and with them every open epoch, anyway).

The store does no locking of its own; :class:`~.manager.EpochManager` serializes writers and
keeps commits apart from staging calls.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import cast

import rocksdict

from keyedstate.common.errors import Reason, StorageError, UnavailableError

logger = logging.getLogger(__name__)

STAGING_DIR = "staging"
"""Name of the staging database's directory inside a slot's instance directory."""

SCAN_CHUNK = 1024
"""Entries per chunk of a staging scan."""

COMMIT_CHUNK = 16_384
"""Entries per chunk when a commit reads a winner's staged records (the commit holds them all anyway)."""


@dataclass(frozen=True)
class StagingOptions:
    """Memory of one staging database: its memtables are flushed to disk beyond these."""

    write_buffer_bytes: int = 16 << 20
    write_buffer_count: int = 2
    background_jobs: int = 1
    bloom_bits_per_key: int = 10

    def to_rocksdict(self) -> rocksdict.Options:
        # raw_mode on every open, or rocksdict rewrites the saved config (see the field notes).
        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.set_write_buffer_size(self.write_buffer_bytes)
        opts.set_max_write_buffer_number(self.write_buffer_count)
        opts.set_max_background_jobs(self.background_jobs)
        opts.set_keep_log_file_num(1)
        table = rocksdict.BlockBasedOptions()
        table.set_bloom_filter(self.bloom_bits_per_key, False)
        opts.set_block_based_table_factory(table)
        return opts


class StagingStore:
    """One slot's staging RocksDB at ``path``; whatever was there before is discarded on open."""

    def __init__(self, path: Path, what: str, options: StagingOptions | None = None) -> None:
        self.path = Path(path)
        self._what = what
        shutil.rmtree(self.path, ignore_errors=True)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db: rocksdict.Rdict | None = rocksdict.Rdict(
                str(self.path), (options or StagingOptions()).to_rocksdict()
            )
        except Exception as exc:
            raise StorageError(
                f"cannot open the epoch staging database of {what} at {self.path}: {exc}; "
                "check that state.backend.rocksdb.localdir is writable and has free space"
            ) from exc
        self._wopts = rocksdict.WriteOptions()
        self._wopts.disable_wal = True  # type: ignore[method-assign,assignment]  # a property; the stub says method
        logger.info("opened epoch staging database of %s at %s", what, self.path)

    def _require(self) -> rocksdict.Rdict:
        if self._db is None:
            raise UnavailableError(
                f"the epoch staging of {self._what} is closed (slot released or shutting down); retry against the new owner",
                reason=Reason.SHUTTING_DOWN,
            )
        return self._db

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        """Multi-get."""
        if not keys:
            return []
        return cast("list[bytes | None]", self._require().get(keys))  # type: ignore[arg-type]  # the stub lacks list[bytes] keys

    def write(self, batch: rocksdict.WriteBatch) -> None:
        """Apply a batch atomically."""
        db = self._require()
        if not len(batch):
            return
        try:
            db.write(batch, self._wopts)
        except Exception as exc:
            raise StorageError(
                f"writing to the epoch staging of {self._what} failed: {exc}; check the disk of {self.path}"
            ) from exc

    def delete_range(self, begin: bytes, end: bytes) -> None:
        """Drop every staged entry in ``[begin, end)`` atomically."""
        batch = rocksdict.WriteBatch(raw_mode=True)
        batch.delete_range(begin, end)
        self.write(batch)

    def read_chunk(self, begin: bytes, end: bytes | None, n: int = SCAN_CHUNK) -> list[tuple[bytes, bytes]]:
        """Up to ``n`` entries of ``[begin, end)``; no iterator outlives the call (it would pin the DB)."""
        ro = rocksdict.ReadOptions()
        if end is not None:
            ro.set_iterate_upper_bound(end)
        it = self._require().items(from_key=begin, read_opt=ro)
        try:
            return list(islice(cast("Iterator[tuple[bytes, bytes]]", it), n))  # raw mode: keys and values are bytes
        finally:
            del it

    def scan(self, begin: bytes, end: bytes | None) -> Iterator[tuple[bytes, bytes]]:
        """Every entry of ``[begin, end)`` in key order, read in chunks."""
        start = begin
        while True:
            chunk = self.read_chunk(start, end)
            yield from chunk
            if len(chunk) < SCAN_CHUNK:
                return
            start = chunk[-1][0] + b"\x00"

    def read_range(self, begin: bytes, end: bytes, chunk: int = COMMIT_CHUNK) -> list[tuple[bytes, bytes]]:
        """Every entry of ``[begin, end)`` in key order, as one list (what a commit applies), read in chunks."""
        out: list[tuple[bytes, bytes]] = []
        start = begin
        while True:
            part = self.read_chunk(start, end, chunk)
            out += part
            if len(part) < chunk:
                return out
            start = part[-1][0] + b"\x00"

    def is_empty(self) -> bool:
        """Whether nothing is staged (the store can be dropped)."""
        return not self.read_chunk(b"", None, 1)

    def close(self, drop: bool = True) -> None:
        """Close, and delete the files unless ``drop`` is False. Idempotent."""
        db, self._db = self._db, None
        if db is not None:
            try:
                db.close()
            except Exception:
                logger.exception("closing the epoch staging database of %s failed", self._what)
        if drop:
            shutil.rmtree(self.path, ignore_errors=True)
