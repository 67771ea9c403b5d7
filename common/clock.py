"""Injected time: a clock and a scheduler, so timeouts and TTL are tested without sleeping."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

# CLOCK_BOOTTIME counts through suspend (Linux); elsewhere the monotonic clock is the best there is.
_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


class Clock(Protocol):
    def now_ms(self) -> int:
        """Wall-clock milliseconds (timestamps written into state and metadata)."""

    def monotonic_ms(self) -> int:
        """Monotonic milliseconds (durations and timeouts)."""

    def boottime_ms(self) -> int:
        """Milliseconds that keep counting while the process is stopped or the machine sleeps.

        Lease deadlines use it: a TaskManager frozen in a VM suspend must find its lease expired
        when it wakes, and Linux's monotonic clock stops during suspend.
        """


class SystemClock:
    def now_ms(self) -> int:
        """Wall-clock milliseconds since the Unix epoch; jumps when the system clock is set."""
        return time.time_ns() // 1_000_000

    def monotonic_ms(self) -> int:
        """``time.monotonic`` in milliseconds; on Linux it stops during suspend (see :meth:`boottime_ms`)."""
        return time.monotonic_ns() // 1_000_000

    def boottime_ms(self) -> int:
        """``CLOCK_BOOTTIME`` in milliseconds (counts through suspend); the monotonic clock where it is missing."""
        return time.clock_gettime_ns(_BOOTTIME) // 1_000_000


class Cancellable(Protocol):
    def cancel(self) -> None:
        """Stop the callback if it has not started; a no-op once it ran or was cancelled."""


class Scheduler(Protocol):
    def schedule(self, delay_ms: int, fn: Callable[[], None]) -> Cancellable:
        """Run ``fn`` once after ``delay_ms``."""


class ThreadScheduler:
    """Runs scheduled callbacks on daemon timer threads."""

    def schedule(self, delay_ms: int, fn: Callable[[], None]) -> Cancellable:
        """Run ``fn`` once on a new daemon thread after ``delay_ms`` (at once if negative).

        An exception in ``fn`` only reaches ``threading.excepthook``: catch what matters inside ``fn``.
        """
        timer = threading.Timer(max(0, delay_ms) / 1000.0, fn)
        timer.daemon = True
        timer.start()
        return timer


SYSTEM_CLOCK = SystemClock()
