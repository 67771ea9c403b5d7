"""Writing a savepoint the JobManager restores: subtask snapshots in the HashMap format, ``_metadata`` last.

Each subtask's state becomes a local snapshot directory exactly as a HashMap backend writes one
(``state-<name>.kvs`` per state, ``meta.kvs``, ``_snapshot.json``; see
taskmanager/state/snapshot.py), which both backends restore. The files are uploaded under
``<savepoint>/op-<operator>/subtask-<n>/`` with their sizes and SHA-256 recorded, and then
``_metadata`` is written with one create-only write, as the checkpoint coordinator commits a
checkpoint: a directory without ``_metadata`` is not a savepoint, and an existing savepoint is
never overwritten.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from keyedstate.common.clock import Clock, SystemClock
from keyedstate.common.descriptors import OperatorSpec
from keyedstate.common.errors import AlreadyExistsError, InvalidArgumentError, StorageError
from keyedstate.common.ids import KeyGroupRange, SubtaskId
from keyedstate.common.storage import CheckpointStorage
from keyedstate.jobmanager.checkpoint import CheckpointMetadata
from keyedstate.jobmanager.checkpoint.metadata import FileRef, OperatorSnapshot, SubtaskSnapshot
from keyedstate.jobmanager.lineage import EMPTY_LINEAGE, EpochLineage
from keyedstate.taskmanager.state.metadata import HASHMAP_META_FILE, HASHMAP_STATE_FILE, INTERNAL_META_PREFIX
from keyedstate.taskmanager.state.snapshot import SnapshotManifest, write_kvs

logger = logging.getLogger(__name__)

METADATA_FILE = "_metadata"


@dataclass(frozen=True)
class SubtaskContent:
    """What one subtask of the savepoint holds: its key groups, and per state its sorted stored entries."""

    subtask_index: int
    key_groups: KeyGroupRange
    records: Mapping[str, Sequence[tuple[bytes, bytes]]]
    """State name -> (stored key, stored value), sorted by stored key (taskmanager/state/layout.py)."""
    meta: Mapping[bytes, bytes] = field(default_factory=dict)
    """Slot metadata to restore (the committed epoch); backend-internal keys are left out."""
    committed_epoch: int = -1


@dataclass(frozen=True)
class OperatorContent:
    """One operator of the savepoint: its spec (id, parallelism, states) and one content per subtask."""

    spec: OperatorSpec
    subtasks: tuple[SubtaskContent, ...]


@dataclass(frozen=True)
class SavepointHeader:
    """The job-wide fields of ``_metadata``."""

    job_id: str
    max_parallelism: int
    checkpoint_id: int = 1
    epoch: int = -1
    """The job epoch the state holds (-1: no Spark epoch was committed into it)."""
    lineage: EpochLineage = EMPTY_LINEAGE


def check_target(storage: CheckpointStorage, directory: str) -> None:
    """Refuse a target that already holds a savepoint or any file (nothing is ever overwritten)."""
    if storage.exists(storage.join(directory, METADATA_FILE)):
        raise AlreadyExistsError(
            f"{directory} already holds a savepoint (it has a _metadata); write to a new directory"
        )
    if storage.exists(directory) and any(True for _ in storage.list(directory, recursive=True)):
        raise AlreadyExistsError(f"{directory} is not empty; write the savepoint to a new directory")


def write_savepoint(
    storage: CheckpointStorage,
    directory: str,
    header: SavepointHeader,
    operators: Sequence[OperatorContent],
    clock: Clock | None = None,
) -> CheckpointMetadata:
    """Write every subtask's snapshot, then ``_metadata`` (create-only); returns the metadata written."""
    clock = clock or SystemClock()
    directory = directory.rstrip("/")
    check_target(storage, directory)
    snapshots: list[OperatorSnapshot] = []
    try:
        with tempfile.TemporaryDirectory(prefix="keyedstate-spa-write-") as scratch:
            for op in operators:
                subtasks = tuple(
                    _write_subtask(storage, directory, header, op.spec, sub, Path(scratch), clock.now_ms())
                    for sub in op.subtasks
                )
                snapshots.append(OperatorSnapshot(op.spec.operator_id, op.spec.parallelism, op.spec.states, subtasks))
    except BaseException:
        # No _metadata was written, so this is no savepoint: remove its files (the target was empty).
        _remove_quietly(storage, directory)
        raise
    metadata = CheckpointMetadata(
        job_id=header.job_id,
        checkpoint_id=header.checkpoint_id,
        savepoint=True,
        timestamp_ms=clock.now_ms(),
        epoch=header.epoch,
        max_parallelism=header.max_parallelism,
        operators=tuple(snapshots),
        lineage=header.lineage,
    )
    problems = metadata.problems()
    if problems:
        _remove_quietly(storage, directory)
        raise InvalidArgumentError(f"the savepoint for {directory} would not restore: {'; '.join(problems[:3])}")
    target = storage.join(directory, METADATA_FILE)
    try:
        storage.create_exclusive(target, metadata.to_bytes())
    except FileExistsError:
        raise AlreadyExistsError(
            f"{target} appeared while the savepoint was written (another writer?); this savepoint was not committed"
        ) from None
    logger.info("wrote savepoint %s: %d operator(s), %d bytes", directory, len(operators), metadata.full_size)
    return metadata


def _write_subtask(
    storage: CheckpointStorage,
    directory: str,
    header: SavepointHeader,
    spec: OperatorSpec,
    sub: SubtaskContent,
    scratch: Path,
    now_ms: int,
) -> SubtaskSnapshot:
    local = scratch / f"op-{spec.operator_id}" / f"subtask-{sub.subtask_index}"
    local.mkdir(parents=True)
    for d in spec.states:
        write_kvs(local / HASHMAP_STATE_FILE.format(name=d.name), sub.records.get(d.name, ()))
    meta = sorted((k, v) for k, v in sub.meta.items() if not k.startswith(INTERNAL_META_PREFIX))
    write_kvs(local / HASHMAP_META_FILE, meta)
    manifest = SnapshotManifest(
        backend="hashmap",
        subtask=SubtaskId(header.job_id, spec.operator_id, sub.subtask_index),
        key_groups=sub.key_groups,
        max_parallelism=header.max_parallelism,
        states=spec.states,
        created_ms=now_ms,
    )
    manifest_path = manifest.write(local)
    files = sorted(p for p in local.iterdir() if p != manifest_path) + [manifest_path]  # the manifest last
    refs = []
    for path in files:
        relative = f"op-{spec.operator_id}/subtask-{sub.subtask_index}/{path.name}"
        size, digest = _sha256(path)
        try:
            storage.put_file(str(path), storage.join(directory, relative))
        except StorageError as exc:
            raise StorageError(f"writing the savepoint {directory} failed at {relative}: {exc.message}") from exc
        refs.append(FileRef(relative, size, digest, path.name, False))
    total = sum(r.size for r in refs)
    return SubtaskSnapshot(
        subtask_index=sub.subtask_index,
        key_groups=sub.key_groups,
        backend="hashmap",
        committed_epoch=sub.committed_epoch,
        full_size=total,
        incremental_size=total,
        files=tuple(refs),
    )


def _remove_quietly(storage: CheckpointStorage, directory: str) -> None:
    try:
        storage.delete_dir(directory)
    except Exception as exc:  # the original error matters more; this one is only logged
        logger.warning("could not remove the unfinished savepoint %s: %s", directory, exc)


def _sha256(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()
