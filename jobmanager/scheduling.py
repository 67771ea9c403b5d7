"""Placing subtasks into free slots and computing their key-group ranges."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from keyedstate.common.descriptors import OperatorSpec
from keyedstate.common.errors import CapacityError
from keyedstate.common.ids import JobId, KeyGroupRange, SubtaskId, TaskManagerId
from keyedstate.common.keygroups import key_group_range_for_subtask
from keyedstate.jobmanager.registry import ReportedLimits, TaskManagerRecord, TaskManagerRegistry


@dataclass(frozen=True)
class SlotAssignment:
    subtask: SubtaskId
    key_groups: KeyGroupRange
    taskmanager_id: TaskManagerId
    address: str
    slot_index: int
    routing_version: int = 0
    """The routing version the slot is deployed under (set when the deployment is made)."""
    limits: ReportedLimits | None = field(default=None, compare=False)
    """The size limits of its TaskManager (None: not reported); not part of the assignment's identity."""
    slot_address: str = ""
    """Where clients reach the slot when a slot process of its TaskManager serves it ("": ``address``)."""


def plan_subtasks(
    job_id: JobId, operators: list[OperatorSpec], max_parallelism: int
) -> list[tuple[SubtaskId, KeyGroupRange]]:
    """Every subtask of the job with the key-group range it owns (Flink's KeyGroupRangeAssignment)."""
    return [
        (SubtaskId(job_id, op.operator_id, i), key_group_range_for_subtask(max_parallelism, op.parallelism, i))
        for op in operators
        for i in range(op.parallelism)
    ]


def check_free_slots(
    registry: TaskManagerRegistry, needed: int, avoid: AbstractSet[TaskManagerId] = frozenset()
) -> list[TaskManagerRecord]:
    """The TaskManagers to allocate from; CapacityError naming the shortfall if they lack ``needed`` free slots."""
    with registry.lock:
        records = [r for r in registry.all() if r.taskmanager_id not in avoid]
        available = sum(len(r.free_slots()) for r in records)
        if available < needed:
            total = registry.total_slot_count()
            raise CapacityError(
                f"the job needs {needed} slots but only {available} of {total} are free on "
                f"{len(records)} TaskManager(s); start more TaskManagers, raise taskmanager.numberOfTaskSlots, "
                "or lower the parallelism"
            )
        return records


def allocate_slots(
    registry: TaskManagerRegistry,
    subtasks: list[tuple[SubtaskId, KeyGroupRange]],
    avoid: AbstractSet[TaskManagerId] = frozenset(),
    prefer: Mapping[SubtaskId, TaskManagerId] | None = None,
) -> list[SlotAssignment]:
    """Reserve one free slot per subtask, spreading them over TaskManagers.

    ``prefer`` maps subtasks to the TaskManager that hosted them before (a restart): a subtask
    goes back there when it has a free slot, so local recovery finds its local copy (Flink's
    sticky allocation). Either every subtask gets a slot or none does (CapacityError naming
    the shortfall).
    """
    with registry.lock:
        records = check_free_slots(registry, len(subtasks), avoid)
        free = {r.taskmanager_id: r.free_slots() for r in records}
        by_id = {r.taskmanager_id: r for r in records}
        assignments: list[SlotAssignment] = []
        prefer = prefer or {}
        # Subtasks returning to their previous TaskManager choose first, then the rest spread.
        ordered = sorted(subtasks, key=lambda st: 0 if free.get(prefer.get(st[0], TaskManagerId("")), []) else 1)
        for subtask, key_groups in ordered:
            previous = prefer.get(subtask)
            if previous is not None and free.get(previous):
                tm_id = previous
            else:
                # The TaskManager with the most free slots takes the next subtask: an even spread.
                tm_id = max(free, key=lambda t: (len(free[t]), t))
            slot_index = free[tm_id].pop(0)
            record = by_id[tm_id]
            record.occupancy[slot_index] = subtask
            assignments.append(
                SlotAssignment(
                    subtask,
                    key_groups,
                    tm_id,
                    record.address,
                    slot_index,
                    limits=record.limits,
                    slot_address=record.slot_address(slot_index) if record.slot_addresses else "",
                )
            )
        return assignments


def release_assignments(registry: TaskManagerRegistry, assignments: list[SlotAssignment]) -> None:
    """Free the slots ``assignments`` hold in the registry, unless a slot was given to another subtask meanwhile."""
    with registry.lock:
        for a in assignments:
            record = registry.get(a.taskmanager_id)
            if record is not None and record.occupancy[a.slot_index] == a.subtask:
                record.occupancy[a.slot_index] = None
