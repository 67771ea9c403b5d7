"""Completed checkpoints and the store that retains the latest ones (Flink's ``CompletedCheckpointStore``)."""

from __future__ import annotations

import bisect
import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from typing import Protocol

from keyedstate.common.errors import CheckpointError, InvalidArgumentError
from keyedstate.common.ids import CheckpointId
from keyedstate.jobmanager.checkpoint import _paths
from keyedstate.jobmanager.checkpoint.metadata import CheckpointMetadata

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompletedCheckpoint:
    """A checkpoint or savepoint whose ``_metadata`` is durable.

    ``external_path`` is the directory holding ``_metadata`` (``<job dir>/chk-<n>`` or the
    savepoint directory); ``shared_files`` are the absolute paths of the files it references
    outside that directory in ``shared/``, which the shared-state registry reference-counts.
    """

    metadata: CheckpointMetadata
    external_path: str
    completion_timestamp_ms: int = 0
    shared_files: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        base = _paths.normalize(self.external_path)
        object.__setattr__(self, "external_path", base)
        object.__setattr__(
            self, "shared_files", frozenset(_paths.join(base, f.path) for _, _, f in self.metadata.files() if f.shared)
        )

    @property
    def checkpoint_id(self) -> CheckpointId:
        """The id recorded in its ``_metadata``."""
        return CheckpointId(self.metadata.checkpoint_id)

    @property
    def savepoint(self) -> bool:
        """A savepoint belongs to the user: never subsumed, never deleted by retention."""
        return self.metadata.savepoint

    def taken_over(self) -> CompletedCheckpoint:
        """This snapshot as one of the job's own checkpoints (claim mode CLAIM).

        A savepoint then loses its special standing: once newer checkpoints subsume it, it is
        deleted like any checkpoint, as Flink does with a savepoint it claimed.
        """
        if not self.savepoint:
            return self
        return CompletedCheckpoint(
            dataclasses.replace(self.metadata, savepoint=False), self.external_path, self.completion_timestamp_ms
        )

    @property
    def metadata_path(self) -> str:
        """The absolute path of the checkpoint's ``_metadata`` file (what a restore reads first)."""
        return _paths.join(self.external_path, _paths.METADATA_FILE)

    def file_paths(self) -> list[str]:
        """Absolute paths of every file the checkpoint references."""
        return [_paths.join(self.external_path, f.path) for _, _, f in self.metadata.files()]

    def __repr__(self) -> str:
        kind = "savepoint" if self.savepoint else "checkpoint"
        return f"<Completed {kind} {self.checkpoint_id} at {self.external_path}>"


class CompletedCheckpointStore(Protocol):
    """Retains completed checkpoints; a durable implementation backs JobManager high availability."""

    @property
    def max_retained(self) -> int:
        """How many regular checkpoints the store keeps (``execution.checkpointing.num-retained``); savepoints aside."""

    def add_checkpoint(self, checkpoint: CompletedCheckpoint) -> list[CompletedCheckpoint]:
        """Add ``checkpoint`` and return the checkpoints it subsumed (to be discarded).

        Savepoints are never returned: their files belong to the user.
        """

    def latest(self) -> CompletedCheckpoint | None:
        """The newest checkpoint or savepoint (what a failover restores)."""

    def all(self) -> list[CompletedCheckpoint]:
        """Everything retained, oldest first."""


class StandaloneCompletedCheckpointStore:
    """An in-memory store keeping the latest ``num_retained`` checkpoints.

    Savepoints do not count toward ``num_retained``. A savepoint stays in the store while it is
    newer than every retained checkpoint (it is then what a failover restores) and leaves it,
    without anything being deleted, once a newer checkpoint completes.
    """

    def __init__(self, num_retained: int = 1) -> None:
        if num_retained < 1:
            raise InvalidArgumentError(f"execution.checkpointing.num-retained must be at least 1, got {num_retained}")
        self._num_retained = num_retained
        self._entries: list[CompletedCheckpoint] = []
        self._lock = threading.Lock()

    @property
    def max_retained(self) -> int:
        return self._num_retained

    def add_checkpoint(self, checkpoint: CompletedCheckpoint) -> list[CompletedCheckpoint]:
        """Add ``checkpoint``; returns the checkpoints it subsumed, for the caller to discard.

        Raises CheckpointError for an id already stored, or a regular checkpoint older than the latest one. A savepoint
        older than the latest checkpoint is not kept (its files stay where they are).
        """
        with self._lock:
            ids = [c.checkpoint_id for c in self._entries]
            if checkpoint.checkpoint_id in ids:
                raise CheckpointError(
                    f"checkpoint {checkpoint.checkpoint_id} is already in the completed-checkpoint store"
                )
            if checkpoint.savepoint:
                if self._entries and checkpoint.checkpoint_id < ids[-1]:
                    # A newer checkpoint already completed; the savepoint stays valid at its path.
                    logger.info(
                        "savepoint %d completed after newer checkpoint %d; not kept as restore point",
                        checkpoint.checkpoint_id,
                        ids[-1],
                    )
                    return []
                self._entries.append(checkpoint)
                return []
            latest_checkpoint = max((c.checkpoint_id for c in self._entries if not c.savepoint), default=0)
            if checkpoint.checkpoint_id <= latest_checkpoint:
                raise CheckpointError(
                    f"checkpoint {checkpoint.checkpoint_id} is older than the retained checkpoint {latest_checkpoint}; "
                    "completed checkpoints must be added in id order"
                )
            self._entries.insert(bisect.bisect(ids, checkpoint.checkpoint_id), checkpoint)
            self._entries = [
                c for c in self._entries if not (c.savepoint and c.checkpoint_id < checkpoint.checkpoint_id)
            ]
            subsumed: list[CompletedCheckpoint] = []
            regular = [c for c in self._entries if not c.savepoint]
            while len(regular) > self._num_retained:
                oldest = regular.pop(0)
                self._entries.remove(oldest)
                subsumed.append(oldest)
            return subsumed

    def latest(self) -> CompletedCheckpoint | None:
        """The newest checkpoint or savepoint (what a failover restores), or None."""
        with self._lock:
            return self._entries[-1] if self._entries else None

    def all(self) -> list[CompletedCheckpoint]:
        """Everything retained, oldest first (a copy)."""
        with self._lock:
            return list(self._entries)

    def get(self, checkpoint_id: CheckpointId) -> CompletedCheckpoint | None:
        """The retained checkpoint with that id, or None (subsumed ones are gone)."""
        with self._lock:
            return next((c for c in self._entries if c.checkpoint_id == checkpoint_id), None)
