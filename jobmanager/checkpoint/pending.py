"""A triggered checkpoint that is collecting acknowledgements (Flink's ``PendingCheckpoint``)."""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from keyedstate.common.clock import Cancellable
from keyedstate.common.descriptors import OperatorSpec
from keyedstate.common.handles import SubtaskStateHandle
from keyedstate.common.ids import CheckpointId, JobId, KeyGroupRange, SubtaskId
from keyedstate.common.keygroups import key_group_range_for_subtask
from keyedstate.jobmanager.checkpoint import _paths
from keyedstate.jobmanager.checkpoint.failure import CheckpointException, CheckpointFailureReason
from keyedstate.jobmanager.checkpoint.metadata import (
    CheckpointMetadata,
    FileRef,
    OperatorSnapshot,
    SegmentRef,
    SubtaskSnapshot,
    file_problems,
)
from keyedstate.jobmanager.lineage import EMPTY_LINEAGE, EpochLineage

if TYPE_CHECKING:
    from keyedstate.jobmanager.checkpoint.completed import CompletedCheckpoint

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1 << 16)
def _owned_key_groups(max_parallelism: int, parallelism: int, subtask_index: int) -> KeyGroupRange:
    """The key groups a subtask owns, one shared (immutable) object per subtask across checkpoints.

    A new range per ack was one more long-lived object per slot and checkpoint for the garbage
    collector to promote and scan; the cache holds one per subtask of up to 65,536.
    """
    return key_group_range_for_subtask(max_parallelism, parallelism, subtask_index)


class AckOutcome(enum.Enum):
    """What an acknowledgement did. Only SUCCESS changed anything; the others are normal events."""

    SUCCESS = "SUCCESS"
    DUPLICATE = "DUPLICATE"
    UNKNOWN = "UNKNOWN"
    DISCARDED = "DISCARDED"


class PendingStatus(enum.Enum):
    IN_PROGRESS = "IN_PROGRESS"
    FINALIZING = "FINALIZING"
    COMPLETED = "COMPLETED"
    ABORTED = "ABORTED"


class PendingCheckpoint:
    """The acks collected so far for one checkpoint or savepoint.

    Not thread-safe on its own: the coordinator calls it under its lock. File paths of accepted
    acks are normalized to the ``_metadata`` convention (relative to :attr:`target_path`; shared
    files as ``../shared/<name>``). A TaskManager may send them that way, as absolute URLs, or
    (shared files only) relative to the job directory as ``shared/<name>``.
    """

    def __init__(
        self,
        *,
        job_id: JobId,
        checkpoint_id: CheckpointId,
        trigger_timestamp_ms: int,
        trigger_monotonic_ms: int,
        operators: Sequence[OperatorSpec],
        max_parallelism: int,
        target_path: str,
        shared_dir: str,
        savepoint: bool = False,
        epoch: int = -1,
        lineage: EpochLineage = EMPTY_LINEAGE,
        incremental: bool = False,
        periodic: bool = False,
        expected: Iterable[SubtaskId] | None = None,
        counted: bool = True,
    ) -> None:
        self.job_id = job_id
        self.checkpoint_id = checkpoint_id
        self.trigger_timestamp_ms = trigger_timestamp_ms
        self.trigger_monotonic_ms = trigger_monotonic_ms
        self.operators = tuple(operators)
        self.max_parallelism = max_parallelism
        self.target_path = _paths.normalize(target_path)
        self.shared_dir = _paths.normalize(shared_dir)
        self.taskowned_dir = _paths.join(self.shared_dir, "..", _paths.TASKOWNED_DIR)
        self.savepoint = savepoint
        self.counted = counted
        """False: its failure never counts toward the tolerable checkpoint failures (see CheckpointCoordinator.trigger)."""
        self.epoch = epoch
        self.lineage = lineage
        self.incremental = incremental
        self.periodic = periodic
        self._ops = {op.operator_id: op for op in self.operators}
        self.expected: frozenset[SubtaskId] = frozenset(
            expected
            if expected is not None
            else (SubtaskId(job_id, op.operator_id, i) for op in self.operators for i in range(op.parallelism))
        )
        # Each accepted ack as it goes into _metadata (paths normalized, files checked), by
        # (operator id, subtask index): a tuple of a string and a number, which the garbage
        # collector stops tracking, where a SubtaskId per ack would be one more object per slot.
        self._acks: dict[tuple[str, int], SubtaskSnapshot] = {}
        self.status = PendingStatus.IN_PROGRESS
        self.failure_reason: CheckpointFailureReason | None = None
        self.failure_message = ""
        self.timeout_handle: Cancellable | None = None
        self.future: Future[CompletedCheckpoint] = Future()
        self.future.set_running_or_notify_cancel()

    def __repr__(self) -> str:
        kind = "savepoint" if self.savepoint else "checkpoint"
        return f"<Pending {kind} {self.checkpoint_id} of {self.job_id}: {len(self._acks)}/{len(self.expected)} acks, {self.status.value}>"

    # -- state ---------------------------------------------------------------------------------
    @property
    def is_discarded(self) -> bool:
        """True once aborted: later acks answer DISCARDED."""
        return self.status is PendingStatus.ABORTED

    @property
    def is_fully_acknowledged(self) -> bool:
        """True once every expected subtask acknowledged: the checkpoint can be finalized."""
        return len(self._acks) == len(self.expected)

    @property
    def num_acknowledged(self) -> int:
        """How many expected subtasks acknowledged so far (shown while waiting for the checkpoint)."""
        return len(self._acks)

    def not_yet_acknowledged(self) -> frozenset[SubtaskId]:
        """The expected subtasks whose ack is missing (named in a timeout's message)."""
        return frozenset(s for s in self.expected if (s.operator_id, s.subtask_index) not in self._acks)

    def acknowledged(self) -> dict[SubtaskId, SubtaskSnapshot]:
        """The accepted acks as ``_metadata`` will hold them, with normalized relative paths."""
        return {
            s: self._acks[s.operator_id, s.subtask_index]
            for s in self.expected
            if (s.operator_id, s.subtask_index) in self._acks
        }

    def shared_files(self) -> set[str]:
        """Absolute paths of the ``shared/`` files the acks so far reference."""
        return {
            _paths.join(self.target_path, f.path)
            for snapshot in self._acks.values()
            for f in snapshot.all_files()
            if f.shared
        }

    # -- transitions ---------------------------------------------------------------------------
    def acknowledge(self, subtask: SubtaskId, handle: SubtaskStateHandle) -> AckOutcome:
        """Record ``subtask``'s snapshot.

        Late, duplicate and unknown acks return their outcome and change nothing. An ack whose
        content cannot be part of this checkpoint raises CheckpointException (CHECKPOINT_DECLINED);
        the caller aborts the checkpoint.
        """
        if self.status is PendingStatus.ABORTED:
            return AckOutcome.DISCARDED
        if subtask not in self.expected:
            return AckOutcome.UNKNOWN
        key = (subtask.operator_id, subtask.subtask_index)
        if key in self._acks or self.status is not PendingStatus.IN_PROGRESS:
            return AckOutcome.DUPLICATE
        self._acks[key] = self._snapshot(subtask, handle)
        return AckOutcome.SUCCESS

    def start_finalizing(self) -> None:
        """Stop taking acks (later ones answer DUPLICATE) and cancel the timeout: every subtask acknowledged."""
        self.status = PendingStatus.FINALIZING
        self._cancel_timeout()

    def mark_completed(self) -> None:
        """Mark it completed and cancel its timeout; not locked itself (the coordinator calls it under its lock)."""
        self.status = PendingStatus.COMPLETED
        self._cancel_timeout()

    def mark_aborted(self, reason: CheckpointFailureReason, message: str) -> None:
        """Record why it failed and cancel its timeout; the coordinator calls it under its lock, then cleans up."""
        self.status = PendingStatus.ABORTED
        self.failure_reason = reason
        self.failure_message = message
        self._cancel_timeout()

    def release_acks(self) -> None:
        """Drop the collected handles once finished (finished checkpoints are remembered for a while)."""
        self._acks = {}

    def _cancel_timeout(self) -> None:
        if self.timeout_handle is not None:
            self.timeout_handle.cancel()
            self.timeout_handle = None

    # -- metadata ------------------------------------------------------------------------------
    def build_metadata(self) -> CheckpointMetadata:
        """The ``_metadata`` content; call once fully acknowledged.

        Its epoch is the cut's: every acknowledgement was checked to hold exactly that epoch.
        """
        by_op: dict[str, list[SubtaskSnapshot]] = {op.operator_id: [] for op in self.operators}
        for (operator_id, _), snapshot in self._acks.items():
            by_op[operator_id].append(snapshot)
        epoch = self.epoch
        return CheckpointMetadata(
            job_id=self.job_id,
            checkpoint_id=self.checkpoint_id,
            savepoint=self.savepoint,
            timestamp_ms=self.trigger_timestamp_ms,
            epoch=epoch,
            lineage=self.lineage.up_to(epoch),
            max_parallelism=self.max_parallelism,
            operators=tuple(
                OperatorSnapshot(
                    op.operator_id,
                    op.parallelism,
                    op.states,
                    tuple(sorted(by_op[op.operator_id], key=lambda s: s.subtask_index)),
                )
                for op in self.operators
            ),
        )

    # -- validation ----------------------------------------------------------------------------
    def _reject(self, subtask: SubtaskId, problem: str) -> CheckpointException:
        return CheckpointException(
            CheckpointFailureReason.CHECKPOINT_DECLINED,
            f"subtask {subtask} sent an unusable acknowledgement for checkpoint {self.checkpoint_id}: {problem}",
        )

    def _snapshot(self, subtask: SubtaskId, handle: SubtaskStateHandle) -> SubtaskSnapshot:
        """``handle`` as ``_metadata`` holds it, its paths normalized; CheckpointException if it cannot be part of it.

        Built once per ack, straight into the metadata model: no copy of the handle is kept, so a
        checkpoint holds one object per file, not three (fewer objects for the garbage collector to scan).
        """
        got = handle.key_groups
        op = self._ops.get(subtask.operator_id)
        if op is None:  # expected, but not of the operators given (only when built with both)
            key_groups = KeyGroupRange(got.start, got.end)
        else:
            key_groups = _owned_key_groups(self.max_parallelism, op.parallelism, subtask.subtask_index)
            if got != key_groups:
                raise self._reject(subtask, f"key groups {got}, but the subtask owns {key_groups}")
        if handle.committed_epoch != self.epoch:
            # A consistent cut: every slot holds exactly the epoch the barrier was cut at.
            raise self._reject(
                subtask,
                f"its committed epoch is {handle.committed_epoch} but the checkpoint was cut at epoch {self.epoch}",
            )
        files = []
        for f in handle.files:
            ref = FileRef(self.relative_path(f.path, f.shared), f.size, f.sha256, f.local_name, f.shared)
            # Every check _metadata's files get, here while the ack is fresh: the coordinator then writes
            # _metadata without a second pass over all files (it checks CheckpointMetadata.structure_problems() alone).
            problems = file_problems(ref, self.savepoint)
            if problems:
                raise self._reject(subtask, problems[0])
            files.append(ref)
        segments = tuple(
            SegmentRef(self.relative_path(c.path, True), c.first_epoch, c.last_epoch, c.size, c.sha256)
            for c in handle.changelog
        )
        # New objects: the caller's handle keeps the paths it sent.
        snapshot = SubtaskSnapshot(
            subtask_index=handle.subtask_index,
            key_groups=key_groups,
            backend=handle.backend,
            committed_epoch=handle.committed_epoch,
            full_size=handle.full_size,
            incremental_size=handle.incremental_size,
            files=tuple(files),
            changelog=segments,
            materialized_epoch=handle.materialized_epoch if segments else None,
        )
        if segments:
            if self.savepoint:
                raise self._reject(subtask, "a savepoint must be self-contained, but it references changelog segments")
            for problem in [*snapshot.changelog_problems(), *map(self._segment_problem, segments)]:
                if problem:
                    raise self._reject(subtask, problem)
        return snapshot

    def _segment_problem(self, segment: SegmentRef) -> str | None:
        return next(iter(file_problems(segment.as_file(), self.savepoint)), None)

    def relative_path(self, path: str, shared: bool) -> str:
        """A path as a TaskManager sent it, in the ``_metadata`` convention (not validated)."""
        if "://" in path:
            rel = _paths.relative_to(path, self.target_path)
            if rel is not None:
                return rel
            for directory, base in ((_paths.SHARED_DIR, self.shared_dir), (_paths.TASKOWNED_DIR, self.taskowned_dir)):
                rel = _paths.relative_to(path, base)
                if rel is not None:
                    return f"../{directory}/{rel}"
            return path  # rejected by file_problems
        if shared and not self.savepoint and path.startswith(_paths.SHARED_DIR + "/"):
            return "../" + path
        return path
