"""Slot addresses and slot processes (``taskmanager.slot-processes`` > 1): checked at registration, used by slot assignment."""

from __future__ import annotations

import pytest

from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.ids import KeyGroupRange, SubtaskId, TaskManagerId
from keyedstate.jobmanager.registry import SlotProcessReport, TaskManagerRegistry
from keyedstate.jobmanager.scheduling import allocate_slots
from tests.fakes.clock import ManualClock
from tests.fakes.scheduler import ManualScheduler


@pytest.fixture
def registry() -> TaskManagerRegistry:
    clock = ManualClock(monotonic_ms=1_000_000)
    return TaskManagerRegistry(clock, ManualScheduler(clock), 10_000, 100, lease_bound_ms=4_889)


def _register(registry: TaskManagerRegistry, slot_addresses: tuple[str, ...]) -> None:
    registry.register(TaskManagerId("tm"), "10.0.0.1:6000", "10.0.0.1", 4, "rocksdb", 0, slot_addresses=slot_addresses)


def test_each_slot_is_assigned_with_the_address_of_its_slot_process(registry: TaskManagerRegistry) -> None:
    _register(registry, ("10.0.0.1:7000", "10.0.0.1:7001", "10.0.0.1:7000", "10.0.0.1:7001"))
    subtasks = [(SubtaskId("j", "op", i), KeyGroupRange(i * 32, i * 32 + 31)) for i in range(4)]
    assignments = allocate_slots(registry, subtasks)
    by_slot = {a.slot_index: a for a in assignments}
    assert [by_slot[i].slot_address for i in range(4)] == ["10.0.0.1:7000", "10.0.0.1:7001"] * 2
    # The TaskManager's own address stays the one the JobManager's control calls go to.
    assert {a.address for a in assignments} == {"10.0.0.1:6000"}


def test_without_slot_addresses_clients_use_the_taskmanager_address(registry: TaskManagerRegistry) -> None:
    _register(registry, ())
    (assignment,) = allocate_slots(registry, [(SubtaskId("j", "op", 0), KeyGroupRange(0, 127))])
    assert assignment.slot_address == ""
    record = registry.get(TaskManagerId("tm"))
    assert record is not None and record.slot_address(assignment.slot_index) == "10.0.0.1:6000"


@pytest.mark.parametrize(
    ("slot_addresses", "fragment"),
    [
        (("10.0.0.1:7000",), "sent 1 slot addresses for 4 slots"),
        (("10.0.0.1:7000", "10.0.0.1:7001", "10.0.0.1:0", "10.0.0.1:7001"), "slot address '10.0.0.1:0'"),
        (("a", "b", "c", "d"), "expected host:port"),
    ],
)
def test_malformed_slot_addresses_are_refused(
    registry: TaskManagerRegistry, slot_addresses: tuple[str, ...], fragment: str
) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        _register(registry, slot_addresses)
    assert fragment in info.value.message
    assert registry.get(TaskManagerId("tm")) is None


_ADDRESSES = ("10.0.0.1:7000", "10.0.0.1:7001") * 2


def test_slot_processes_are_kept_with_their_pids_for_the_overview(registry: TaskManagerRegistry) -> None:
    processes = (SlotProcessReport(0, "10.0.0.1:7000", 4242), SlotProcessReport(1, "10.0.0.1:7001", 0))
    registry.register(
        TaskManagerId("tm"),
        "10.0.0.1:6000",
        "10.0.0.1",
        4,
        "rocksdb",
        0,
        slot_addresses=_ADDRESSES,
        slot_processes=processes,
    )
    record = registry.get(TaskManagerId("tm"))
    assert record is not None and record.slot_processes == processes


@pytest.mark.parametrize(
    ("processes", "fragment"),
    [
        (tuple(SlotProcessReport(i, f"10.0.0.1:{7000 + i}", 100 + i) for i in range(5)), "5 slot processes for 4"),
        ((SlotProcessReport(1, "10.0.0.1:7001", 7), SlotProcessReport(0, "10.0.0.1:7000", 8)), "in index order"),
        ((SlotProcessReport(0, "10.0.0.1:7000", -1),), "with its pid"),
        ((SlotProcessReport(0, "10.0.0.1:0", 7),), "slot process address '10.0.0.1:0'"),
    ],
)
def test_malformed_slot_processes_are_refused(
    registry: TaskManagerRegistry, processes: tuple[SlotProcessReport, ...], fragment: str
) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        registry.register(
            TaskManagerId("tm"),
            "10.0.0.1:6000",
            "10.0.0.1",
            4,
            "rocksdb",
            0,
            slot_addresses=_ADDRESSES,
            slot_processes=processes,
        )
    assert fragment in info.value.message
    assert registry.get(TaskManagerId("tm")) is None
