"""Deploying and releasing slots: creating (or restoring) the backend of a subtask."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from keyedstate.common.changesets import ChangeSetFile
from keyedstate.common.clock import Clock
from keyedstate.common.descriptors import OperatorSpec
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.handles import SlotRestore
from keyedstate.common.ids import JobId, KeyGroupRange, SubtaskId, validate_id
from keyedstate.common.keygroups import UPPER_BOUND_MAX_PARALLELISM
from keyedstate.taskmanager.backends import BackendFactory
from keyedstate.taskmanager.changelog import CHANGELOG_DIR, SlotChangelog
from keyedstate.taskmanager.changelog.change_sets import ChangeSetStore
from keyedstate.taskmanager.slots import Slot, SlotTable
from keyedstate.taskmanager.state import KeyedStateBackend

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
    changelog_materialize_interval_ms: int | None = None
    """Changelog checkpoints (``state.changelog.enabled``): how often the slot materializes; None: off."""
    changelog_max_failures_allowed: int = 3
    """With changelog checkpoints: consecutive failed materializations the slot tolerates before it fails its job."""
    replay: tuple[ChangeSetFile, ...] = ()
    """Overlapped commits: change sets of the decided epochs above the restored state, folded in before serving."""

    def validate(self) -> None:
        """Refuse a request whose job id, parallelism or key-group range no slot could serve."""
        validate_id("job id", self.subtask.job_id)
        if not 1 <= self.max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
            raise InvalidArgumentError(
                f"max parallelism {self.max_parallelism} is outside 1..{UPPER_BOUND_MAX_PARALLELISM}"
            )
        if self.changelog_materialize_interval_ms is not None and self.changelog_materialize_interval_ms <= 0:
            raise InvalidArgumentError(
                f"changelog materialize interval {self.changelog_materialize_interval_ms} ms must be positive "
                "(state.changelog.periodic-materialize.interval)"
            )
        if self.changelog_max_failures_allowed < 0:
            raise InvalidArgumentError(
                f"changelog max failures allowed {self.changelog_max_failures_allowed} must be at least 0 "
                "(state.changelog.max-failures-allowed)"
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


class Restorer(Protocol):
    """Restores a slot's backend from checkpoint storage (the snapshot layer, above this one)."""

    def restore(self, slot: Slot, instance_dir: Path, restore: SlotRestore) -> tuple[KeyedStateBackend, DeployResult]:
        """The backend of ``slot`` built from the snapshots ``restore`` names, in ``instance_dir``."""


class SlotDeployer:
    """Creates, restores and releases the backends of slots."""

    def __init__(
        self,
        slots: SlotTable,
        backends: BackendFactory,
        restorer: Restorer | None,
        clock: Clock,
        change_sets: ChangeSetStore | None = None,
    ) -> None:
        """``change_sets`` replays decided epochs into restored slots (overlapped commits)."""
        self._slots = slots
        self._backends = backends
        self._restorer = restorer
        self._clock = clock
        self._change_sets = change_sets

    @property
    def work_dir(self) -> Path:
        """This TaskManager's working directory (one sub-directory per hosted subtask)."""
        return self._backends.work_dir

    def instance_dir(self, subtask: SubtaskId) -> Path:
        """The local directory of one subtask (see :meth:`BackendFactory.instance_dir`)."""
        return self._backends.instance_dir(subtask)

    def deploy(self, request: DeployRequest, restore: SlotRestore | None = None) -> DeployResult:
        """Reserve the slot and give it a backend, empty or restored; the slot serves once this returns."""
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
        started = self._clock.monotonic_ms()
        try:
            if restore is not None:
                if self._restorer is None:
                    raise InvalidArgumentError("this TaskManager cannot restore state (no restorer configured)")
                backend, result = self._restorer.restore(slot, self.instance_dir(request.subtask), restore)
            else:
                # A fresh deployment starts empty: leftovers of an earlier run are not this job's state.
                shutil.rmtree(self.instance_dir(request.subtask), ignore_errors=True)
                backend = self._backends.create(slot)
                result = DeployResult()
            if request.replay:
                self._replay(backend, request)
                # The decided epochs folded in are in no segment and not in the restored
                # materialization: the slot's first checkpoint materializes a snapshot that holds them.
                slot.restored_materialization = None
        except BaseException:
            self._slots.remove(request.subtask)
            raise
        if request.changelog_materialize_interval_ms is not None:
            # After the restore, which replaced the instance directory: the log starts at the restored epoch.
            slot.changelog = SlotChangelog(
                self.instance_dir(request.subtask) / CHANGELOG_DIR, request.subtask, self._clock
            )
            slot.materialize_interval_ms = request.changelog_materialize_interval_ms
            slot.max_materialization_failures = request.changelog_max_failures_allowed
        self._slots.activate(slot, backend)
        result = dataclasses.replace(result, committed_epoch=backend.committed_epoch())
        logger.info(
            "deployed %s in slot %d key groups %s (%s, %.0f ms)",
            request.subtask,
            request.slot_index,
            request.key_groups,
            "restored" if restore else "empty",
            self._clock.monotonic_ms() - started,
        )
        return result

    def _replay(self, backend: KeyedStateBackend, request: DeployRequest) -> None:
        """Fold the decided epochs above the restored state into it before the slot serves (and reports its epoch)."""
        if self._change_sets is None:
            raise InvalidArgumentError("this TaskManager cannot replay change sets (no checkpoint storage configured)")
        try:
            self._change_sets.replay(backend, request.checkpoint_base, request.replay)
        except BaseException:
            backend.close()
            raise

    def retain(self, kept: set[SubtaskId], routing_versions: Mapping[JobId, int]) -> list[SubtaskId]:
        """Release every slot the registration answer does not keep; returns the released.

        ``routing_versions``: each job's version when the JobManager decided the answer. A slot deployed
        under a newer one was deployed after that (while the answer travelled here): it stays.
        """
        released = [
            slot.subtask
            for slot in self._slots.all()
            if slot.subtask not in kept
            and slot.routing_version <= routing_versions.get(JobId(slot.subtask.job_id), slot.routing_version)
        ]
        for subtask in released:
            logger.warning("releasing %s: the JobManager no longer assigns it to this TaskManager", subtask)
            self.release(subtask, discard_local_state=False)
        return released

    def release(self, subtask: SubtaskId, discard_local_state: bool, up_to_version: int | None = None) -> bool:
        """Release the slot of ``subtask`` (only a deployment of ``up_to_version`` or older, when given)."""
        if up_to_version is not None:
            self._slots.raise_version_floor(JobId(subtask.job_id), up_to_version)
        slot = self._slots.remove(subtask, up_to_version)
        if slot is None:
            return False
        if slot.backend is not None:
            slot.backend.close()
        if slot.changelog is not None:
            slot.changelog.close()
        if discard_local_state:
            shutil.rmtree(self.instance_dir(subtask), ignore_errors=True)
        logger.info("released %s from slot %d", subtask, slot.index)
        return True

    def close_all(self) -> None:
        """Release every slot (the TaskManager stops); a backend that fails to close is logged, not raised."""
        for slot in self._slots.all():
            self._slots.remove(slot.subtask)
            if slot.backend is not None:
                try:
                    slot.backend.close()
                except Exception:
                    logger.exception("closing the backend of %s failed", slot.subtask)
            if slot.changelog is not None:
                slot.changelog.close()
