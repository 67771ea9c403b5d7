"""A scheduler whose callbacks run only inside ``advance``: timeouts are tested without sleeping."""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable

from tests.fakes.clock import ManualClock


class _Task:
    __slots__ = ("cancelled", "delay_ms", "due_ms", "fn", "seq")

    def __init__(self, due_ms: int, seq: int, fn: Callable[[], None], delay_ms: int) -> None:
        self.due_ms = due_ms
        self.seq = seq
        self.fn = fn
        self.delay_ms = delay_ms
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def __lt__(self, other: _Task) -> bool:
        return (self.due_ms, self.seq) < (other.due_ms, other.seq)


class ManualScheduler:
    """Implements :class:`keyedstate.common.clock.Scheduler` on a :class:`ManualClock`.

    ``schedule`` only records the callback. ``advance(ms)`` moves time forward and runs every
    callback that falls due, in due-time order (ties in scheduling order), on the calling thread;
    callbacks scheduled by callbacks run too if they fall due within the same advance. Pass the
    clock the code under test uses so both agree on "now"; moving that clock directly does not
    run anything until the next ``advance``/``run_due``.
    """

    def __init__(self, clock: ManualClock | None = None) -> None:
        self.clock = clock if clock is not None else ManualClock()
        self._queue: list[_Task] = []
        self._seq = itertools.count()
        self._lock = threading.Lock()

    def schedule(self, delay_ms: int, fn: Callable[[], None]) -> _Task:
        delay = max(0, int(delay_ms))
        with self._lock:
            task = _Task(self.clock.monotonic_ms() + delay, next(self._seq), fn, delay)
            heapq.heappush(self._queue, task)
        return task

    def advance(self, ms: int) -> int:
        """Move time forward by ``ms`` running due callbacks; returns how many ran."""
        if ms < 0:
            raise ValueError(f"time cannot go backwards ({ms} ms)")
        target = self.clock.monotonic_ms() + ms
        ran = 0
        while True:
            task = self._pop_due(target)
            if task is None:
                break
            now = self.clock.monotonic_ms()
            if task.due_ms > now:
                self.clock.advance(task.due_ms - now)
            task.fn()
            ran += 1
        now = self.clock.monotonic_ms()
        if target > now:
            self.clock.advance(target - now)
        return ran

    def run_due(self) -> int:
        """Run what is due now without moving time."""
        return self.advance(0)

    def _pop_due(self, target: int) -> _Task | None:
        with self._lock:
            while self._queue:
                if self._queue[0].cancelled:
                    heapq.heappop(self._queue)
                    continue
                if self._queue[0].due_ms <= target:
                    return heapq.heappop(self._queue)
                return None
            return None

    def pending(self) -> list[int]:
        """Delays (ms from now) of the callbacks still waiting, soonest first."""
        with self._lock:
            now = self.clock.monotonic_ms()
            return [t.due_ms - now for t in sorted(self._queue) if not t.cancelled]

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for t in self._queue if not t.cancelled)
