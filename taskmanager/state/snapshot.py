"""Local snapshots of a slot: the manifest, the HashMap file format, and readers for restore.

A local snapshot is a directory that the checkpoint layer uploads as it is:

* RocksDB: a RocksDB checkpoint (hard-linked SST files plus MANIFEST, OPTIONS, ...).
* HashMap: one ``state-<name>.kvs`` file per state and ``meta.kvs``; each holds the stored
  keys and values (see :mod:`.layout` and :mod:`.values`) sorted by key, so the bytes are
  the same a RocksDB backend would hold and either backend restores either format.

``_snapshot.json`` (the manifest) is written last. A directory without it is incomplete.

``.kvs`` format (version 1): ``b"KSKV" 0x01`` then records ``u32 len(key) | key | u32 len(value)
| value`` (big-endian), then ``b"KEND" | u64 record count | u32 CRC-32 of all preceding bytes``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import threading
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import rocksdict

from keyedstate.common.descriptors import StateDescriptor
from keyedstate.common.errors import CorruptCheckpointError, IncompatibleCheckpointError, StorageError
from keyedstate.common.ids import KeyGroupRange, SubtaskId
from keyedstate.taskmanager.state import layout
from keyedstate.taskmanager.state.metadata import (
    DEFAULT_CF,
    HASHMAP_META_FILE,
    HASHMAP_STATE_FILE,
    META_CF,
    SNAPSHOT_FORMAT_VERSION,
    SNAPSHOT_MANIFEST,
    descriptor_from_json,
    descriptor_to_json,
)
from keyedstate.taskmanager.state.resources import RocksDBResources

logger = logging.getLogger(__name__)

KVS_MAGIC = b"KSKV\x01"
KVS_FOOTER_MAGIC = b"KEND"
_FOOTER = struct.Struct(">4sQI")
_LEN = struct.Struct(">I")
_SCAN_CHUNK = 4096


# -- manifest ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SnapshotManifest:
    """What a local snapshot holds; written as ``_snapshot.json``."""

    backend: str
    subtask: SubtaskId
    key_groups: KeyGroupRange
    max_parallelism: int
    states: tuple[StateDescriptor, ...]
    created_ms: int
    layout_version: int = layout.LAYOUT_VERSION
    format_version: int = SNAPSHOT_FORMAT_VERSION

    def to_json(self) -> bytes:
        """The manifest as JSON bytes (the ``_snapshot.json`` a restore validates the snapshot against)."""
        return json.dumps(
            {
                "format_version": self.format_version,
                "layout_version": self.layout_version,
                "backend": self.backend,
                "subtask": {
                    "job_id": self.subtask.job_id,
                    "operator_id": self.subtask.operator_id,
                    "subtask_index": self.subtask.subtask_index,
                },
                "key_groups": [self.key_groups.start, self.key_groups.end],
                "max_parallelism": self.max_parallelism,
                "states": [descriptor_to_json(d) for d in self.states],
                "created_ms": self.created_ms,
            },
            indent=1,
            sort_keys=True,
        ).encode()

    @classmethod
    def read(cls, directory: Path) -> SnapshotManifest:
        """Read the manifest of a local snapshot directory.

        Raises CorruptCheckpointError when the directory or manifest is missing (an unfinished snapshot or download) or
        malformed, IncompatibleCheckpointError when a newer TaskManager wrote it, and StorageError when it cannot be
        read.
        """
        path = Path(directory) / SNAPSHOT_MANIFEST
        if not Path(directory).is_dir():
            raise CorruptCheckpointError(f"local snapshot directory {directory} does not exist")
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"local snapshot {directory} has no {SNAPSHOT_MANIFEST}: it is incomplete (the snapshot did not finish "
                "or the download was cut short); restore from another checkpoint"
            ) from None
        except OSError as exc:
            raise StorageError(f"cannot read {path}: {exc.strerror or exc}") from exc
        try:
            data = json.loads(raw)
            version = int(data["format_version"])
            if version > SNAPSHOT_FORMAT_VERSION or int(data["layout_version"]) > layout.LAYOUT_VERSION:
                raise IncompatibleCheckpointError(
                    f"local snapshot {directory} has format {version} / layout {data['layout_version']}, newer than this "
                    f"TaskManager understands ({SNAPSHOT_FORMAT_VERSION} / {layout.LAYOUT_VERSION}); upgrade the TaskManager"
                )
            sub = data["subtask"]
            return cls(
                backend=str(data["backend"]),
                subtask=SubtaskId(sub["job_id"], sub["operator_id"], int(sub["subtask_index"])),
                key_groups=KeyGroupRange(int(data["key_groups"][0]), int(data["key_groups"][1])),
                max_parallelism=int(data["max_parallelism"]),
                states=tuple(descriptor_from_json(d) for d in data["states"]),
                created_ms=int(data["created_ms"]),
                layout_version=int(data["layout_version"]),
                format_version=version,
            )
        except IncompatibleCheckpointError:
            raise
        except Exception as exc:  # any malformed field means the same thing to the operator
            raise CorruptCheckpointError(f"{path} is not a valid snapshot manifest: {exc!r}") from exc

    def write(self, directory: Path) -> Path:
        """Write the manifest into ``directory`` atomically (temporary file, then rename); returns its path."""
        path = Path(directory) / SNAPSHOT_MANIFEST
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(self.to_json())
        os.replace(tmp, path)
        return path


# -- local snapshot ---------------------------------------------------------------------------


@dataclass
class LocalSnapshot:
    """A slot's state at one instant, in a local directory.

    ``backend.snapshot()`` returns after the synchronous part; :meth:`materialize` finishes
    writing the files (HashMap writes its copy here, so serving continues meanwhile) and returns
    every file of the snapshot, the manifest last. It is safe to call more than once.
    """

    directory: Path
    manifest: SnapshotManifest
    blocked_ms: float | None = None
    """How long writes were blocked to take the snapshot, when the backend measured it (None: the
    whole ``snapshot()`` call blocked them)."""
    committed_epoch: int | None = None
    """The committed epoch the snapshot holds, when the backend read it at the cut (None: unknown)."""
    _pending: Callable[[], None] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _done: bool = field(default=False, repr=False)

    @property
    def materialized(self) -> bool:
        """True once :meth:`materialize` has written every file and the manifest."""
        return self._done

    def materialize(self) -> list[Path]:
        """Finish writing the snapshot (the asynchronous part) and return its files, the manifest last.

        Thread-safe and idempotent: later calls only list the files. Raises StorageError when the local disk fails
        (space, permissions).
        """
        with self._lock:
            if not self._done:
                try:
                    if self._pending is not None:
                        self._pending()
                    self.manifest.write(self.directory)
                except OSError as exc:
                    raise StorageError(
                        f"writing the local snapshot {self.directory} failed: {exc.strerror or exc}; "
                        "check free space and permissions of state.backend.rocksdb.localdir"
                    ) from exc
                self._pending = None
                self._done = True
            return self.files()

    def files(self) -> list[Path]:
        """Every file of the snapshot; the manifest is last (upload it last)."""
        files = sorted(p for p in self.directory.iterdir() if p.is_file() and p.name != SNAPSHOT_MANIFEST)
        manifest = self.directory / SNAPSHOT_MANIFEST
        if manifest.exists():
            files.append(manifest)
        return files

    def size_bytes(self) -> int:
        """Bytes of the snapshot's files on local disk (complete only after :meth:`materialize`)."""
        return sum(p.stat().st_size for p in self.files())

    def discard(self) -> None:
        """Delete the local directory (after upload, or when the checkpoint is aborted)."""
        shutil.rmtree(self.directory, ignore_errors=True)


# -- .kvs files -------------------------------------------------------------------------------


def write_kvs(path: Path, records: Iterable[tuple[bytes, bytes]]) -> int:
    """Write sorted records to ``path`` (atomically via a temporary name); returns the count."""
    tmp = path.with_name(path.name + ".tmp")
    crc = 0
    count = 0
    pack = _LEN.pack
    with open(tmp, "wb") as f:
        buf = bytearray(KVS_MAGIC)
        for key, value in records:
            buf += pack(len(key))
            buf += key
            buf += pack(len(value))
            buf += value
            count += 1
            if len(buf) >= 1 << 20:
                crc = zlib.crc32(buf, crc)
                f.write(buf)
                buf = bytearray()
        crc = zlib.crc32(buf, crc)
        f.write(buf)
        f.write(_FOOTER.pack(KVS_FOOTER_MAGIC, count, crc))
    os.replace(tmp, path)
    return count


def read_kvs(path: Path) -> Iterator[tuple[bytes, bytes]]:
    """Records of a ``.kvs`` file, after checking its magic, footer and checksum."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise CorruptCheckpointError(f"snapshot file {path} is missing; the snapshot is incomplete") from None
    except OSError as exc:
        raise StorageError(f"cannot read snapshot file {path}: {exc.strerror or exc}") from exc
    if len(data) < len(KVS_MAGIC) + _FOOTER.size or not data.startswith(KVS_MAGIC):
        raise CorruptCheckpointError(f"snapshot file {path} is truncated or not a keyedstate .kvs file")
    body_end = len(data) - _FOOTER.size
    magic, count, crc = _FOOTER.unpack_from(data, body_end)
    if magic != KVS_FOOTER_MAGIC or zlib.crc32(memoryview(data)[:body_end]) != crc:
        raise CorruptCheckpointError(f"snapshot file {path} fails its checksum (truncated or corrupted)")
    pos = len(KVS_MAGIC)
    unpack = _LEN.unpack_from
    seen = 0
    while pos < body_end:
        (klen,) = unpack(data, pos)
        pos += 4
        key = data[pos : pos + klen]
        pos += klen
        (vlen,) = unpack(data, pos)
        pos += 4
        value = data[pos : pos + vlen]
        pos += vlen
        seen += 1
        yield key, value
    if pos != body_end or seen != count:
        raise CorruptCheckpointError(f"snapshot file {path} holds {seen} records but its footer says {count}")


# -- readers (restore) ------------------------------------------------------------------------


class SnapshotReader(ABC):
    """Reads the entries of one local snapshot, whatever backend wrote it."""

    def __init__(self, directory: Path, manifest: SnapshotManifest) -> None:
        self.directory = directory
        self.manifest = manifest

    @abstractmethod
    def entries(self, state: str, key_groups: KeyGroupRange) -> Iterator[tuple[bytes, bytes]]:
        """Stored (key, value) pairs of ``state`` within ``key_groups``, sorted by key."""

    @abstractmethod
    def meta(self) -> dict[bytes, bytes]:
        """Every entry of the metadata table."""

    def close(self) -> None:
        """Release what the reader holds (nothing, unless a subclass opened something)."""
        return None

    def __enter__(self) -> SnapshotReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HashMapSnapshotReader(SnapshotReader):
    def entries(self, state: str, key_groups: KeyGroupRange) -> Iterator[tuple[bytes, bytes]]:
        begin, end = layout.key_group_bounds(key_groups)
        path = self.directory / HASHMAP_STATE_FILE.format(name=state)
        for key, value in read_kvs(path):
            if begin <= key < end:
                yield key, value

    def meta(self) -> dict[bytes, bytes]:
        return dict(read_kvs(self.directory / HASHMAP_META_FILE))


class RocksDBSnapshotReader(SnapshotReader):
    """Opens a RocksDB checkpoint read-only (the files are never modified)."""

    def __init__(self, directory: Path, manifest: SnapshotManifest) -> None:
        super().__init__(directory, manifest)
        opts = RocksDBResources.plain_options()
        try:
            names = rocksdict.Rdict.list_cf(str(directory), opts)
            self._db: rocksdict.Rdict | None = rocksdict.Rdict(
                str(directory),
                RocksDBResources.plain_options(),
                column_families={n: RocksDBResources.plain_options() for n in names if n != DEFAULT_CF},
                access_type=rocksdict.AccessType.read_only(False),
            )
        except Exception as exc:  # rocksdict raises plain Exception for corruption and I/O errors
            raise CorruptCheckpointError(f"cannot open the RocksDB snapshot {directory}: {exc}") from exc
        self._names = set(names)

    def _scan(self, cf_name: str, begin: bytes, end: bytes | None) -> Iterator[tuple[bytes, bytes]]:
        if cf_name not in self._names or self._db is None:
            return
        start = begin
        while True:
            # Read in chunks and drop the iterator between them: a live iterator would keep the
            # DB (and its files) open after close().
            cf = self._db.get_column_family(cf_name)
            ro = rocksdict.ReadOptions()
            if end is not None:
                ro.set_iterate_upper_bound(end)
            chunk: list[tuple[bytes, bytes]] = []
            # Raw mode: keys and values are bytes (the stub's item type covers every rocksdict mode).
            for item in cast("Iterator[tuple[bytes, bytes]]", cf.items(from_key=start, read_opt=ro)):
                chunk.append(item)
                if len(chunk) >= _SCAN_CHUNK:
                    break
            del cf, ro
            yield from chunk
            if len(chunk) < _SCAN_CHUNK:
                return
            start = chunk[-1][0] + b"\x00"

    def entries(self, state: str, key_groups: KeyGroupRange) -> Iterator[tuple[bytes, bytes]]:
        begin, end = layout.key_group_bounds(key_groups)
        return self._scan(state, begin, end)

    def meta(self) -> dict[bytes, bytes]:
        return dict(self._scan(META_CF, b"", None))

    def close(self) -> None:
        """Close the RocksDB instance opened on the snapshot; safe to call twice."""
        if self._db is not None:
            self._db.close()
            self._db = None


def open_snapshot(directory: Path) -> SnapshotReader:
    """A reader for the local snapshot in ``directory`` (manifest checked first)."""
    directory = Path(directory)
    manifest = SnapshotManifest.read(directory)
    if manifest.backend == "rocksdb":
        return RocksDBSnapshotReader(directory, manifest)
    if manifest.backend == "hashmap":
        return HashMapSnapshotReader(directory, manifest)
    raise IncompatibleCheckpointError(f"local snapshot {directory} was written by unknown backend {manifest.backend!r}")
