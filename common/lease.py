"""TaskManager leases: a TaskManager serves only while the JobManager vouches for it.

The numbers, and why they make "one owner per key group" hold (docs/exactly-once.md, Clock
bounds):

* A heartbeat the TaskManager sent at ``s`` (its own clock) and that the JobManager answered
  ``known`` extends the lease to ``s + L``, with ``L = min(LEASE_FRACTION × heartbeat.timeout,
  LEASE_HEARTBEATS × heartbeat.interval)``: long enough to ride out a few late heartbeats, short
  enough that a TaskManager that died (and is not restarted) frees its key groups soon.
* The JobManager counts from when it *received* that heartbeat (never before ``s``) and treats
  the lease as certainly over only ``lease_bound(L) = L × (1 + ρ) / (1 - ρ)`` later, where ρ is
  the largest relative difference of the two clocks' rates we allow (10%; real clocks differ by
  parts per million). So the TaskManager stops serving before the JobManager may give its key
  groups to anyone else.
* ``lease_bound(L) <= 0.978 × heartbeat.timeout``: a TaskManager declared lost because its
  heartbeats stopped is always already fenced.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from keyedstate.common.errors import Reason, UnavailableError

logger = logging.getLogger(__name__)

LEASE_FRACTION = 0.8
"""The lease's length as a share of ``heartbeat.timeout``."""

CLOCK_RATE_BOUND = 0.1
"""ρ: the largest relative difference of clock rates between a TaskManager and the JobManager."""

LEASE_HEARTBEATS = 5
"""At most this many heartbeat intervals: how long a dead TaskManager's key groups wait for a new owner."""

MIN_RENEWALS = 2
"""A lease must outlast this many heartbeat intervals, or one late heartbeat would fence a healthy TaskManager."""


def lease_duration_ms(heartbeat_timeout_ms: int, heartbeat_interval_ms: int) -> int:
    """``L``: how long one answered heartbeat lets a TaskManager serve."""
    return int(min(heartbeat_timeout_ms * LEASE_FRACTION, heartbeat_interval_ms * LEASE_HEARTBEATS))


def lease_bound_ms(duration_ms: int) -> int:
    """How long after receiving a heartbeat the JobManager waits before the lease it granted is certainly over."""
    return math.ceil(duration_ms * (1 + CLOCK_RATE_BOUND) / (1 - CLOCK_RATE_BOUND))


class LeaseCell(Protocol):
    """Where a lease keeps its expiry (boottime milliseconds; 0: revoked or never granted)."""

    def load(self) -> int: ...

    def store(self, until_ms: int) -> None: ...


class _LocalCell:
    """The expiry in this process only (a TaskManager serving every slot itself)."""

    def __init__(self) -> None:
        self._until = 0

    def load(self) -> int:
        return self._until

    def store(self, until_ms: int) -> None:
        self._until = until_ms


class SharedLeaseCell:
    """The expiry on a shared memory page: the TaskManager daemon writes it, its slot processes read it.

    A slot process serves only while the page says the TaskManager's lease holds, so fencing a
    TaskManager (lease run out or revoked) fences every process serving its slots at the same
    instant: ``CLOCK_BOOTTIME`` is one clock for the whole host. One writer (the daemon, under
    its lease's lock); readers retry while a write is under way (a sequence lock), so a reader
    never sees half of an 8-byte value.
    """

    _LAYOUT = struct.Struct("<Qq")  # sequence (odd while a write is under way), until_ms

    def __init__(self, path: Path, *, create: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, mmap.PAGESIZE)
            self._page = mmap.mmap(fd, mmap.PAGESIZE)
        finally:
            os.close(fd)  # the mapping keeps the page
        self.path = path

    def load(self) -> int:
        while True:
            before, until = self._LAYOUT.unpack_from(self._page, 0)
            if before % 2 == 0 and struct.unpack_from("<Q", self._page, 0)[0] == before:
                return int(until)

    def store(self, until_ms: int) -> None:
        sequence = struct.unpack_from("<Q", self._page, 0)[0]
        struct.pack_into("<Q", self._page, 0, sequence + 1)
        struct.pack_into("<q", self._page, 8, until_ms)
        struct.pack_into("<Q", self._page, 0, sequence + 2)

    def close(self) -> None:
        """Unmap the page (the file stays for the other processes until the daemon removes it)."""
        self._page.close()


class Lease:
    """The TaskManager's side: renewed by answered heartbeats, revoked when the JobManager disowns it.

    ``clock`` returns milliseconds that keep counting while the process is stopped or the
    machine suspended (``Clock.boottime_ms``). Thread-safe; :meth:`check` is one clock read.
    ``cell`` holds the expiry: a :class:`SharedLeaseCell` publishes it to the slot processes;
    a slot process's lease (:meth:`follow`) only reads it.
    """

    def __init__(self, clock: Callable[[], int], cell: LeaseCell | None = None, *, follower: bool = False) -> None:
        self._clock = clock
        self._cell: LeaseCell = cell if cell is not None else _LocalCell()
        self._lock = threading.Lock()
        if follower:
            self._why = "its TaskManager holds no lease from the JobManager (revoked, expired or not registered yet)"
            return
        self._cell.store(0)  # never granted yet
        self._why = "the TaskManager has not registered with a JobManager yet"

    @classmethod
    def follow(cls, clock: Callable[[], int], cell: LeaseCell) -> Lease:
        """A read-only view of the lease another process keeps in ``cell`` (a slot process's)."""
        return cls(clock, cell, follower=True)

    def renew(self, sent_at_ms: int, duration_ms: int) -> None:
        """Extend to ``sent_at_ms + duration_ms`` (``sent_at_ms``: when the answered request was sent)."""
        with self._lock:
            until = sent_at_ms + duration_ms
            if until > self._cell.load():
                self._cell.store(until)

    def revoke(self, why: str) -> None:
        """End the lease now (the JobManager does not know this TaskManager any more)."""
        with self._lock:
            if self._cell.load():
                logger.warning("lease revoked: %s", why)
            self._cell.store(0)
            self._why = why

    def valid(self) -> bool:
        """True if the lease has not expired at this instant (one clock read, no lock)."""
        return self._clock() < self._cell.load()

    def remaining_ms(self) -> int:
        """Milliseconds until the lease expires; 0 once expired, revoked or never granted."""
        return max(0, self._cell.load() - self._clock())

    def check(self, what: str) -> None:
        """Raise ``UnavailableError`` (reason LEASE_EXPIRED) unless the lease is valid now."""
        if self._clock() < self._cell.load():
            return
        raise UnavailableError(
            f"this TaskManager stopped serving ({self._why_expired()}): {what} refused so that no two TaskManagers "
            "serve the same key groups; refresh the routing table from the JobManager and retry",
            reason=Reason.LEASE_EXPIRED,
        )

    def check_after(self, what: str) -> None:
        """After a call applied: raise (reason OUTCOME_UNKNOWN) if the lease ran out meanwhile.

        The caller must not take the call as acknowledged: a new owner of its key groups may
        already serve them without what it applied here.
        """
        if self._clock() < self._cell.load():
            return
        raise UnavailableError(
            f"this TaskManager's lease ran out while {what} ran ({self._why_expired()}); it may have been applied here, "
            "where it will not count: its outcome is unknown",
            reason=Reason.OUTCOME_UNKNOWN,
        )

    def _why_expired(self) -> str:
        with self._lock:
            return self._why if self._cell.load() == 0 else "no heartbeat answered by the JobManager within the lease"
