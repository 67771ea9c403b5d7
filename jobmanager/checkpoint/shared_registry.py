"""Reference counts of ``shared/`` files across retained checkpoints (Flink's ``SharedStateRegistry``).

Incremental checkpoints reuse files uploaded by earlier ones. A shared file may be deleted only
when no retained checkpoint references it any more: the registry counts references per path,
is told about each completed checkpoint (register) and each subsumed one (unregister), and
reports which files just lost their last reference.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from keyedstate.jobmanager.checkpoint import _paths
from keyedstate.jobmanager.checkpoint.completed import CompletedCheckpoint

logger = logging.getLogger(__name__)


class SharedStateRegistry:
    """Thread-safe reference counts keyed by absolute, normalized file path."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._registered: dict[int, frozenset[str]] = {}
        self._lock = threading.Lock()

    def register(self, checkpoint: CompletedCheckpoint) -> None:
        """Count every shared file of ``checkpoint`` once; registering twice changes nothing."""
        with self._lock:
            if checkpoint.checkpoint_id in self._registered:
                return
            self._registered[checkpoint.checkpoint_id] = checkpoint.shared_files
            for path in checkpoint.shared_files:
                self._counts[path] = self._counts.get(path, 0) + 1

    def unregister(self, checkpoint: CompletedCheckpoint) -> list[str]:
        """Drop ``checkpoint``'s references; return the files nothing references any more."""
        with self._lock:
            files = self._registered.pop(checkpoint.checkpoint_id, None)
            if files is None:
                return []
            released = []
            for path in files:
                count = self._counts.get(path, 0) - 1
                if count <= 0:
                    self._counts.pop(path, None)
                    released.append(path)
                else:
                    self._counts[path] = count
            return sorted(released)

    def unreferenced(self, paths: Iterable[str]) -> list[str]:
        """Those of ``paths`` no registered checkpoint references (safe to delete on abort)."""
        with self._lock:
            return sorted({p for p in map(_paths.normalize, paths) if p not in self._counts})

    def is_referenced(self, path: str) -> bool:
        """True while a registered checkpoint still uses the shared file (it must not be deleted)."""
        with self._lock:
            return _paths.normalize(path) in self._counts

    def reference_count(self, path: str) -> int:
        """How many registered checkpoints use the shared file (the path is normalized first)."""
        with self._lock:
            return self._counts.get(_paths.normalize(path), 0)

    def referenced(self) -> frozenset[str]:
        """Every shared file some registered checkpoint uses (a copy, taken under the lock)."""
        with self._lock:
            return frozenset(self._counts)

    def __len__(self) -> int:
        with self._lock:
            return len(self._counts)
