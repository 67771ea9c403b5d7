"""A manual clock for tests: time moves only when a test calls :meth:`ManualClock.advance`."""

from __future__ import annotations

import threading


class ManualClock:
    """Implements :class:`keyedstate.common.clock.Clock`; thread-safe."""

    def __init__(self, now_ms: int = 1_700_000_000_000, monotonic_ms: int = 1_000_000) -> None:
        self._now = now_ms
        self._mono = monotonic_ms
        self._lock = threading.Lock()

    def now_ms(self) -> int:
        with self._lock:
            return self._now

    def monotonic_ms(self) -> int:
        with self._lock:
            return self._mono

    def boottime_ms(self) -> int:
        with self._lock:
            return self._mono

    def advance(self, ms: int) -> None:
        """Move both clocks forward by ``ms`` (never backwards)."""
        if ms < 0:
            raise ValueError(f"a clock only moves forward; got advance({ms})")
        with self._lock:
            self._now += ms
            self._mono += ms

    def set_now_ms(self, now_ms: int) -> None:
        """Set wall-clock time (it may jump, as a real wall clock can); monotonic time is untouched."""
        with self._lock:
            self._now = now_ms
