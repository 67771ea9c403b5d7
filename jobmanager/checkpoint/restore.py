"""Reading a checkpoint back: load ``_metadata``, check its files, and plan which subtask restores what.

Rescaling follows Flink: each subtask of the new job receives every old subtask snapshot whose
key-group range overlaps its own, and keeps only the key groups it now owns while restoring.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from keyedstate.common.descriptors import OperatorSpec, StateDescriptor
from keyedstate.common.errors import CorruptCheckpointError, IncompatibleCheckpointError
from keyedstate.common.handles import SubtaskStateHandle
from keyedstate.common.ids import JobId, OperatorId, SubtaskId
from keyedstate.common.keygroups import key_group_range_for_subtask
from keyedstate.common.storage import CheckpointStorage
from keyedstate.jobmanager.checkpoint import _paths
from keyedstate.jobmanager.checkpoint.completed import CompletedCheckpoint
from keyedstate.jobmanager.checkpoint.failure import CheckpointNotFoundError
from keyedstate.jobmanager.checkpoint.metadata import CheckpointMetadata

logger = logging.getLogger(__name__)


def checkpoint_dir_of(path: str) -> str:
    """The directory holding ``_metadata`` for ``path`` (a checkpoint dir or the file itself)."""
    path = _paths.normalize(path)
    return _paths.parent(path) if _paths.name(path) == _paths.METADATA_FILE else path


def load_checkpoint(storage: CheckpointStorage, path: str) -> CheckpointMetadata:
    """Read and validate the ``_metadata`` of a ``chk-<n>`` dir, a savepoint dir, or the file itself."""
    directory = checkpoint_dir_of(path)
    metadata_path = _paths.join(directory, _paths.METADATA_FILE)
    try:
        data = storage.read_bytes(metadata_path)
    except FileNotFoundError:
        if storage.exists(directory):
            raise CheckpointNotFoundError(
                f"{directory} has no {_paths.METADATA_FILE}: it is not a completed checkpoint or savepoint "
                "(an aborted or unfinished one?); pass a chk-<n> or savepoint directory that contains _metadata"
            ) from None
        raise CheckpointNotFoundError(
            f"no checkpoint or savepoint at {path}: nothing exists there; check the path "
            "(statectl checkpoint list shows the job's checkpoints)"
        ) from None
    return CheckpointMetadata.from_json(data, source=metadata_path)


def load_completed_checkpoint(storage: CheckpointStorage, path: str) -> CompletedCheckpoint:
    """:func:`load_checkpoint`, paired with the directory it was read from."""
    return CompletedCheckpoint(load_checkpoint(storage, path), checkpoint_dir_of(path))


def find_latest_checkpoint(storage: CheckpointStorage, job_dir: str) -> CompletedCheckpoint | None:
    """The newest ``chk-<n>`` under ``job_dir`` with a readable ``_metadata`` (None if there is none).

    Directories without ``_metadata`` are skipped (never completed); an unreadable one is
    skipped with a warning so that recovery falls back to the previous checkpoint.
    """
    candidates = []
    for info in storage.list(job_dir):
        cid = _paths.parse_checkpoint_dir_name(_paths.name(info.path))
        if info.is_dir and cid is not None:
            candidates.append((cid, info.path))
    for cid, path in sorted(candidates, reverse=True):
        try:
            return load_completed_checkpoint(storage, path)
        except CheckpointNotFoundError:
            continue
        except CorruptCheckpointError as exc:
            logger.warning("skipping checkpoint %d: %s", cid, exc.message)
    return None


def verify_files_exist(storage: CheckpointStorage, metadata: CheckpointMetadata, base: str) -> None:
    """Raise CorruptCheckpointError naming the first file that is missing or has the wrong size.

    ``base`` is the directory holding ``_metadata``. The checkpoint's directories are listed
    once rather than probing file by file (object stores list far faster than they stat).
    """
    base = _paths.normalize(base)
    roots = {base}
    for _, _, f in metadata.files():
        if f.path.startswith("../"):
            roots.add(_paths.join(base, *f.path.split("/")[:2]))
    listing: dict[str, int] = {}
    for root in sorted(roots):
        for info in storage.list(root, recursive=True):
            if not info.is_dir:
                listing[_paths.normalize(info.path)] = info.size
    for operator_id, subtask_index, f in metadata.files():
        path = _paths.join(base, f.path)
        size = listing.get(path)
        if size is None:
            try:
                size = storage.size(path)
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    f"checkpoint {metadata.checkpoint_id} at {base} is missing {path} (operator {operator_id!r} "
                    f"subtask {subtask_index}); it cannot be restored: use an older checkpoint or a savepoint"
                ) from None
        if size != f.size:
            raise CorruptCheckpointError(
                f"checkpoint {metadata.checkpoint_id} at {base}: {path} has {size} bytes but _metadata records "
                f"{f.size} (operator {operator_id!r} subtask {subtask_index}); the file was changed or truncated"
            )


def verify_checksums(storage: CheckpointStorage, metadata: CheckpointMetadata, base: str, threads: int = 4) -> None:
    """Read every file of the checkpoint and check its SHA-256 where ``_metadata`` records one.

    Raises CorruptCheckpointError naming a file whose content changed (same size, other bytes:
    :func:`verify_files_exist` cannot see it). Each file is downloaded to a temporary file and
    hashed from there, so memory stays flat whatever the file sizes; ``threads`` files at a time.
    """
    base = _paths.normalize(base)
    wanted: dict[str, tuple[str, int, str]] = {}
    for operator_id, subtask_index, f in metadata.files():
        if f.sha256:
            wanted.setdefault(_paths.join(base, f.path), (operator_id, subtask_index, f.sha256.lower()))
    if not wanted:
        return

    def digest(path: str, scratch: str) -> str:
        local = os.path.join(scratch, hashlib.sha256(path.encode()).hexdigest())
        try:
            storage.get_file(path, local)
        except FileNotFoundError:
            operator_id, subtask_index, _ = wanted[path]
            raise CorruptCheckpointError(
                f"checkpoint {metadata.checkpoint_id} at {base} is missing {path} (operator {operator_id!r} subtask "
                f"{subtask_index}); it cannot be restored: use an older checkpoint or a savepoint"
            ) from None
        try:
            h = hashlib.sha256()
            with open(local, "rb") as fh:
                while chunk := fh.read(1 << 20):
                    h.update(chunk)
            return h.hexdigest()
        finally:
            os.remove(local)

    with (
        tempfile.TemporaryDirectory(prefix="keyedstate-verify-") as scratch,
        ThreadPoolExecutor(max_workers=max(1, min(threads, len(wanted))), thread_name_prefix="verify") as pool,
    ):
        paths = sorted(wanted)
        for path, actual in zip(paths, pool.map(lambda p: digest(p, scratch), paths)):
            operator_id, subtask_index, expected = wanted[path]
            if actual != expected:
                raise CorruptCheckpointError(
                    f"checkpoint {metadata.checkpoint_id} at {base}: {path} is damaged: its sha256 {actual} does not "
                    f"match the {expected} _metadata records (operator {operator_id!r} subtask {subtask_index}); it "
                    "cannot be restored: use an older checkpoint or a savepoint"
                )


def plan_restore(
    metadata: CheckpointMetadata,
    operators: Sequence[OperatorSpec],
    max_parallelism: int,
    *,
    checkpoint_dir: str,
    job_id: JobId | None = None,
    allow_non_restored_state: bool = False,
) -> dict[SubtaskId, list[SubtaskStateHandle]]:
    """Which snapshots every subtask of the job restores, with absolute file paths.

    Checks compatibility first: the max parallelism must match, every state of the checkpoint
    must still exist with the same kind, and every operator of the checkpoint must exist in the
    job unless ``allow_non_restored_state`` (Flink's ``--allowNonRestoredState``). Operators and
    states new to the job start empty. Subtasks with nothing to restore map to an empty list.
    """
    owner = job_id or JobId(metadata.job_id)
    where = f"checkpoint {metadata.checkpoint_id} ({checkpoint_dir})"
    if metadata.max_parallelism != max_parallelism:
        raise IncompatibleCheckpointError(
            f"{where} has max parallelism {metadata.max_parallelism} but the job has {max_parallelism}: the max "
            f"parallelism (number of key groups) is fixed for a job's life; set pipeline.max-parallelism: "
            f"{metadata.max_parallelism}"
        )
    job_ops = {op.operator_id: op for op in operators}
    dropped = [op.operator_id for op in metadata.operators if op.operator_id not in job_ops]
    if dropped and not allow_non_restored_state:
        raise IncompatibleCheckpointError(
            f"{where} has state for operator(s) {dropped} that the job does not have; add them back, or restore "
            "with allow-non-restored-state (--allowNonRestoredState) to drop their state"
        )
    for operator_id in dropped:
        logger.warning(
            "restore: dropping the state of operator %r from %s (allow-non-restored-state)", operator_id, where
        )
    for old in metadata.operators:
        new = job_ops.get(old.operator_id)
        if new is not None:
            _check_states(where, old.operator_id, old.states, new.states, allow_non_restored_state)
    base = checkpoint_dir_of(checkpoint_dir)
    plan: dict[SubtaskId, list[SubtaskStateHandle]] = {}
    for op in operators:
        snapshot = metadata.operator(op.operator_id)
        if snapshot is None:
            logger.info("restore: operator %r is not in %s; it starts empty", op.operator_id, where)
        for index in range(op.parallelism):
            subtask = SubtaskId(owner, op.operator_id, index)
            plan[subtask] = []
            if snapshot is None:
                continue
            new_range = key_group_range_for_subtask(max_parallelism, op.parallelism, index)
            for snap in snapshot.subtasks:
                if len(snap.key_groups.intersection(new_range)):
                    plan[subtask].append(snap.to_handle(OperatorId(op.operator_id), base))
    return plan


def _check_states(
    where: str,
    operator_id: str,
    old: Sequence[StateDescriptor],
    new: Sequence[StateDescriptor],
    allow_non_restored_state: bool,
) -> None:
    new_by_name = {s.name: s for s in new}
    for state in old:
        current = new_by_name.get(state.name)
        if current is None:
            if not allow_non_restored_state:
                raise IncompatibleCheckpointError(
                    f"{where}: operator {operator_id!r} had state {state.name!r} ({state.kind.value}) which the job no "
                    "longer declares; declare it again, or restore with allow-non-restored-state to drop it"
                )
            continue
        if current.kind is not state.kind:
            raise IncompatibleCheckpointError(
                f"{where}: state {state.name!r} of operator {operator_id!r} was {state.kind.value} state and is now "
                f"declared as {current.kind.value}; a state's kind cannot change (use a new state name)"
            )
        if current.reduce_fields != state.reduce_fields:
            raise IncompatibleCheckpointError(
                f"{where}: reducing state {state.name!r} of operator {operator_id!r} had fields "
                f"{_fields(state)} and is now declared with {_fields(current)}; the stored vectors cannot be "
                "reinterpreted (use a new state name)"
            )
        if (current.ttl is None) != (state.ttl is None):
            was, now = ("with" if state.ttl else "without"), ("with" if current.ttl else "without")
            raise IncompatibleCheckpointError(
                f"{where}: state {state.name!r} of operator {operator_id!r} was checkpointed {was} TTL and is now "
                f"declared {now} TTL; enabling or disabling TTL changes the stored format (use a new state name; "
                "changing the TTL duration is fine)"
            )


def _fields(d: StateDescriptor) -> str:
    return "[" + ", ".join(f"{f.name}:{f.function.value}:{f.type.value}" for f in d.reduce_fields) + "]"
