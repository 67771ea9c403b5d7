"""Deploying and releasing slots: creating (or restoring) the backend of a subtask."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from keyedstate.common.clock import Clock
from keyedstate.common.descriptors import OperatorSpec
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.ids import KeyGroupRange, SubtaskId, validate_id
from keyedstate.common.keygroups import UPPER_BOUND_MAX_PARALLELISM
from keyedstate.taskmanager.slots import Slot, SlotTable
from keyedstate.taskmanager.state import KeyedStateBackend, RocksDBResources, StateLimits, create_backend

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeployRequest:
    subtask: SubtaskId
    operator: OperatorSpec
    key_groups: KeyGroupRange
    max_parallelism: int
    slot_index: int
    routing_version: int
    checkpoint_base: str
    incremental: bool

    def validate(self) -> None:
        validate_id("job id", self.subtask.job_id)
        if not 1 <= self.max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
            raise InvalidArgumentError(
                f"max parallelism {self.max_parallelism} is outside 1..{UPPER_BOUND_MAX_PARALLELISM}"
            )
        kg = self.key_groups
        if not (0 <= kg.start <= kg.end < self.max_parallelism):
            raise InvalidArgumentError(
                f"key-group range {kg} is not inside [0, {self.max_parallelism - 1}] (max parallelism {self.max_parallelism})"
            )


@dataclass(frozen=True)
class DeployResult:
    restore_duration_ms: int = 0
    restored_bytes: int = 0
    downloaded_bytes: int = 0
    committed_epoch: int = -1
    """The epoch the deployed state holds; the JobManager checks it against what it restored."""


# Restores a slot's backend from checkpoint storage; provided by the snapshot/restore layer.
Restorer = Callable[[Slot, Path, object], tuple[KeyedStateBackend, DeployResult]]


class SlotDeployer:
    """Creates, restores and releases the backends of slots."""

    def __init__(
        self,
        slots: SlotTable,
        backend_kind: str,
        work_dir: Path,
        limits: StateLimits,
        resources: RocksDBResources | None,
        clock: Clock,
    ) -> None:
        self._slots = slots
        self.backend_kind = backend_kind
        self.work_dir = work_dir
        self._limits = limits
        self._resources = resources
        self._clock = clock
        self.restorer: Restorer | None = None

    def instance_dir(self, subtask: SubtaskId) -> Path:
        return self.work_dir / subtask.instance_dir_name()

    def deploy(self, request: DeployRequest, restore: object | None = None) -> DeployResult:
        request.validate()
        slot = self._slots.reserve(
            request.subtask,
            request.operator,
            request.key_groups,
            request.max_parallelism,
            request.slot_index,
            request.routing_version,
            request.checkpoint_base,
            request.incremental,
        )
        started = time.monotonic()
        try:
            if restore is not None:
                if self.restorer is None:
                    raise InvalidArgumentError("this TaskManager cannot restore state (no restorer configured)")
                backend, result = self.restorer(slot, self.instance_dir(request.subtask), restore)
            else:
                # A fresh deployment starts empty: leftovers of an earlier run are not this job's state.
                shutil.rmtree(self.instance_dir(request.subtask), ignore_errors=True)
                backend = self.create_empty(slot, self.instance_dir(request.subtask))
                result = DeployResult()
        except BaseException:
            self._slots.remove(request.subtask)
            raise
        self._slots.activate(slot, backend)
        result = dataclasses.replace(result, committed_epoch=backend.committed_epoch())
        logger.info(
            "deployed %s in slot %d key groups %s (%s, %.0f ms)",
            request.subtask,
            request.slot_index,
            request.key_groups,
            "restored" if restore else "empty",
            (time.monotonic() - started) * 1000,
        )
        return result

    def create_empty(self, slot: Slot, instance_dir: Path) -> KeyedStateBackend:
        return create_backend(
            self.backend_kind,
            slot.subtask,
            slot.key_groups,
            slot.max_parallelism,
            slot.operator.states,
            local_dir=self.work_dir,
            limits=self._limits,
            clock=self._clock,
            resources=self._resources,
        )

    def retain(self, kept: set[SubtaskId]) -> list[SubtaskId]:
        """Release every slot whose subtask is not in ``kept`` (after a re-registration); returns the released."""
        released = [slot.subtask for slot in self._slots.all() if slot.subtask not in kept]
        for subtask in released:
            logger.warning("releasing %s: the JobManager no longer assigns it to this TaskManager", subtask)
            self.release(subtask, discard_local_state=False)
        return released

    def release(self, subtask: SubtaskId, discard_local_state: bool, up_to_version: int | None = None) -> bool:
        """Release the slot of ``subtask`` (only a deployment of ``up_to_version`` or older, when given)."""
        if up_to_version is not None:
            self._slots.raise_version_floor(subtask.job_id, up_to_version)
        slot = self._slots.remove(subtask, up_to_version)
        if slot is None:
            return False
        if slot.backend is not None:
            slot.backend.close()
        if discard_local_state:
            shutil.rmtree(self.instance_dir(subtask), ignore_errors=True)
        logger.info("released %s from slot %d", subtask, slot.index)
        return True

    def close_all(self) -> None:
        for slot in self._slots.all():
            self._slots.remove(slot.subtask)
            if slot.backend is not None:
                try:
                    slot.backend.close()
                except Exception:
                    logger.exception("closing the backend of %s failed", slot.subtask)
