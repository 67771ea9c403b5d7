"""Where a TaskManager's slot backends come from: one factory for empty and restored backends.

It owns what every backend of this TaskManager shares (kind, working directory, size limits,
the shared RocksDB memory, the clock), so the deployer and the restore path build backends the
same way without reaching into each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from keyedstate.common.clock import Clock
from keyedstate.common.ids import SubtaskId
from keyedstate.taskmanager.slots import Slot
from keyedstate.taskmanager.state import (
    KeyedStateBackend,
    RocksDBResources,
    StateLimits,
    create_backend,
    restore_backend,
)


class BackendFactory:
    """Creates and restores the backends of this TaskManager's slots."""

    def __init__(
        self,
        kind: str,
        work_dir: Path,
        limits: StateLimits,
        resources: RocksDBResources | None,
        clock: Clock,
    ) -> None:
        self.kind = kind
        """``state.backend.type``: rocksdb or hashmap."""
        self.work_dir = work_dir
        self.limits = limits
        self._resources = resources
        self._clock = clock

    def instance_dir(self, subtask: SubtaskId) -> Path:
        """The local directory of one subtask: its database, staging and local snapshots."""
        return self.work_dir / subtask.instance_dir_name()

    def create(self, slot: Slot) -> KeyedStateBackend:
        """An empty backend for ``slot`` (RocksDB keeps data already in its instance directory)."""
        return create_backend(
            self.kind,
            slot.subtask,
            slot.key_groups,
            slot.max_parallelism,
            slot.operator.states,
            local_dir=self.work_dir,
            limits=self.limits,
            clock=self._clock,
            resources=self._resources,
        )

    def restore(self, slot: Slot, snapshot_dirs: Sequence[Path]) -> KeyedStateBackend:
        """A backend for ``slot`` built from downloaded local snapshots, keeping only its key groups."""
        return restore_backend(
            self.kind,
            slot.subtask,
            slot.key_groups,
            slot.max_parallelism,
            slot.operator.states,
            snapshot_dirs=snapshot_dirs,
            local_dir=self.work_dir,
            limits=self.limits,
            clock=self._clock,
            resources=self._resources,
        )
