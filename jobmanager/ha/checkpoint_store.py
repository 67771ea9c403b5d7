"""Completed-checkpoint pointers that survive JobManager restarts (Flink's ``DefaultCompletedCheckpointStore``
over ZooKeeper/Kubernetes, kept in a file system).

A pointer ``checkpoints/<n>.json`` names the directory holding checkpoint n's ``_metadata``. It
is written after ``_metadata`` (which is written only once every subtask acknowledged), so a
pointer never names an incomplete checkpoint. Pointers of checkpoints that leave the store
(subsumed, or a savepoint overtaken by a newer checkpoint) are deleted after the new one is
written, so at every instant the pointers name at least the latest completed checkpoint.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable

from keyedstate.common.storage import CheckpointStorage
from keyedstate.jobmanager.checkpoint.completed import CompletedCheckpoint, StandaloneCompletedCheckpointStore

logger = logging.getLogger(__name__)

_POINTER = re.compile(r"^(\d{20})\.json$")


class CheckpointPointer:
    __slots__ = ("checkpoint_id", "external_path", "savepoint")

    def __init__(self, checkpoint_id: int, external_path: str, savepoint: bool) -> None:
        self.checkpoint_id = checkpoint_id
        self.external_path = external_path
        self.savepoint = savepoint


class DurableCompletedCheckpointStore(StandaloneCompletedCheckpointStore):
    def __init__(
        self, storage: CheckpointStorage, pointers_dir: str, num_retained: int, fence: Callable[[], None]
    ) -> None:
        super().__init__(num_retained)
        self._storage = storage
        self._dir = pointers_dir.rstrip("/")
        self._fence = fence

    def _pointer_path(self, checkpoint_id: int) -> str:
        return f"{self._dir}/{checkpoint_id:020d}.json"

    def pointers(self) -> list[CheckpointPointer]:
        """The pointers in storage, oldest first (what a restarted JobManager recovers)."""
        out = []
        for info in self._storage.list(self._dir):
            if not _POINTER.match(info.path.rsplit("/", 1)[-1]):
                continue
            try:
                raw = json.loads(self._storage.read_bytes(info.path))
                out.append(
                    CheckpointPointer(int(raw["checkpoint_id"]), str(raw["external_path"]), bool(raw["savepoint"]))
                )
            except FileNotFoundError:
                continue
            except (ValueError, TypeError, KeyError) as exc:
                logger.error("high availability: skipping unreadable checkpoint pointer %s: %s", info.path, exc)
        return sorted(out, key=lambda p: p.checkpoint_id)

    def add_checkpoint(self, checkpoint: CompletedCheckpoint) -> list[CompletedCheckpoint]:
        before = {c.checkpoint_id for c in self.all()}
        data = json.dumps(
            {
                "checkpoint_id": checkpoint.checkpoint_id,
                "external_path": checkpoint.external_path,
                "savepoint": checkpoint.savepoint,
            }
        ).encode()
        self._fence()
        try:
            self._storage.create_exclusive(self._pointer_path(checkpoint.checkpoint_id), data)
        except FileExistsError:
            # Recovery re-adds the checkpoints its pointers name; anything else under that id is a bug.
            existing = json.loads(self._storage.read_bytes(self._pointer_path(checkpoint.checkpoint_id)))
            if existing.get("external_path") != checkpoint.external_path:
                raise
        subsumed = super().add_checkpoint(checkpoint)
        after = {c.checkpoint_id for c in self.all()}
        for gone in sorted((before | {checkpoint.checkpoint_id}) - after):
            self._storage.delete(self._pointer_path(gone))
        return subsumed

    def remove_pointer(self, checkpoint_id: int) -> None:
        """Forget a pointer whose checkpoint cannot be loaded any more (recovery fell back past it)."""
        self._fence()
        self._storage.delete(self._pointer_path(checkpoint_id))
