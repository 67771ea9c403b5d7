"""A slot's local changelog: committed change sets made durable before they are applied, and their replay.

With ``state.changelog.enabled`` an epoch commit first appends its change set to the active local
segment and fsyncs it, then applies it to the backend with the clock pinned to the timestamp the
record carries. :meth:`SlotChangelog.seal` closes the active segment at a checkpoint and hands
back the segments written since the previous one (what that checkpoint uploads); once a
materialized snapshot is durable, :meth:`SlotChangelog.discard_through` drops the local segments
it covers. :func:`replay` rebuilds a slot from a restored snapshot plus segments, filtered by
the slot's key groups, stamping TTL entries with each commit's original time.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from keyedstate.common.clock import Clock
from keyedstate.common.errors import CorruptCheckpointError, InvalidArgumentError
from keyedstate.common.ids import SubtaskId
from keyedstate.common.keygroups import key_group
from keyedstate.taskmanager.changelog.segment import HEADER, ChangeSet, encode_record, read_segment
from keyedstate.taskmanager.state.backend import KeyedStateBackend
from keyedstate.taskmanager.state.metadata import COMMITTED_EPOCH
from keyedstate.taskmanager.state.mutation import Mutation

logger = logging.getLogger(__name__)

SEGMENT_SUFFIX = ".seg"
CHANGELOG_DIR = "changelog"
"""The log's directory inside a slot's instance directory."""


@dataclass(frozen=True)
class SealedSegment:
    """A closed local segment: every change set of epochs ``first_epoch..last_epoch`` of one slot."""

    path: Path
    first_epoch: int
    last_epoch: int
    size: int
    records: int = 0
    """Change sets (committed epochs) the segment holds."""


class _PinnedClock:
    """The backend's clock with wall time fixed at one commit's timestamp (TTL stamps of that commit)."""

    def __init__(self, inner: Clock, now_ms: int) -> None:
        self._inner = inner
        self._now_ms = now_ms

    def now_ms(self) -> int:
        return self._now_ms

    def monotonic_ms(self) -> int:
        return self._inner.monotonic_ms()

    def boottime_ms(self) -> int:
        return self._inner.boottime_ms()


@contextmanager
def pinned_clock(backend: KeyedStateBackend, now_ms: int) -> Iterator[None]:
    """Apply writes to ``backend`` as if it were ``now_ms``, so a replay stamps TTL exactly as the commit did."""
    inner = backend.clock
    backend.clock = _PinnedClock(inner, now_ms)
    try:
        yield
    finally:
        backend.clock = inner


class SlotChangelog:
    """The local changelog segments of one slot (one directory, one writer: the slot's commits)."""

    def __init__(self, directory: Path, subtask: SubtaskId, clock: Clock) -> None:
        self.directory = directory
        self.subtask = subtask
        self._clock = clock
        # Segments of an earlier incarnation of this slot are meaningless: a restarted slot is
        # rebuilt from a checkpoint, whose segments are in checkpoint storage.
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        self._next_index = 0
        self._fd: int | None = None
        self._active: Path | None = None
        self._active_first = -1
        self._active_last = -1
        self._active_size = 0
        self._active_records = 0
        self._sealed: list[SealedSegment] = []
        self._handed_out: list[SealedSegment] = []
        self._last_epoch = -1
        self._retract_to: tuple[int, int, int, int] | None = None
        self.lock = threading.Lock()
        """Held by a commit from its append to its apply (or retract), and by a checkpoint or a
        materialization across its seal and its cut of the backend: a cut never sees an epoch
        that is logged but not applied, or applied but not logged."""

    def append(self, epoch: int, mutations: Sequence[Mutation], timestamp_ms: int | None = None) -> int:
        """Make ``epoch``'s change set durable in the active segment; the timestamp to apply it with.

        Returns only after the record is fsynced, so an epoch applied to the backend is always in
        the log. Epochs must increase. ``timestamp_ms``: the commit's time when it was fixed
        earlier (an overlapped commit's change set carries the time of its Prepare); default now.
        """
        if epoch <= self._last_epoch:
            raise InvalidArgumentError(
                f"changelog of {self.subtask}: epoch {epoch} follows epoch {self._last_epoch}; epochs must increase"
            )
        now = self._clock.now_ms() if timestamp_ms is None else timestamp_ms
        record = encode_record(ChangeSet(epoch, now, tuple(mutations)))
        if self._fd is None:
            self._open_segment(epoch)
        assert self._fd is not None
        os.write(self._fd, record)
        os.fsync(self._fd)
        self._retract_to = (self._active_size, self._active_last, self._last_epoch, self._active_records)
        self._active_last = epoch
        self._active_size += len(record)
        self._active_records += 1
        self._last_epoch = epoch
        return now

    def retract(self, epoch: int) -> None:
        """Take back the record of ``epoch`` just appended, whose apply failed (its commit may be retried).

        Only the last appended record can be retracted, and only before :meth:`seal`; the slot's
        commit lock keeps a checkpoint from sealing between an append and its apply.
        """
        if self._retract_to is None or self._last_epoch != epoch or self._fd is None:
            raise InvalidArgumentError(f"changelog of {self.subtask}: epoch {epoch} is not the last appended record")
        size, active_last, last_epoch, records = self._retract_to
        os.ftruncate(self._fd, size)
        os.fsync(self._fd)
        self._active_size, self._active_last, self._last_epoch = size, active_last, last_epoch
        self._active_records = records
        self._retract_to = None

    def _open_segment(self, epoch: int) -> None:
        path = self.directory / f"{self._next_index:012d}{SEGMENT_SUFFIX}"
        self._next_index += 1
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        os.write(fd, HEADER)
        os.fsync(fd)
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the new file's directory entry survives a crash too
        finally:
            os.close(dir_fd)
        self._fd, self._active = fd, path
        self._active_first, self._active_last, self._active_size = epoch, epoch, len(HEADER)
        self._active_records = 0

    def seal(self) -> list[SealedSegment]:
        """Close the active segment; the segments sealed since the previous call (oldest first).

        A checkpoint uploads exactly these: the change sets committed since the previous checkpoint.
        """
        if self._fd is not None:
            assert self._active is not None
            os.close(self._fd)
            self._sealed.append(
                SealedSegment(
                    self._active, self._active_first, self._active_last, self._active_size, self._active_records
                )
            )
            self._fd, self._active = None, None
        self._retract_to = None
        sealed, self._sealed = self._sealed, []
        self._handed_out += sealed
        return sealed

    def discard_through(self, epoch: int) -> int:
        """Delete sealed local segments holding only epochs up to ``epoch`` (a durable materialization
        covers them); how many were deleted. Segments not yet handed out by :meth:`seal` are kept."""
        keep = []
        for segment in self._handed_out:
            if segment.last_epoch <= epoch:
                segment.path.unlink(missing_ok=True)
            else:
                keep.append(segment)
        removed = len(self._handed_out) - len(keep)
        self._handed_out = keep
        return removed

    def close(self) -> None:
        """Close the active segment's file (the slot is released); the directory is left to the caller."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass(frozen=True)
class ReplaySource:
    """The segments of one slot of the checkpointed job and the epoch its materialized snapshot holds.

    Change sets up to ``materialized_epoch`` are already in the restored snapshot and are skipped.
    """

    materialized_epoch: int
    segments: Sequence[tuple[str, bytes]]
    """``(name, content)`` in the order they were written; the name appears in errors."""


def replay(backend: KeyedStateBackend, sources: Sequence[ReplaySource]) -> int:
    """Apply the sources' change sets after their materialized epochs to ``backend``; the last epoch applied.

    Only mutations of keys in ``backend``'s key groups are applied (a restore into another
    parallelism reads the segments of every old slot whose key groups overlap). Epochs apply in
    ascending order; the old slots' change sets of one epoch touch disjoint key groups, so their
    order within an epoch does not matter. Each epoch is one atomic write carrying the committed
    epoch, with the commit's original timestamp. A corrupt segment raises
    :class:`CorruptCheckpointError` before anything of it is applied.
    """
    by_epoch: dict[int, list[ChangeSet]] = {}
    for source in sources:
        previous = source.materialized_epoch
        for name, data in source.segments:
            for cs in read_segment(data, name):
                if cs.epoch <= source.materialized_epoch:
                    continue
                if cs.epoch <= previous:
                    raise CorruptCheckpointError(
                        f"changelog segment {name} holds epoch {cs.epoch} after epoch {previous}; the segments "
                        "of a checkpoint must be in commit order. Restore from an older checkpoint"
                    )
                previous = cs.epoch
                by_epoch.setdefault(cs.epoch, []).append(cs)
    groups = backend.key_groups
    max_parallelism = backend.max_parallelism
    last = -1
    for epoch in sorted(by_epoch):
        change_sets = by_epoch[epoch]
        for cs in change_sets:
            mine = [m for m in cs.mutations if key_group(m.key, max_parallelism) in groups]
            meta = {COMMITTED_EPOCH: str(epoch).encode("ascii")}
            with pinned_clock(backend, cs.timestamp_ms):
                backend.apply(mine, meta=meta)
        last = epoch
    if last >= 0:
        logger.info("replayed changelog epochs %d..%d into %s", min(by_epoch), last, backend.subtask)
    return last
