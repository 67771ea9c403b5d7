"""A checkpoint id counter that survives JobManager restarts (Flink's ZooKeeper/Kubernetes counter).

The next id is written before it is handed out, so an id is never given twice even if the
JobManager dies right after a barrier: the ``chk-<n>`` an aborted checkpoint began is never
reused, and late files a TaskManager uploads for it cannot collide with a new checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from keyedstate.common.errors import CorruptCheckpointError
from keyedstate.common.storage import CheckpointStorage
from keyedstate.jobmanager.checkpoint.id_counter import StandaloneCheckpointIDCounter


class DurableCheckpointIDCounter(StandaloneCheckpointIDCounter):
    def __init__(self, storage: CheckpointStorage, path: str, fence: Callable[[], None], floor: int = 1) -> None:
        """``floor``: the smallest id the counter may hand out (one past every ``chk-<n>`` seen in storage)."""
        self._storage = storage
        self._path = path
        self._fence = fence
        stored = self._read()
        super().__init__(stored)
        if floor > stored:
            self.set_count(floor)

    def _read(self) -> int:
        try:
            raw = self._storage.read_bytes(self._path)
        except FileNotFoundError:
            return 1
        try:
            value = int(json.loads(raw)["next"])
            if value < 1:
                raise ValueError(f"next id {value} is below 1")
        except (ValueError, TypeError, KeyError) as exc:
            raise CorruptCheckpointError(
                f"checkpoint id counter {self._path} is unreadable ({exc}); delete it: the JobManager then "
                "continues after the newest chk-<n> directory it finds"
            ) from exc
        return value

    def _persist(self, next_id: int) -> None:
        self._fence()
        self._storage.write_bytes(self._path, json.dumps({"next": next_id}).encode())
