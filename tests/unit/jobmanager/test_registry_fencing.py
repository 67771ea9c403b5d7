"""The registry's fencing: when a TaskManager certainly serves nothing it was given before (manual clock)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from keyedstate.common.ids import TaskManagerId
from keyedstate.jobmanager.registry import TaskManagerRecord, TaskManagerRegistry
from tests.fakes.clock import ManualClock
from tests.fakes.scheduler import ManualScheduler

TIMEOUT = 10_000
CHECK = 100
BOUND = 4_889  # lease_bound_ms(4_000): a 4 s lease (heartbeat.interval 800 ms)


class _Lost:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def __call__(self, record: TaskManagerRecord, cause: str) -> None:
        self.events.append((record.taskmanager_id, cause))


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(monotonic_ms=1_000_000)


@pytest.fixture
def scheduler(clock: ManualClock) -> ManualScheduler:
    return ManualScheduler(clock)


@pytest.fixture
def registry(clock: ManualClock, scheduler: ManualScheduler) -> TaskManagerRegistry:
    return TaskManagerRegistry(clock, scheduler, TIMEOUT, CHECK, lease_bound_ms=BOUND)


def register(registry: TaskManagerRegistry, tm: TaskManagerId, port: int = 1) -> TaskManagerRecord:
    record, _previous = registry.register(tm, f"127.0.0.1:{port}", "h", 2, "rocksdb", 0)
    return record


def waiter(
    registry: TaskManagerRegistry, ids: list[TaskManagerId], timeout_ms: int, closed: threading.Event | None = None
) -> Any:
    """wait_fenced on another thread; ``.result`` once ``.join()`` returned."""

    class W(threading.Thread):
        result: list[TaskManagerId] | None = None

        def run(self) -> None:
            self.result = registry.wait_fenced(ids, timeout_ms, closed)

    w = W(daemon=True)
    w.start()
    return w


def test_a_registered_taskmanager_counts_as_fenced(registry: TaskManagerRegistry, clock: ManualClock) -> None:
    register(registry, TaskManagerId("tm-a"))
    assert registry.fenced_at_ms(TaskManagerId("tm-a")) == 0
    assert registry.wait_fenced([TaskManagerId("tm-a")], 0) == []
    record = registry.get(TaskManagerId("tm-a"))
    assert record is not None and record.lease_until_ms == clock.monotonic_ms() + BOUND


def test_a_taskmanager_never_seen_is_unfenced_until_lease_bound_after_the_registry_started(
    registry: TaskManagerRegistry, clock: ManualClock
) -> None:
    started = clock.monotonic_ms()
    clock.advance(1_234)
    assert registry.fenced_at_ms(TaskManagerId("tm-ghost")) == started + BOUND
    clock.advance(BOUND - 1_234 - 1)
    assert registry.wait_fenced([TaskManagerId("tm-ghost")], 0) == [TaskManagerId("tm-ghost")]
    clock.advance(1)
    assert registry.wait_fenced([TaskManagerId("tm-ghost")], 0) == []


def test_the_default_bound_comes_from_the_timeout_alone(clock: ManualClock, scheduler: ManualScheduler) -> None:
    registry = TaskManagerRegistry(clock, scheduler, TIMEOUT, CHECK)
    # L = 80% of 10 s = 8 s; bound = ceil(8000 * 1.1 / 0.9) = 9778.
    assert registry.fenced_at_ms(TaskManagerId("tm-ghost")) == clock.monotonic_ms() + 9_778


def test_heartbeats_move_the_bound_and_a_loss_by_connection_waits_for_it(
    registry: TaskManagerRegistry, clock: ManualClock
) -> None:
    lost = _Lost()
    registry.add_lost_listener(lost)
    register(registry, TaskManagerId("tm-a"))
    clock.advance(700)
    assert registry.heartbeat(TaskManagerId("tm-a")) is True
    last = clock.monotonic_ms()
    clock.advance(300)
    registry.mark_lost(TaskManagerId("tm-a"), "connection refused")
    assert lost.events == [(TaskManagerId("tm-a"), "connection refused")]
    assert registry.get(TaskManagerId("tm-a")) is None
    assert registry.fenced_at_ms(TaskManagerId("tm-a")) == last + BOUND
    assert registry.wait_fenced([TaskManagerId("tm-a")], 0) == [TaskManagerId("tm-a")]
    # A lost TaskManager's heartbeat is not answered known and does not extend the bound.
    assert registry.heartbeat(TaskManagerId("tm-a")) is False
    assert registry.fenced_at_ms(TaskManagerId("tm-a")) == last + BOUND
    clock.advance(last + BOUND - clock.monotonic_ms())
    assert registry.wait_fenced([TaskManagerId("tm-a")], 0) == []


def test_a_taskmanager_lost_by_heartbeat_timeout_is_already_fenced(
    registry: TaskManagerRegistry, clock: ManualClock, scheduler: ManualScheduler
) -> None:
    lost = _Lost()
    registry.add_lost_listener(lost)
    registry.start()
    register(registry, TaskManagerId("tm-a"))
    register(registry, TaskManagerId("tm-b"), port=2)
    for _ in range(TIMEOUT // 1_000):
        scheduler.advance(1_000)
        assert registry.heartbeat(TaskManagerId("tm-b"))
    assert lost.events == []
    scheduler.advance(CHECK)  # now - last heartbeat > heartbeat.timeout
    assert lost.events == [(TaskManagerId("tm-a"), f"no heartbeat for {TIMEOUT} ms (heartbeat.timeout)")]
    assert registry.fenced_at_ms(TaskManagerId("tm-a")) <= clock.monotonic_ms()
    assert registry.wait_fenced([TaskManagerId("tm-a"), TaskManagerId("tm-b")], 0) == []
    registry.stop()


def test_reregistration_clears_the_tombstone_and_a_later_loss_counts_from_the_new_registration(
    registry: TaskManagerRegistry, clock: ManualClock
) -> None:
    register(registry, TaskManagerId("tm-a"))
    registry.mark_lost(TaskManagerId("tm-a"), "connection refused")
    assert registry.wait_fenced([TaskManagerId("tm-a")], 0) == [TaskManagerId("tm-a")]
    clock.advance(10)
    register(registry, TaskManagerId("tm-a"))  # it revoked its own lease before registering
    assert registry.fenced_at_ms(TaskManagerId("tm-a")) == 0
    clock.advance(2_000)
    registry.mark_lost(TaskManagerId("tm-a"), "connection refused")
    assert registry.fenced_at_ms(TaskManagerId("tm-a")) == clock.monotonic_ms() - 2_000 + BOUND


def test_a_stale_registrations_loss_does_not_touch_the_current_one(registry: TaskManagerRegistry) -> None:
    old = register(registry, TaskManagerId("tm-a"))
    register(registry, TaskManagerId("tm-a"), port=2)
    registry.mark_lost(TaskManagerId("tm-a"), "the old connection broke", only=old)
    assert registry.get(TaskManagerId("tm-a")) is not None and registry.fenced_at_ms(TaskManagerId("tm-a")) == 0


def test_a_deregistered_taskmanager_is_fenced_at_once(registry: TaskManagerRegistry, clock: ManualClock) -> None:
    register(registry, TaskManagerId("tm-a"))
    clock.advance(10)
    registry.deregister(TaskManagerId("tm-a"))
    assert registry.get(TaskManagerId("tm-a")) is None
    assert registry.fenced_at_ms(TaskManagerId("tm-a")) == 0
    assert registry.wait_fenced([TaskManagerId("tm-a")], 0) == []


def test_a_taskmanager_deregistered_after_the_startup_bound_is_fenced(
    registry: TaskManagerRegistry, clock: ManualClock
) -> None:
    register(registry, TaskManagerId("tm-a"))
    clock.advance(BOUND + 1)
    assert registry.heartbeat(TaskManagerId("tm-a"))
    registry.deregister(TaskManagerId("tm-a"))
    assert registry.wait_fenced([TaskManagerId("tm-a")], 0) == []


def test_wait_fenced_returns_the_unfenced_sorted_and_once_each(
    registry: TaskManagerRegistry, clock: ManualClock
) -> None:
    register(registry, TaskManagerId("tm-a"))
    register(registry, TaskManagerId("tm-d"), port=4)
    registry.mark_lost(TaskManagerId("tm-a"), "connection refused")
    # tm-a: lost unfenced; tm-c: never seen (maybe leased by an earlier JobManager); tm-d: registered.
    assert registry.wait_fenced(
        [
            TaskManagerId("tm-d"),
            TaskManagerId("tm-c"),
            TaskManagerId("tm-a"),
            TaskManagerId("tm-c"),
            TaskManagerId("tm-a"),
        ],
        0,
    ) == [TaskManagerId("tm-a"), TaskManagerId("tm-c")]
    assert registry.wait_fenced([], 0) == []
    clock.advance(BOUND)
    assert registry.wait_fenced([TaskManagerId("tm-d"), TaskManagerId("tm-c"), TaskManagerId("tm-a")], 0) == []


def test_wait_fenced_wakes_when_the_taskmanager_registers_again(registry: TaskManagerRegistry) -> None:
    register(registry, TaskManagerId("tm-a"))
    registry.mark_lost(TaskManagerId("tm-a"), "connection refused")
    w = waiter(registry, [TaskManagerId("tm-a")], 60_000)
    register(registry, TaskManagerId("tm-a"))
    w.join(5)
    assert not w.is_alive() and w.result == []


def test_wait_fenced_follows_the_manual_clock_to_the_bound(registry: TaskManagerRegistry, clock: ManualClock) -> None:
    register(registry, TaskManagerId("tm-a"))
    registry.mark_lost(TaskManagerId("tm-a"), "connection refused")
    w = waiter(registry, [TaskManagerId("tm-a")], 60_000)
    clock.advance(BOUND)
    w.join(5)
    assert not w.is_alive() and w.result == []


def test_wait_fenced_gives_up_at_its_timeout_naming_the_unfenced(
    registry: TaskManagerRegistry, clock: ManualClock
) -> None:
    register(registry, TaskManagerId("tm-a"))
    register(registry, TaskManagerId("tm-b"), port=2)
    registry.mark_lost(TaskManagerId("tm-a"), "connection refused")
    w = waiter(registry, [TaskManagerId("tm-a"), TaskManagerId("tm-b")], 1_000)
    clock.advance(1_000)
    w.join(5)
    assert not w.is_alive() and w.result == [TaskManagerId("tm-a")]


def test_wait_fenced_ends_early_when_closed(registry: TaskManagerRegistry) -> None:
    register(registry, TaskManagerId("tm-a"))
    registry.mark_lost(TaskManagerId("tm-a"), "connection refused")
    closed = threading.Event()
    w = waiter(registry, [TaskManagerId("tm-a")], 60_000, closed)
    closed.set()
    w.join(5)
    assert not w.is_alive() and w.result == [TaskManagerId("tm-a")]


def test_routing_tables_carry_the_strictest_limits_the_taskmanagers_reported() -> None:
    from keyedstate.jobmanager.jobs import strictest_limits
    from keyedstate.jobmanager.registry import ReportedLimits

    a = ReportedLimits(max_key_bytes=100, max_value_bytes=1000, max_list_elements=10)
    b = ReportedLimits(max_key_bytes=200, max_value_bytes=500)  # no list limit reported
    assert strictest_limits([a, b, None]) == ReportedLimits(
        max_key_bytes=100, max_value_bytes=500, max_list_elements=10
    )
    assert strictest_limits([None]) == ReportedLimits()  # nothing known: the client checks nothing
