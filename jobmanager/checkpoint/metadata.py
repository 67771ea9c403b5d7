"""The ``_metadata`` file: the commit record of a completed checkpoint or savepoint.

A checkpoint directory is complete exactly when its ``_metadata`` exists: the JobManager writes
it last, with one create-only write, after every subtask acknowledged. The file is UTF-8 JSON::

    {
      "format": "keyedstate-checkpoint",      # always this string
      "version": 1,                           # bumped on incompatible changes
      "job_id": "orders", "checkpoint_id": 42, "savepoint": false,
      "timestamp_ms": 1718000000000,          # trigger time, wall clock
      "epoch": 17,                            # the job epoch every subtask holds (-1: none)
      "lineage": [{"query_id": "…", "offset": 0, "first_epoch": 0}],  # Spark queries of those epochs
      "max_parallelism": 128,                 # number of key groups; fixed for the job's life
      "operators": [{
        "operator_id": "counts", "parallelism": 2,
        "states": [{"name": "total", "kind": "value", "ttl": null, "reduce_fields": []}],
        "subtasks": [{
          "subtask_index": 0, "key_groups": [0, 63], "backend": "rocksdb",
          "committed_epoch": 17, "full_size": 1048576, "incremental_size": 4096,
          "files": [{"path": "../shared/3f1c…-000012.sst", "size": 1044480, "sha256": "…",
                     "local_name": "000012.sst", "shared": true}, …],
          # version 2, changelog checkpoints only (state.changelog.enabled): ``files`` are the
          # last materialized snapshot, which holds epochs up to materialized_epoch, and the
          # segments hold the change sets of the epochs after it, up to committed_epoch
          "materialized_epoch": 12,
          "changelog": [{"path": "../shared/chk-41/counts-0-…-000003.seg", "first_epoch": 13,
                         "last_epoch": 17, "size": 52011, "sha256": "…"}, …]
        }, …]
      }, …]
    }

Every ``path`` is relative to the directory holding ``_metadata``. A checkpoint
(``<job dir>/chk-<n>/``) keeps its own files inside its directory and refers to incremental
files in ``<job dir>/shared/`` as ``../shared/<name>`` (``shared: true``). A savepoint is
self-contained: all its paths point inside its directory, so it can be moved or copied anywhere
(it never has changelog segments). A checkpoint without segments is written as version 1,
which older releases read; this release reads both versions.

Listing every file with its size needs nothing but ``json``::

    import json
    meta = json.load(open("/checkpoints/orders/chk-42/_metadata", encoding="utf-8"))
    for op in meta["operators"]:
        for sub in op["subtasks"]:
            for f in sub["files"]: print(op["operator_id"], sub["subtask_index"], f["path"], f["size"])
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from keyedstate.common.descriptors import (
    NumberType,
    OperatorSpec,
    ReduceField,
    ReduceFunction,
    StateDescriptor,
    StateKind,
    TtlConfig,
    TtlUpdateType,
)
from keyedstate.common.errors import CorruptCheckpointError, InvalidArgumentError, KeyedStateError
from keyedstate.common.handles import ChangelogSegmentHandle, StateFileHandle, SubtaskStateHandle
from keyedstate.common.ids import KeyGroupRange, OperatorId
from keyedstate.common.keygroups import UPPER_BOUND_MAX_PARALLELISM, key_group_range_for_subtask
from keyedstate.common.storage import MAX_FILE_NAME, is_plain_file_name
from keyedstate.jobmanager.checkpoint import _paths
from keyedstate.jobmanager.lineage import EMPTY_LINEAGE, LEGACY_QUERY, EpochLineage, LineageEntry

logger = logging.getLogger(__name__)

FORMAT = "keyedstate-checkpoint"
VERSION = 2
"""The newest format version; a checkpoint without changelog segments is still written as version 1."""
READABLE_VERSIONS = (1, 2)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class FileRef(NamedTuple):
    """One file of a subtask snapshot; ``path`` is relative to the ``_metadata`` directory.

    A named tuple, not a frozen dataclass: a checkpoint makes one per file of the job, and a
    named tuple is built in 0.84 us against 2.2 us (the dataclass sets each field through
    ``object.__setattr__``). Same fields, defaults, attribute access and equality among FileRefs.
    """

    path: str
    size: int
    sha256: str = ""
    """Hex SHA-256 of the content, empty when the TaskManager did not compute it."""
    local_name: str = ""
    """The file's name inside the snapshot (``000012.sst``), where restore puts it."""
    shared: bool = False
    """Lives in ``../shared/`` and may be referenced by several checkpoints."""


class SegmentRef(NamedTuple):
    """One changelog segment of a subtask snapshot; ``path`` is relative to the ``_metadata`` directory."""

    path: str
    first_epoch: int
    last_epoch: int
    size: int
    sha256: str

    def as_file(self) -> FileRef:
        """The segment as a shared file: reference-counted, kept, verified and collected like a shared SST."""
        return FileRef(self.path, self.size, self.sha256, posixpath.basename(self.path), True)


@dataclass(frozen=True)
class SubtaskSnapshot:
    """What one subtask contributed: its key groups and the files that restore them."""

    subtask_index: int
    key_groups: KeyGroupRange
    """The key groups this snapshot holds (the subtask's range when the checkpoint was taken)."""
    backend: str
    """``rocksdb`` or ``hashmap``: how the files are laid out."""
    committed_epoch: int
    """The last Spark epoch committed into this subtask's state."""
    full_size: int
    """Bytes of every file the snapshot references."""
    incremental_size: int
    """Bytes uploaded for this checkpoint (the rest was reused from ``shared/``)."""
    files: tuple[FileRef, ...] = ()
    changelog: tuple[SegmentRef, ...] = ()
    """Changelog checkpoints: the segments replayed on top of :attr:`files`, oldest first."""
    materialized_epoch: int | None = None
    """The epoch :attr:`files` hold when the snapshot has a changelog; None: :attr:`committed_epoch`."""

    @property
    def snapshot_epoch(self) -> int:
        """The epoch the snapshot files hold (the changelog replays what follows it)."""
        return self.committed_epoch if self.materialized_epoch is None else self.materialized_epoch

    def all_files(self) -> Iterator[FileRef]:
        """The snapshot's files, then its changelog segments (as shared files)."""
        yield from self.files
        for segment in self.changelog:
            yield segment.as_file()

    def changelog_problems(self) -> list[str]:
        """Why the segments cannot rebuild epochs ``snapshot_epoch + 1 .. committed_epoch`` (empty: they can)."""
        out: list[str] = []
        if not self.changelog:
            if self.materialized_epoch is not None and self.materialized_epoch != self.committed_epoch:
                out.append(
                    f"materialized_epoch {self.materialized_epoch} differs from committed_epoch "
                    f"{self.committed_epoch} but there are no changelog segments to replay in between"
                )
            return out
        if self.materialized_epoch is None or self.materialized_epoch > self.committed_epoch:
            out.append(
                f"materialized_epoch {self.materialized_epoch} must be at most committed_epoch {self.committed_epoch}"
            )
            return out
        expected = self.materialized_epoch + 1
        for i, seg in enumerate(self.changelog):
            if seg.first_epoch > seg.last_epoch or seg.size < 0:
                out.append(f"changelog[{i}] has epochs {seg.first_epoch}..{seg.last_epoch} and size {seg.size}")
            elif i == 0 and not seg.first_epoch <= expected <= seg.last_epoch + 1:
                out.append(
                    f"changelog[0] starts at epoch {seg.first_epoch}, after epoch {expected} that the "
                    f"materialized snapshot (epoch {self.materialized_epoch}) needs next: epochs would be lost"
                )
            elif i > 0 and seg.first_epoch != expected:
                out.append(
                    f"changelog[{i}] starts at epoch {seg.first_epoch}, the previous segment ends at {expected - 1}"
                )
            if seg.sha256 and not _SHA256.match(seg.sha256):
                out.append(f"changelog[{i}] sha256 is not 64 lowercase hex digits")
            expected = seg.last_epoch + 1
        if expected - 1 != self.committed_epoch:
            out.append(f"the changelog ends at epoch {expected - 1}, the snapshot is of epoch {self.committed_epoch}")
        return out

    @classmethod
    def from_handle(cls, handle: SubtaskStateHandle) -> SubtaskSnapshot:
        """From an acknowledged handle whose paths are already relative to the checkpoint dir."""
        return cls(
            subtask_index=handle.subtask_index,
            key_groups=KeyGroupRange(handle.key_groups.start, handle.key_groups.end),
            backend=handle.backend,
            committed_epoch=handle.committed_epoch,
            full_size=handle.full_size,
            incremental_size=handle.incremental_size,
            files=tuple(FileRef(f.path, f.size, f.sha256, f.local_name, f.shared) for f in handle.files),
            changelog=tuple(
                SegmentRef(c.path, c.first_epoch, c.last_epoch, c.size, c.sha256) for c in handle.changelog
            ),
            materialized_epoch=handle.materialized_epoch if handle.changelog else None,
        )

    def to_handle(self, operator_id: OperatorId, base: str) -> SubtaskStateHandle:
        """The handle a TaskManager restores from, with every path made absolute against ``base``."""
        return SubtaskStateHandle(
            operator_id=operator_id,
            subtask_index=self.subtask_index,
            key_groups=self.key_groups,
            backend=self.backend,
            files=[
                StateFileHandle(
                    path=_paths.join(base, f.path),
                    size=f.size,
                    sha256=f.sha256,
                    local_name=f.local_name,
                    shared=f.shared,
                )
                for f in self.files
            ],
            incremental_size=self.incremental_size,
            full_size=self.full_size,
            committed_epoch=self.committed_epoch,
            changelog=[
                ChangelogSegmentHandle(_paths.join(base, c.path), c.first_epoch, c.last_epoch, c.size, c.sha256)
                for c in self.changelog
            ],
            materialized_epoch=self.materialized_epoch,
        )


@dataclass(frozen=True)
class OperatorSnapshot:
    """One operator at checkpoint time: its declared states and one snapshot per subtask."""

    operator_id: str
    parallelism: int
    states: tuple[StateDescriptor, ...]
    subtasks: tuple[SubtaskSnapshot, ...]

    @property
    def spec(self) -> OperatorSpec:
        """The operator as it was checkpointed (its parallelism then, and its states), to restore or rescale from."""
        return OperatorSpec(self.operator_id, self.parallelism, self.states)


@dataclass(frozen=True)
class CheckpointMetadata:
    """The parsed ``_metadata`` of one checkpoint or savepoint."""

    job_id: str
    checkpoint_id: int
    savepoint: bool
    timestamp_ms: int
    epoch: int
    max_parallelism: int
    operators: tuple[OperatorSnapshot, ...] = field(default_factory=tuple)
    lineage: EpochLineage = EMPTY_LINEAGE
    """Which Spark query's batches the epochs up to ``epoch`` are (jobmanager.epochs.lineage)."""

    # -- queries -------------------------------------------------------------------------------
    def operator(self, operator_id: str) -> OperatorSnapshot | None:
        """The snapshot of that operator, or None if the checkpoint has none."""
        for op in self.operators:
            if op.operator_id == operator_id:
                return op
        return None

    def files(self) -> Iterator[tuple[str, int, FileRef]]:
        """Every file as ``(operator_id, subtask_index, file)``, changelog segments included (as shared files)."""
        for op in self.operators:
            for sub in op.subtasks:
                for f in sub.all_files():
                    yield op.operator_id, sub.subtask_index, f

    @property
    def has_changelog(self) -> bool:
        """Whether a restore replays changelog segments (a changelog checkpoint that is not self-contained)."""
        return any(sub.changelog for op in self.operators for sub in op.subtasks)

    @property
    def full_size(self) -> int:
        """Bytes of every file the checkpoint references, shared ones included."""
        return sum(s.full_size for op in self.operators for s in op.subtasks)

    @property
    def incremental_size(self) -> int:
        """Bytes this checkpoint uploaded itself (files reused from earlier checkpoints excluded)."""
        return sum(s.incremental_size for op in self.operators for s in op.subtasks)

    def problems(self) -> list[str]:
        """Every consistency problem (empty when the metadata can be restored from).

        :meth:`structure_problems`, then :func:`file_problems` for each file of each subtask.
        """
        return self.structure_problems() + [
            f"operator {op.operator_id!r} subtask {sub.subtask_index}: {problem}"
            for op in self.operators
            for sub in op.subtasks
            for f in sub.all_files()
            for problem in file_problems(f, self.savepoint)
        ]

    def structure_problems(self) -> list[str]:
        """The problems of everything but the files themselves: ids, parallelism, key groups, changelog.

        The coordinator checks each acknowledgement's files as it arrives, so it writes
        ``_metadata`` after this check alone; the per-file pass it skips took 197 ms of a
        checkpoint's ~1 s at 10,000 subtasks, against 22 ms for this one.
        """
        out: list[str] = []
        if self.checkpoint_id < 1:
            out.append(f"checkpoint_id must be at least 1, got {self.checkpoint_id}")
        if not 1 <= self.max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
            out.append(f"max_parallelism {self.max_parallelism} is outside 1..{UPPER_BOUND_MAX_PARALLELISM}")
            return out
        if self.epoch < -1:
            out.append(f"epoch must be -1 or more, got {self.epoch}")
        seen: set[str] = set()
        for op in self.operators:
            where = f"operator {op.operator_id!r}"
            if op.operator_id in seen:
                out.append(f"{where} appears twice")
            seen.add(op.operator_id)
            try:
                _ = op.spec  # validates the id, the parallelism and duplicate state names
            except KeyedStateError as exc:
                out.append(f"{where}: {exc.message}")
                continue
            if op.parallelism > self.max_parallelism:
                out.append(f"{where}: parallelism {op.parallelism} exceeds max_parallelism {self.max_parallelism}")
                continue
            indices = sorted(s.subtask_index for s in op.subtasks)
            if indices != list(range(op.parallelism)):
                out.append(
                    f"{where}: has subtasks {indices} but parallelism {op.parallelism} needs 0..{op.parallelism - 1}"
                )
                continue
            for sub in op.subtasks:
                expected = key_group_range_for_subtask(self.max_parallelism, op.parallelism, sub.subtask_index)
                if sub.key_groups != expected:
                    out.append(
                        f"{where} subtask {sub.subtask_index}: key groups {sub.key_groups} but parallelism "
                        f"{op.parallelism} of max parallelism {self.max_parallelism} gives {expected}"
                    )
                if sub.changelog and self.savepoint:
                    out.append(
                        f"{where} subtask {sub.subtask_index}: a savepoint must be self-contained, but it "
                        "references changelog segments"
                    )
                out += [f"{where} subtask {sub.subtask_index}: {p}" for p in sub.changelog_problems()]
        return out

    # -- serialization -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The ``_metadata`` content as JSON values (:meth:`to_json` writes the same, a part at a time)."""
        return {
            **self._header(),
            "operators": [
                {**_operator_header(op), "subtasks": [_subtask_dict(s) for s in op.subtasks]} for op in self.operators
            ],
        }

    def _header(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            # Version 1 still describes a checkpoint without segments exactly, and older releases read it.
            "version": VERSION if self.has_changelog else 1,
            "job_id": self.job_id,
            "checkpoint_id": self.checkpoint_id,
            "savepoint": self.savepoint,
            "timestamp_ms": self.timestamp_ms,
            "epoch": self.epoch,
            "lineage": self.lineage.to_list(),
            "max_parallelism": self.max_parallelism,
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as compact JSON, encoded one subtask at a time.

        Compact: the C encoder only runs without indentation, and 1,000 subtasks make ~1 MB
        (``jq . _metadata`` pretty-prints it). One subtask at a time: the JSON values of the
        whole job built at once lived long enough to reach the garbage collector's oldest
        generation, and so brought on full collections of the JobManager's heap.
        """
        encode = _ENCODER.encode
        operators = ",".join(
            encode(_operator_header(op))[:-1]
            + ',"subtasks":['
            + ",".join(encode(_subtask_dict(s)) for s in op.subtasks)
            + "]}"
            for op in self.operators
        )
        return encode(self._header())[:-1] + ',"operators":[' + operators + "]}\n"

    def to_bytes(self) -> bytes:
        """The ``_metadata`` file's content: compact UTF-8 JSON (pretty-print it with ``jq .``)."""
        return self.to_json().encode("utf-8")

    @classmethod
    def from_json(cls, data: str | bytes, source: str = "_metadata") -> CheckpointMetadata:
        """Parse and validate; any problem raises CorruptCheckpointError naming ``source``."""
        try:
            text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
            raw = json.loads(text)
        except (ValueError, RecursionError) as exc:
            # ValueError: not UTF-8, not JSON, or an integer of more than 4300 digits (Python's
            # int-conversion limit); RecursionError: arrays or objects nested too deep to parse.
            raise _corrupt(source, f"not valid UTF-8 JSON ({type(exc).__name__}: {str(exc)[:200]})") from exc
        reader = _Reader(source)
        meta = reader.metadata(raw)
        problems = meta.problems()
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise _corrupt(source, "; ".join(problems[:3]) + more)
        return meta


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def _operator_header(op: OperatorSnapshot) -> dict[str, Any]:
    return {
        "operator_id": op.operator_id,
        "parallelism": op.parallelism,
        "states": [descriptor_to_dict(s) for s in op.states],
    }


def _subtask_dict(s: SubtaskSnapshot) -> dict[str, Any]:
    return {
        "subtask_index": s.subtask_index,
        "key_groups": [s.key_groups.start, s.key_groups.end],
        "backend": s.backend,
        "committed_epoch": s.committed_epoch,
        "full_size": s.full_size,
        "incremental_size": s.incremental_size,
        "files": [
            {"path": f.path, "size": f.size, "sha256": f.sha256, "local_name": f.local_name, "shared": f.shared}
            for f in s.files
        ],
        **(
            {
                "materialized_epoch": s.snapshot_epoch,
                "changelog": [
                    {
                        "path": c.path,
                        "first_epoch": c.first_epoch,
                        "last_epoch": c.last_epoch,
                        "size": c.size,
                        "sha256": c.sha256,
                    }
                    for c in s.changelog
                ],
            }
            if s.changelog
            else {}
        ),
    }


def file_problems(f: FileRef, savepoint: bool) -> list[str]:
    """Why a file cannot be part of a checkpoint (``savepoint``: of a savepoint); empty if it can."""
    out: list[str] = []
    problem = file_path_problem(f, savepoint)
    if problem:
        out.append(problem)
    if not is_plain_file_name(f.local_name or posixpath.basename(f.path)):
        # A restore writes the file under this name (or the path's last part) inside its restore directory.
        out.append(f"file {f.path[:100]!r} has local_name {f.local_name[:100]!r}, which is not a plain file name")
    if f.size < 0:
        out.append(f"file {f.path!r} has negative size {f.size}")
    if f.sha256 and not _SHA256.match(f.sha256):
        out.append(f"file {f.path!r} sha256 is not 64 lowercase hex digits")
    return out


def file_path_problem(f: FileRef, savepoint: bool) -> str | None:
    """Why a file's relative path is not allowed, or None."""
    if len(f.path) > 4096 or any(len(part) > MAX_FILE_NAME for part in f.path.split("/")):
        # No file system holds it: reading it would fail as a (retryable) storage error.
        return f"file {f.path[:100]!r}... is longer than a file system allows"
    if savepoint:
        if not _paths.is_inside_relative(f.path):
            return f"file {f.path!r} is not inside the savepoint directory (a savepoint must be self-contained)"
        if f.shared:
            return f"file {f.path!r} is marked shared, but a savepoint owns all its files"
        return None
    if f.shared:
        if _paths.under(f.path, _paths.SHARED_DIR) is None:
            return f"shared file {f.path!r} must be ../{_paths.SHARED_DIR}/<name>"
        return None
    if _paths.is_inside_relative(f.path) or _paths.under(f.path, _paths.TASKOWNED_DIR) is not None:
        return None
    return f"file {f.path!r} must be inside the checkpoint directory or under ../{_paths.TASKOWNED_DIR}/"


def descriptor_to_dict(d: StateDescriptor) -> dict[str, Any]:
    return {
        "name": d.name,
        "kind": d.kind.value,
        "ttl": None if d.ttl is None else {"ttl_ms": d.ttl.ttl_ms, "update_type": d.ttl.update_type.value},
        "reduce_fields": [
            {"name": f.name, "function": f.function.value, "type": f.type.value} for f in d.reduce_fields
        ],
    }


def _corrupt(source: str, problem: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"checkpoint metadata {source} is unusable: {problem}. Restore from another checkpoint or savepoint "
        "(statectl checkpoint list shows the retained ones)"
    )


class _Reader:
    """Typed field access that names the JSON path of whatever is wrong."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.version = VERSION

    def _get(self, obj: Any, key: str, where: str) -> Any:
        if not isinstance(obj, dict):
            raise _corrupt(self.source, f"{where or 'the top level'} must be an object")
        if key not in obj:
            raise _corrupt(self.source, f"missing field {_join(where, key)!r}")
        return obj[key]

    def integer(self, obj: Any, key: str, where: str) -> int:
        value = self._get(obj, key, where)
        if isinstance(value, bool) or not isinstance(value, int):
            raise _corrupt(self.source, f"field {_join(where, key)!r} must be an integer, got {value!r}")
        if not _INT64_MIN <= value <= _INT64_MAX:
            # Every integer travels in an int64 protobuf field (restore handles, CheckpointInfo).
            raise _corrupt(self.source, f"field {_join(where, key)!r} is {value}, outside the 64-bit range")
        return value

    def string(self, obj: Any, key: str, where: str) -> str:
        value = self._get(obj, key, where)
        if not isinstance(value, str):
            raise _corrupt(self.source, f"field {_join(where, key)!r} must be a string, got {value!r}")
        return value

    def boolean(self, obj: Any, key: str, where: str) -> bool:
        value = self._get(obj, key, where)
        if not isinstance(value, bool):
            raise _corrupt(self.source, f"field {_join(where, key)!r} must be true or false, got {value!r}")
        return value

    def array(self, obj: Any, key: str, where: str) -> list[Any]:
        value = self._get(obj, key, where)
        if not isinstance(value, list):
            raise _corrupt(self.source, f"field {_join(where, key)!r} must be a list")
        return value

    def metadata(self, raw: Any) -> CheckpointMetadata:
        fmt = self._get(raw, "format", "")
        if fmt != FORMAT:
            raise _corrupt(self.source, f"format is {fmt!r}, expected {FORMAT!r} (is this a keyedstate checkpoint?)")
        version = self.integer(raw, "version", "")
        if version not in READABLE_VERSIONS:
            raise _corrupt(
                self.source,
                f"format version {version} is not supported (this build reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}); use the keyedstate release that wrote it",
            )
        self.version = version
        return CheckpointMetadata(
            job_id=self.string(raw, "job_id", ""),
            checkpoint_id=self.integer(raw, "checkpoint_id", ""),
            savepoint=self.boolean(raw, "savepoint", ""),
            timestamp_ms=self.integer(raw, "timestamp_ms", ""),
            epoch=self.integer(raw, "epoch", ""),
            max_parallelism=self.integer(raw, "max_parallelism", ""),
            operators=tuple(
                self.operator(op, f"operators[{i}]") for i, op in enumerate(self.array(raw, "operators", ""))
            ),
            lineage=self.lineage(raw),
        )

    def lineage(self, raw: Any) -> EpochLineage:
        if isinstance(raw, dict) and "lineage" not in raw:
            # Written before epochs had a lineage, when an epoch was the Spark batch id: the first
            # query to commit on top of it carries on from there.
            epoch = self.integer(raw, "epoch", "")
            return EpochLineage((LineageEntry(LEGACY_QUERY, 0, 0),)) if epoch >= 0 else EMPTY_LINEAGE
        entries = []
        for i, e in enumerate(self.array(raw, "lineage", "")):
            where = f"lineage[{i}]"
            entries.append(
                LineageEntry(
                    self.string(e, "query_id", where),
                    self.integer(e, "offset", where),
                    self.integer(e, "first_epoch", where),
                )
            )
        return EpochLineage.of(entries)

    def operator(self, raw: Any, where: str) -> OperatorSnapshot:
        return OperatorSnapshot(
            operator_id=self.string(raw, "operator_id", where),
            parallelism=self.integer(raw, "parallelism", where),
            states=tuple(self.state(s, f"{where}.states[{i}]") for i, s in enumerate(self.array(raw, "states", where))),
            subtasks=tuple(
                self.subtask(s, f"{where}.subtasks[{i}]") for i, s in enumerate(self.array(raw, "subtasks", where))
            ),
        )

    def state(self, raw: Any, where: str) -> StateDescriptor:
        name = self.string(raw, "name", where)
        kind = _enum(StateKind, self.string(raw, "kind", where), self.source, _join(where, "kind"))
        ttl_raw = self._get(raw, "ttl", where)
        ttl = None
        if ttl_raw is not None:
            ttl_ms = self.integer(ttl_raw, "ttl_ms", f"{where}.ttl")
            update = _enum(
                TtlUpdateType,
                self.string(ttl_raw, "update_type", f"{where}.ttl"),
                self.source,
                f"{where}.ttl.update_type",
            )
            try:
                ttl = TtlConfig(ttl_ms, update)
            except InvalidArgumentError as exc:
                raise _corrupt(self.source, f"{where}.ttl: {exc.message}") from exc
        fields = []
        for i, f in enumerate(self.array(raw, "reduce_fields", where)):
            fw = f"{where}.reduce_fields[{i}]"
            fields.append(
                ReduceField(
                    self.string(f, "name", fw),
                    _enum(ReduceFunction, self.string(f, "function", fw), self.source, f"{fw}.function"),
                    _enum(NumberType, self.string(f, "type", fw), self.source, f"{fw}.type"),
                )
            )
        try:
            return StateDescriptor(name, kind, ttl, tuple(fields))
        except InvalidArgumentError as exc:
            raise _corrupt(self.source, f"{where}: {exc.message}") from exc

    def subtask(self, raw: Any, where: str) -> SubtaskSnapshot:
        kg = self.array(raw, "key_groups", where)
        if len(kg) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in kg):
            raise _corrupt(self.source, f"field {where}.key_groups must be [start, end], got {kg!r}")
        return SubtaskSnapshot(
            subtask_index=self.integer(raw, "subtask_index", where),
            key_groups=KeyGroupRange(kg[0], kg[1]),
            backend=self.string(raw, "backend", where),
            committed_epoch=self.integer(raw, "committed_epoch", where),
            full_size=self.integer(raw, "full_size", where),
            incremental_size=self.integer(raw, "incremental_size", where),
            files=tuple(self.file(f, f"{where}.files[{i}]") for i, f in enumerate(self.array(raw, "files", where))),
            **self.changelog(raw, where),
        )

    def changelog(self, raw: Any, where: str) -> dict[str, Any]:
        """A version-2 subtask's segments and materialized epoch (absent: a snapshot without changelog)."""
        if self.version < 2 or "changelog" not in raw:
            return {}
        segments = tuple(
            SegmentRef(
                path=self.string(c, "path", f"{where}.changelog[{i}]"),
                first_epoch=self.integer(c, "first_epoch", f"{where}.changelog[{i}]"),
                last_epoch=self.integer(c, "last_epoch", f"{where}.changelog[{i}]"),
                size=self.integer(c, "size", f"{where}.changelog[{i}]"),
                sha256=self.string(c, "sha256", f"{where}.changelog[{i}]"),
            )
            for i, c in enumerate(self.array(raw, "changelog", where))
        )
        if not segments:
            return {}
        return {"changelog": segments, "materialized_epoch": self.integer(raw, "materialized_epoch", where)}

    def file(self, raw: Any, where: str) -> FileRef:
        return FileRef(
            path=self.string(raw, "path", where),
            size=self.integer(raw, "size", where),
            sha256=self.string(raw, "sha256", where),
            local_name=self.string(raw, "local_name", where),
            shared=self.boolean(raw, "shared", where),
        )


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _enum(cls: Any, value: str, source: str, where: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(m.value for m in cls)
        raise _corrupt(source, f"field {where!r} is {value!r}, expected one of {allowed}") from None
