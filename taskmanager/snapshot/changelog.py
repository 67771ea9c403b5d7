"""The changelog half of a slot's checkpoints (``state.changelog.enabled``), as in Flink's changelog backend.

A checkpoint of a changelog slot is its last *materialization* (a snapshot uploaded earlier,
all of its files in ``shared/``) plus the changelog segments committed after it, up to the
barrier's epoch. At a barrier the slot seals its active segment under the log's lock and
uploads only the sealed segments no completed checkpoint holds yet: no memtable flush, no SST
upload. Before the slot has a materialization (just deployed or restored) its first checkpoint
takes a snapshot itself, which becomes the first materialization.

Materializations run in the background every ``state.changelog.periodic-materialize.interval``:
a snapshot uploaded off the commit path, offered as a *candidate*. The next checkpoint
references the candidate and only the segments after it; once such a checkpoint completes, the
candidate is *confirmed* (the JobManager's shared-state registry now holds its files) and the
local segments it covers are deleted. Until then the previous confirmed materialization and the
segments since it are kept, so a lost or failed materialization never fails a checkpoint.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from keyedstate.common.errors import CorruptCheckpointError
from keyedstate.common.handles import ChangelogSegmentHandle, StateFileHandle, SubtaskStateHandle
from keyedstate.taskmanager.changelog import ReplaySource, SealedSegment, SlotChangelog, replay
from keyedstate.taskmanager.state import KeyedStateBackend

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Materialization:
    """A durable snapshot of a slot that its checkpoints reference instead of taking their own."""

    epoch: int
    """The epoch the snapshot holds; the segments after it rebuild the rest."""
    files: tuple[StateFileHandle, ...]
    """Every file in ``shared/``, paths relative to a checkpoint directory (``../shared/...``)."""
    full_size: int
    uploaded: frozenset[str] = frozenset()
    """The paths of the files this materialization uploaded itself (the rest it reused)."""
    incremental_size: int = 0
    """Bytes of the files this materialization uploaded itself."""

    def sst_files(self) -> dict[str, StateFileHandle]:
        """The SST files by local name: what the next snapshot of the slot may reference instead of uploading."""
        return {f.local_name: f for f in self.files if f.local_name.endswith(".sst")}


@dataclass
class LocalSegment:
    """A sealed local segment, and its upload referenced by the latest completed checkpoint (if any)."""

    local: SealedSegment
    remote: ChangelogSegmentHandle | None = None


@dataclass(frozen=True)
class ChangelogCut:
    """What one checkpoint of a changelog slot may reference, taken at its barrier under the log's lock."""

    epoch: int
    confirmed: Materialization | None
    candidate: Materialization | None
    segments: tuple[LocalSegment, ...]
    """Every sealed segment after the confirmed materialization, oldest first."""

    @property
    def materializes(self) -> bool:
        """No materialization to reference: the checkpoint's own snapshot becomes the first."""
        return self.confirmed is None and self.candidate is None

    def after(self, materialization: Materialization) -> list[LocalSegment]:
        """The segments a checkpoint on top of ``materialization`` needs."""
        return [s for s in self.segments if s.local.last_epoch > materialization.epoch]


@dataclass
class ChangelogCheckpoints:
    """One slot's materializations and sealed segments (the snapshot layer's view of its changelog)."""

    log: SlotChangelog
    confirmed: Materialization | None = None
    """Referenced by a completed checkpoint: its files are the JobManager's to keep."""
    candidate: Materialization | None = None
    """Uploaded by a background materialization, not yet referenced by a completed checkpoint."""
    segments: list[LocalSegment] = field(default_factory=list)
    materializing: bool = False
    next_materialization_ms: int = 0
    failures: int = 0
    """Consecutive failed materializations (reset by a successful one)."""
    failed: bool = False
    """More than ``state.changelog.max-failures-allowed`` failed in a row: the slot reported itself failed
    and materializes no more (its job fails over and redeploys it)."""
    _candidate_cut: bool = False
    """A checkpoint referenced the candidate: its files may end up the JobManager's."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def restored(self, handle: SubtaskStateHandle) -> None:
        """Start from a restored changelog checkpoint the job owns: its materialization is confirmed.

        ``handle``'s paths are relative to a checkpoint directory. Its segments (already durable,
        in no local file) are referenced by the next checkpoints as uploaded ones are, so the first
        checkpoint after a restore uploads only what was committed since, not the whole state again.
        """
        with self._lock:
            self.confirmed = Materialization(
                handle.snapshot_epoch, tuple(handle.files), sum(f.size for f in handle.files)
            )
            self.segments = [
                LocalSegment(SealedSegment(Path(s.path), s.first_epoch, s.last_epoch, s.size), remote=s)
                for s in handle.changelog
                if s.last_epoch > handle.snapshot_epoch
            ]

    def cut(self, epoch: int) -> ChangelogCut:
        """Seal the active segment at ``epoch``; what a checkpoint of that epoch references. Hold ``log.lock``."""
        sealed = self.log.seal()
        with self._lock:
            self.segments += [LocalSegment(s) for s in sealed]
            self._candidate_cut = self._candidate_cut or self.candidate is not None
            return ChangelogCut(epoch, self.confirmed, self.candidate, tuple(self.segments))

    def latest_epoch(self) -> int:
        """The epoch of the newest materialization, confirmed or not (-1: none)."""
        with self._lock:
            return self._latest_epoch()

    def offer(self, materialization: Materialization) -> list[StateFileHandle]:
        """A background materialization is durable: the next checkpoints reference it.

        Returns the files of the candidate it replaces that nothing references (no checkpoint
        ever did, and neither materialization still in use holds them): the caller deletes them.
        """
        with self._lock:
            if self._latest_epoch() >= materialization.epoch:
                return list(_own_files(materialization, self.confirmed, self.candidate))
            replaced, was_cut = self.candidate, self._candidate_cut
            self.candidate = materialization
            self._candidate_cut = False
            self.failures = 0
            if replaced is None or was_cut:
                return []
            return list(_own_files(replaced, self.confirmed, materialization))

    def _latest_epoch(self) -> int:
        newest = self.candidate or self.confirmed
        return -1 if newest is None else newest.epoch

    def drop_candidate(self, candidate: Materialization) -> None:
        """``candidate`` cannot be referenced (its files are gone); checkpoints fall back to the confirmed one."""
        with self._lock:
            if self.candidate is candidate:
                self.candidate = None

    def completed(self, materialization: Materialization, uploaded: dict[Path, ChangelogSegmentHandle]) -> bool:
        """A checkpoint referencing ``materialization`` and the ``uploaded`` segments completed.

        Its segments are durable now (the next checkpoint references them instead of uploading
        them again), ``materialization`` is confirmed, and the local segments it covers are
        deleted. True when ``materialization`` is newly confirmed.
        """
        with self._lock:
            for segment in self.segments:
                handle = uploaded.get(segment.local.path)
                if handle is not None:
                    segment.remote = handle
            newly = self.confirmed is None or materialization.epoch > self.confirmed.epoch
            if newly:
                self.confirmed = materialization
                if self.candidate is not None and self.candidate.epoch <= materialization.epoch:
                    self.candidate = None
                    self._candidate_cut = False
                self.segments = [s for s in self.segments if s.local.last_epoch > materialization.epoch]
        if newly:
            with self.log.lock:  # a checkpoint's seal hands segments out meanwhile
                removed = self.log.discard_through(materialization.epoch)
            logger.info(
                "%s: materialization of epoch %d confirmed, %d local segment(s) it covers deleted",
                self.log.subtask,
                materialization.epoch,
                removed,
            )
        return newly


def _own_files(materialization: Materialization, *others: Materialization | None) -> Iterator[StateFileHandle]:
    """The files ``materialization`` uploaded itself that none of ``others`` references.

    Only those: a file it reused belongs to a completed checkpoint (or a restored one).
    """
    kept = {f.path for other in others if other is not None for f in other.files}
    return (f for f in materialization.files if f.path in materialization.uploaded and f.path not in kept)


def replay_changelog(
    backend: KeyedStateBackend, handles: Sequence[SubtaskStateHandle], segments: dict[str, bytes]
) -> int:
    """Replay the restored ``handles``' segments (content by path in ``segments``) into ``backend``.

    Checks that the backend then holds exactly the checkpoint's epoch, so a segment that is
    short of epochs is never taken for a complete restore. Returns the epoch replayed to (-1: none).
    """
    sources = [
        ReplaySource(h.snapshot_epoch, [(s.path, segments[s.path]) for s in h.changelog])
        for h in handles
        if h.changelog
    ]
    if not sources:
        return -1
    last = replay(backend, sources)
    expected = max(h.committed_epoch for h in handles)
    held = backend.committed_epoch()
    if held != expected:
        raise CorruptCheckpointError(
            f"the changelog of {backend.subtask} replays to epoch {held}, but its checkpoint holds epoch {expected}: "
            "segments are missing epochs. Restore from an older checkpoint or a savepoint"
        )
    return last
