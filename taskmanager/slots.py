"""The slots of a TaskManager: which (job, operator, subtask) each hosts, and its backend."""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from keyedstate.common.descriptors import OperatorSpec
from keyedstate.common.errors import (
    AlreadyExistsError,
    CapacityError,
    InvalidArgumentError,
    NotFoundError,
    Reason,
    StaleRoutingError,
    UnavailableError,
)
from keyedstate.common.handles import StateFileHandle, SubtaskStateHandle
from keyedstate.common.ids import JobId, KeyGroupRange, OperatorId, SubtaskId, TaskManagerId, validate_id
from keyedstate.taskmanager.changelog import SlotChangelog
from keyedstate.taskmanager.state import KeyedStateBackend

logger = logging.getLogger(__name__)


class SlotStatus(enum.Enum):
    RESTORING = "RESTORING"
    RUNNING = "RUNNING"
    RELEASING = "RELEASING"


@dataclass
class Slot:
    index: int
    subtask: SubtaskId
    operator: OperatorSpec
    key_groups: KeyGroupRange
    max_parallelism: int
    routing_version: int
    checkpoint_base: str
    incremental: bool
    backend: KeyedStateBackend | None = None
    status: SlotStatus = SlotStatus.RESTORING
    # Shared files (local name -> remote handle) of the latest completed checkpoint, reused by
    # the next incremental checkpoint.
    uploaded_shared: dict[str, StateFileHandle] = field(default_factory=dict)
    changelog: SlotChangelog | None = None
    """Changelog checkpoints (``state.changelog.enabled``): the slot's local log, written before each commit applies."""
    materialize_interval_ms: int = 0
    """With :attr:`changelog`: how often the slot materializes its state in the background."""
    max_materialization_failures: int = 3
    """With :attr:`changelog`: consecutive failed materializations tolerated before the slot fails its job
    over (``state.changelog.max-failures-allowed``)."""
    restored_materialization: SubtaskStateHandle | None = None
    """A changelog restore whose materialization and segments the job owns, paths relative to a checkpoint
    directory: the slot's checkpoints reference them instead of materializing again."""

    def require_backend(self) -> KeyedStateBackend:
        """The backend of a running slot; UNAVAILABLE while it restores or is released."""
        if self.status is not SlotStatus.RUNNING or self.backend is None:
            raise UnavailableError(
                f"slot {self.index} ({self.subtask}) is {self.status.value}; retry shortly", reason=Reason.UNAVAILABLE
            )
        return self.backend


class SlotTable:
    """Thread-safe table of a TaskManager's slots."""

    def __init__(self, num_slots: int, taskmanager_id: TaskManagerId) -> None:
        self._slots: list[Slot | None] = [None] * num_slots
        self._by_subtask: dict[SubtaskId, Slot] = {}
        # Per job, the highest routing version deployed here: older deploys are late, and refused.
        self._version_floor: dict[JobId, int] = {}
        self._lock = threading.Lock()
        self._tm = taskmanager_id

    @property
    def num_slots(self) -> int:
        """How many slots this TaskManager offers (``taskmanager.numberOfTaskSlots``), free or not."""
        return len(self._slots)

    def reserve(
        self,
        subtask: SubtaskId,
        operator: OperatorSpec,
        key_groups: KeyGroupRange,
        max_parallelism: int,
        slot_index: int,
        routing_version: int,
        checkpoint_base: str,
        incremental: bool,
    ) -> Slot:
        """Claim ``slot_index`` for ``subtask`` (status RESTORING until :meth:`activate`)."""
        with self._lock:
            if not 0 <= slot_index < len(self._slots):
                raise InvalidArgumentError(
                    f"slot index {slot_index} does not exist on TaskManager {self._tm} (it has {len(self._slots)} slots)"
                )
            job_id = JobId(subtask.job_id)
            floor = self._version_floor.get(job_id, 0)
            if routing_version < floor:
                # A deploy that arrives late: a newer deployment of the job was made here since.
                raise StaleRoutingError(
                    f"{subtask} would be deployed under routing v{routing_version}, but this TaskManager takes deployments "
                    f"of job {subtask.job_id!r} only from v{floor} on (a newer one was made or an older one released "
                    "since); the deploy arrived late and is refused",
                    current_version=floor,
                )
            existing = self._by_subtask.get(subtask)
            if existing is not None:
                raise AlreadyExistsError(f"{subtask} is already deployed in slot {existing.index} of {self._tm}")
            taken = self._slots[slot_index]
            if taken is not None:
                raise CapacityError(f"slot {slot_index} of TaskManager {self._tm} is taken by {taken.subtask}")
            slot = Slot(
                slot_index,
                subtask,
                operator,
                key_groups,
                max_parallelism,
                routing_version,
                checkpoint_base,
                incremental,
            )
            self._slots[slot_index] = slot
            self._by_subtask[subtask] = slot
            self._version_floor[job_id] = max(floor, routing_version)
            return slot

    def set_version_floors(self, versions: Mapping[JobId, int]) -> None:
        """Take the JobManager's current routing version of each job as its floor (at registration)."""
        with self._lock:
            self._version_floor = dict(versions)

    def raise_version_floor(self, job_id: JobId, version: int) -> None:
        """Deployments of ``job_id`` up to ``version`` are over (released): later deploys of them are late."""
        with self._lock:
            self._version_floor[job_id] = max(self._version_floor.get(job_id, 0), version + 1)

    def activate(self, slot: Slot, backend: KeyedStateBackend) -> None:
        """The slot serves ``backend`` from now on (status RUNNING)."""
        with self._lock:
            slot.backend = backend
            slot.status = SlotStatus.RUNNING

    def remove(self, subtask: SubtaskId, up_to_version: int | None = None) -> Slot | None:
        """Take ``subtask``'s slot out of the table (only a deployment of ``up_to_version`` or older, when given)."""
        with self._lock:
            slot = self._by_subtask.get(subtask)
            if slot is None:
                return None
            if up_to_version is not None and slot.routing_version > up_to_version:
                logger.info(
                    "not releasing %s: it is deployed under routing v%d, the release is for v%d (late)",
                    subtask,
                    slot.routing_version,
                    up_to_version,
                )
                return None
            del self._by_subtask[subtask]
            self._slots[slot.index] = None
            slot.status = SlotStatus.RELEASING
            return slot

    def lookup(
        self, job_id: JobId, operator_id: OperatorId, subtask_index: int, routing_version: int | None = None
    ) -> Slot:
        """The slot hosting the subtask under ``routing_version`` (None: any version).

        A call routed with another version than the slot was deployed under is refused: after a
        redeploy the same subtask may live elsewhere (or here again, restored), and only the
        deployment of the caller's version may serve it.
        """
        slot = self._by_subtask.get(SubtaskId(job_id, operator_id, subtask_index))
        if slot is None:
            # Only on a miss (the hot path stays free of it): a malformed name is the caller's
            # mistake, not a routing table to refresh.
            validate_id("job id", job_id)
            validate_id("operator id", operator_id)
            raise StaleRoutingError(
                f"TaskManager {self._tm} hosts no slot for job {job_id!r} operator {operator_id!r} "
                f"subtask {subtask_index}; refresh the routing table from the JobManager"
            )
        if routing_version is not None and routing_version != slot.routing_version:
            if routing_version <= 0:
                raise StaleRoutingError(
                    f"the call to {slot.subtask} carries no routing version; every state call must carry the version "
                    "of the routing table it was routed with (GetRouting)",
                    current_version=slot.routing_version,
                )
            raise StaleRoutingError(
                f"{slot.subtask} on TaskManager {self._tm} is deployed under routing version {slot.routing_version}, "
                f"the call was routed with version {routing_version}; refresh the routing table from the JobManager",
                current_version=slot.routing_version,
            )
        return slot

    def get(self, subtask: SubtaskId) -> Slot | None:
        """The slot of ``subtask``, if hosted here (whatever its routing version)."""
        with self._lock:
            return self._by_subtask.get(subtask)

    def of_job(self, job_id: JobId) -> list[Slot]:
        """Every slot of ``job_id`` hosted here."""
        with self._lock:
            return [s for s in self._slots if s is not None and s.subtask.job_id == job_id]

    def all(self) -> list[Slot]:
        """Every occupied slot, in slot order."""
        with self._lock:
            return [s for s in self._slots if s is not None]

    def free_count(self) -> int:
        """How many slots are free (a gauge reads it at scrape time)."""
        with self._lock:
            return sum(1 for s in self._slots if s is None)


def unknown_job_error(job_id: JobId) -> NotFoundError:
    return NotFoundError(f"unknown job {job_id!r}", reason=Reason.UNKNOWN_JOB)
