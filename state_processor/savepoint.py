"""A checkpoint or savepoint opened offline: its ``_metadata``, and the stored entries of its states.

No cluster is involved: ``_metadata`` is read with the JobManager's reader (so a damaged one is
refused with the same message a restore would give), each subtask's files are downloaded into a
scratch directory once, verified against the size and SHA-256 ``_metadata`` records, and opened
with the TaskManager's snapshot readers (RocksDB checkpoints read-only, HashMap ``.kvs`` files),
so either backend's snapshots read the same. Incremental checkpoints need nothing special: their
``../shared/`` files are listed in ``_metadata`` like the others.

A changelog checkpoint (``state.changelog.enabled``) holds each subtask's materialized snapshot
plus the changelog segments committed after it. Its subtasks are rebuilt exactly as a restore
rebuilds a slot: the snapshot restored into a scratch backend, the verified segments replayed
on top by the TaskManager's own replay (:func:`replay_changelog`, the restore path's), and the
result snapshotted locally, so the readers see the checkpoint's epoch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keyedstate.common.clock import SystemClock
from keyedstate.common.config import Configuration
from keyedstate.common.descriptors import StateDescriptor
from keyedstate.common.errors import (
    CorruptCheckpointError,
    InvalidArgumentError,
    KeyedStateError,
    StorageError,
)
from keyedstate.common.handles import SubtaskStateHandle
from keyedstate.common.ids import KeyGroupRange, OperatorId, SubtaskId
from keyedstate.common.storage import CheckpointStorage, open_storage
from keyedstate.jobmanager.checkpoint import CheckpointMetadata
from keyedstate.jobmanager.checkpoint.metadata import OperatorSnapshot, SubtaskSnapshot
from keyedstate.jobmanager.checkpoint.restore import checkpoint_dir_of, load_checkpoint
from keyedstate.taskmanager.snapshot.changelog import replay_changelog
from keyedstate.taskmanager.state import layout
from keyedstate.taskmanager.state.factory import restore_backend
from keyedstate.taskmanager.state.limits import StateLimits
from keyedstate.taskmanager.state.snapshot import SnapshotReader, open_snapshot

logger = logging.getLogger(__name__)

_COMMITTED = StateLimits(
    max_key_bytes=1 << 62, max_value_bytes=1 << 62, max_list_response_bytes=1 << 62, max_list_elements=1 << 62
)
"""The limits of a replay: the job already accepted every change set a checkpoint holds, under its own limits."""


@dataclass(frozen=True)
class RawEntry:
    """One stored entry of a state, split into its parts (the value still carries its TTL header)."""

    key_group: int
    key: bytes
    namespace: bytes
    suffix: bytes
    """The user key (map state), an 8-byte sequence number (list state) or empty."""
    stored_value: bytes
    """The value as stored: a format byte, an optional TTL timestamp, the payload (see taskmanager/state/values.py)."""

    @property
    def size(self) -> int:
        """Bytes the entry occupies as a stored key and value (what inspect counts per key group)."""
        return layout.KEY_GROUP_BYTES + len(self.key) + len(self.namespace) + len(self.suffix) + len(self.stored_value)


def _as_configuration(config: Configuration | Mapping[str, Any] | None) -> Configuration:
    if config is None:
        return Configuration()
    if isinstance(config, Configuration):
        return config
    return Configuration(dict(config))


class Savepoint:
    """A completed checkpoint (``chk-<n>/``) or savepoint, opened for reading.

    ``Savepoint.open(path, config)`` accepts the directory or its ``_metadata`` on any storage
    ``state.checkpoints.dir`` accepts (``file://``, ``s3://`` with the ``s3.*`` keys in
    ``config``, ...). Use it as a context manager (or call :meth:`close`): downloaded snapshots live
    in a scratch directory until then.
    """

    def __init__(self, storage: CheckpointStorage, directory: str, metadata: CheckpointMetadata) -> None:
        self.storage = storage
        self.directory = directory
        self.metadata = metadata
        self._scratch: str | None = None
        self._downloaded: dict[tuple[str, int], Path] = {}
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: str, config: Configuration | Mapping[str, Any] | None = None) -> Savepoint:
        """Read and validate ``_metadata`` at ``path``; errors name the path and what to do."""
        if not path or "://" not in path:
            if path and os.path.isabs(path):
                path = Path(path).as_uri()
            else:
                raise InvalidArgumentError(
                    f"checkpoint path {path!r} must be a URL (file:///..., s3://bucket/...) or an absolute path"
                )
        conf = _as_configuration(config)
        storage = open_storage(path, conf)
        metadata = load_checkpoint(storage, path)
        return cls(storage, checkpoint_dir_of(path), metadata)

    # -- what the checkpoint holds ----------------------------------------------------------------
    @property
    def operators(self) -> tuple[OperatorSnapshot, ...]:
        """Every operator of the checkpoint, with its states and subtask snapshots."""
        return self.metadata.operators

    @property
    def max_parallelism(self) -> int:
        """The number of key groups of the job."""
        return self.metadata.max_parallelism

    def operator(self, operator_id: str) -> OperatorSnapshot:
        """The operator ``operator_id``; InvalidArgumentError naming the ones there are if it is absent."""
        found = self.metadata.operator(operator_id)
        if found is None:
            known = ", ".join(repr(op.operator_id) for op in self.operators) or "none"
            raise InvalidArgumentError(f"{self.directory} has no operator {operator_id!r}; its operators are: {known}")
        return found

    def state(self, operator_id: str, state: str) -> StateDescriptor:
        """The descriptor of ``state`` of ``operator_id``; InvalidArgumentError naming the states there are."""
        op = self.operator(operator_id)
        for d in op.states:
            if d.name == state:
                return d
        known = ", ".join(repr(d.name) for d in op.states) or "none"
        raise InvalidArgumentError(
            f"operator {operator_id!r} in {self.directory} has no state {state!r}; it has: {known}"
        )

    # -- entries ---------------------------------------------------------------------------------
    def entries(
        self, operator_id: str, state: str, *, subtask_index: int | None = None, key_groups: KeyGroupRange | None = None
    ) -> Iterator[RawEntry]:
        """Every stored entry of ``state``, in key-group order, optionally of one subtask or key-group range."""
        self.state(operator_id, state)
        op = self.operator(operator_id)
        for sub in sorted(op.subtasks, key=lambda s: s.key_groups.start):
            if subtask_index is not None and sub.subtask_index != subtask_index:
                continue
            wanted = sub.key_groups if key_groups is None else sub.key_groups.intersection(key_groups)
            if not len(wanted):
                continue
            with self._reader(op.operator_id, sub) as reader:
                yield from _split(reader.entries(state, wanted), reader.directory)

    def meta(self, operator_id: str, subtask_index: int) -> dict[bytes, bytes]:
        """The slot metadata of one subtask snapshot (its committed epoch, ...)."""
        op = self.operator(operator_id)
        sub = next((s for s in op.subtasks if s.subtask_index == subtask_index), None)
        if sub is None:
            raise InvalidArgumentError(f"operator {operator_id!r} has no subtask {subtask_index}")
        with self._reader(operator_id, sub) as reader:
            return _guard(reader.meta, reader.directory)

    def _reader(self, operator_id: str, sub: SubtaskSnapshot) -> SnapshotReader:
        return open_snapshot(self._local_copy(operator_id, sub))

    def _local_copy(self, operator_id: str, sub: SubtaskSnapshot) -> Path:
        """The subtask's files in a local directory, downloaded and verified once per Savepoint."""
        with self._lock:
            cached = self._downloaded.get((operator_id, sub.subtask_index))
            if cached is not None:
                return cached
            if self._scratch is None:
                self._scratch = tempfile.mkdtemp(prefix="keyedstate-spa-")
            target = Path(self._scratch) / f"{len(self._downloaded)}"
            target.mkdir()
            # The handle a TaskManager would restore from: every path absolute (``../shared/`` resolved).
            handle = sub.to_handle(OperatorId(operator_id), self.directory)
            for f in handle.files:
                self._download(f.path, target / (f.local_name or Path(f.path).name), f.size, f.sha256)
            if handle.changelog:
                target = self._replayed(operator_id, handle, target)
            self._downloaded[(operator_id, sub.subtask_index)] = target
            return target

    def _replayed(self, operator_id: str, handle: SubtaskStateHandle, materialization: Path) -> Path:
        """A local snapshot of a changelog subtask at the checkpoint's epoch: ``materialization`` plus its segments.

        What a TaskManager's restore does, with the same code: the segments downloaded and verified,
        the snapshot restored into a backend of the subtask's kind and key groups, the change sets
        after its materialized epoch replayed, and the epoch reached checked against ``_metadata``.
        """
        segments: dict[str, bytes] = {}
        segment_dir = materialization.with_name(f"{materialization.name}-changelog")
        segment_dir.mkdir()
        for i, s in enumerate(handle.changelog):
            local = segment_dir / f"{i:06d}.seg"
            self._download(s.path, local, s.size, s.sha256)
            segments[s.path] = local.read_bytes()
        work = materialization.with_name(f"{materialization.name}-replay")
        replayed = materialization.with_name(f"{materialization.name}-epoch-{handle.committed_epoch}")
        subtask = SubtaskId(self.metadata.job_id, operator_id, handle.subtask_index)
        backend = restore_backend(
            handle.backend,
            subtask,
            handle.key_groups,
            self.metadata.max_parallelism,
            self.operator(operator_id).states,
            snapshot_dirs=[materialization],
            local_dir=work,
            limits=_COMMITTED,
            clock=SystemClock(),
        )
        try:
            replay_changelog(backend, [handle], segments)
            backend.snapshot(replayed).materialize()
        finally:
            backend.close()
        for done in (materialization, segment_dir, work):
            shutil.rmtree(done, ignore_errors=True)
        return replayed

    def _download(self, remote: str, local: Path, size: int, sha256: str) -> None:
        try:
            self.storage.get_file(remote, str(local))
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"checkpoint file {remote} is missing (listed in {self.directory}/_metadata); the checkpoint is "
                "incomplete or was deleted: read another checkpoint or savepoint"
            ) from None
        except StorageError as exc:
            raise StorageError(f"cannot read checkpoint file {remote}: {exc.message}") from exc
        actual = local.stat().st_size
        if actual != size:
            raise CorruptCheckpointError(
                f"checkpoint file {remote} has {actual} bytes but {self.directory}/_metadata records {size}: it was "
                "truncated or replaced; read another checkpoint or savepoint"
            )
        if sha256:
            digest = hashlib.sha256()
            with open(local, "rb") as fh:
                while chunk := fh.read(1 << 20):
                    digest.update(chunk)
            if digest.hexdigest() != sha256.lower():
                raise CorruptCheckpointError(
                    f"checkpoint file {remote} is damaged: its sha256 {digest.hexdigest()} does not match the "
                    f"{sha256} {self.directory}/_metadata records; read another checkpoint or savepoint"
                )

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        """Delete the downloaded files; safe to call twice."""
        with self._lock:
            if self._scratch is not None:
                shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
            self._downloaded.clear()

    def __enter__(self) -> Savepoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _split(items: Iterator[tuple[bytes, bytes]], directory: Path) -> Iterator[RawEntry]:
    """Stored (key, value) pairs as RawEntry; a malformed one is a CorruptCheckpointError naming the snapshot."""
    decode = layout.decode_key
    while True:
        try:
            item = next(items, None)
            if item is None:
                return
            d = decode(item[0])
        except CorruptCheckpointError:
            raise
        except KeyedStateError as exc:
            raise CorruptCheckpointError(f"snapshot {directory} holds a malformed entry: {exc.message}") from exc
        yield RawEntry(d.key_group, d.key, d.namespace, d.suffix, item[1])


def _guard(read: Any, directory: Path) -> dict[bytes, bytes]:
    try:
        out: dict[bytes, bytes] = read()
        return out
    except CorruptCheckpointError:
        raise
    except KeyedStateError as exc:
        raise CorruptCheckpointError(f"snapshot {directory}: {exc.message}") from exc
