"""A checkpoint id counter that survives JobManager restarts (Flink's ZooKeeper/Kubernetes counter).

The next id is written before it is handed out, so an id is never given twice even if the
JobManager dies right after a barrier: the ``chk-<n>`` an aborted checkpoint began is never
reused, and late files a TaskManager uploads for it cannot collide with a new checkpoint.
"""

from __future__ import annotations

import json
import threading
from typing import Callable

from keyedstate.common.errors import CorruptCheckpointError, InvalidArgumentError
from keyedstate.common.storage import CheckpointStorage


class DurableCheckpointIDCounter:
    def __init__(self, storage: CheckpointStorage, path: str, fence: Callable[[], None], floor: int = 1) -> None:
        """``floor``: the smallest id the counter may hand out (one past every ``chk-<n>`` seen in storage)."""
        self._storage = storage
        self._path = path
        self._fence = fence
        self._lock = threading.Lock()
        stored = self._read()
        self._next = max(stored, floor, 1)
        if self._next != stored:
            self._write(self._next)

    def _read(self) -> int:
        try:
            raw = self._storage.read_bytes(self._path)
        except FileNotFoundError:
            return 1
        try:
            value = int(json.loads(raw)["next"])
        except (ValueError, TypeError, KeyError) as exc:
            raise CorruptCheckpointError(
                f"checkpoint id counter {self._path} is unreadable ({exc}); delete it: the JobManager then "
                "continues after the newest chk-<n> directory it finds"
            ) from exc
        return value

    def _write(self, next_id: int) -> None:
        self._fence()
        self._storage.write_bytes(self._path, json.dumps({"next": next_id}).encode())

    def get_and_increment(self) -> int:
        with self._lock:
            value = self._next
            self._write(value + 1)  # durable before the id is used
            self._next = value + 1
            return value

    def get(self) -> int:
        with self._lock:
            return self._next

    def set_count(self, next_id: int) -> None:
        with self._lock:
            if next_id < self._next:
                raise InvalidArgumentError(
                    f"cannot move the checkpoint id counter back from {self._next} to {next_id}: "
                    "ids must strictly increase so that no chk-<n> directory is reused"
                )
            if next_id != self._next:
                self._write(next_id)
                self._next = next_id
