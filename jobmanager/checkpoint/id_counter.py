"""Checkpoint ids: strictly increasing per job, never reused (they name ``chk-<n>`` directories)."""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from keyedstate.common.errors import InvalidArgumentError

logger = logging.getLogger(__name__)


class CheckpointIDCounter(Protocol):
    """Hands out checkpoint ids. A durable implementation backs JobManager high availability."""

    def get_and_increment(self) -> int:
        """Return the next id and advance the counter."""

    def get(self) -> int:
        """The id the next :meth:`get_and_increment` returns."""

    def set_count(self, next_id: int) -> None:
        """Make ``next_id`` the next id (after a restore); the counter never goes backwards."""


class StandaloneCheckpointIDCounter:
    """An in-memory counter starting at 1 (ids are lost with the JobManager process)."""

    def __init__(self, initial: int = 1) -> None:
        if initial < 1:
            raise InvalidArgumentError(f"checkpoint ids start at 1 or later, got {initial}")
        self._next = initial
        self._lock = threading.Lock()

    def _persist(self, next_id: int) -> None:
        """Make ``next_id`` durable before it takes effect (a no-op here; see ha.id_counter)."""

    def get_and_increment(self) -> int:
        """Return the next id and advance the counter (persisted first: a crash never hands an id out twice)."""
        with self._lock:
            value = self._next
            self._persist(value + 1)  # before the id is used: a crash never hands it out twice
            self._next = value + 1
            return value

    def get(self) -> int:
        with self._lock:
            return self._next

    def set_count(self, next_id: int) -> None:
        """Make ``next_id`` the next id; raises InvalidArgumentError if that would move the counter back."""
        with self._lock:
            if next_id < self._next:
                raise InvalidArgumentError(
                    f"cannot move the checkpoint id counter back from {self._next} to {next_id}: "
                    "ids must strictly increase so that no chk-<n> directory is reused"
                )
            if next_id != self._next:
                self._persist(next_id)
                self._next = next_id
