"""When a job entered its statuses: what Flink's ``uptime``, ``downtime`` and ``restartingTime`` are made of."""

from __future__ import annotations

import threading

from keyedstate.common.clock import SYSTEM_CLOCK, Clock
from keyedstate.common.lifecycle import JobStatus

NO_LONGER_RUNNING = -1
"""What Flink's job gauges report for a job in a terminal status."""


class JobStatusTimes:
    """A job's status changes on the monotonic clock, read by the job metrics; thread-safe.

    Semantics as Flink's ``UpTimeGauge``, ``DownTimeGauge`` and ``RestartTimeGauge``, in milliseconds.
    """

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._status: JobStatus | None = None
        self._running_since = -1
        self._outage_since = -1  # when the job last left RUNNING for RESTARTING (the outage's start)
        self._restart_since = -1  # when the current restart began (-1: none under way)
        self._last_restart_ms = 0
        self._started_wall_ms = -1  # wall clock: Flink's start-time and end-time are timestamps
        self._ended_wall_ms = -1

    def enter(self, status: JobStatus) -> None:
        """The job is in ``status`` from now on (a repeat of the current status changes nothing)."""
        now = self._clock.monotonic_ms()
        with self._lock:
            if status is self._status:
                return
            self._status = status
            if self._started_wall_ms < 0:
                self._started_wall_ms = self._clock.now_ms()
            # A terminal status ends the job; a resubmission under the same id is a new record.
            self._ended_wall_ms = self._clock.now_ms() if status.terminal else -1
            if status is JobStatus.RUNNING:
                self._running_since = now
                self._outage_since = -1
                if self._restart_since >= 0:
                    self._last_restart_ms = now - self._restart_since
                    self._restart_since = -1
            elif status is JobStatus.RESTARTING:
                self._restart_since = now
                if self._outage_since < 0:
                    self._outage_since = now

    def uptime_ms(self) -> int:
        """Time since the job last started RUNNING; 0 while not running, -1 once terminal."""
        with self._lock:
            if self._status is JobStatus.RUNNING:
                return self._clock.monotonic_ms() - self._running_since
            return NO_LONGER_RUNNING if self._status is not None and self._status.terminal else 0

    def downtime_ms(self) -> int:
        """Time of the current outage (RESTARTING since it left RUNNING); 0 while running, -1 once terminal."""
        with self._lock:
            if self._status is not None and self._status.terminal:
                return NO_LONGER_RUNNING
            if self._status is JobStatus.RUNNING or self._outage_since < 0:
                return 0
            return self._clock.monotonic_ms() - self._outage_since

    def restarting_time_ms(self) -> int:
        """Time the restart under way has taken so far, or else the duration of the last restart (0: none yet)."""
        with self._lock:
            if self._restart_since >= 0 and self._status is JobStatus.RESTARTING:
                return self._clock.monotonic_ms() - self._restart_since
            return self._last_restart_ms

    def wall_span_ms(self) -> tuple[int, int]:
        """When this JobManager first knew the job, and when it ended (-1: not ended), in ms since the epoch."""
        with self._lock:
            return self._started_wall_ms, self._ended_wall_ms
