"""Crash points: let a test kill a real process with SIGKILL at an exact line.

Kill tests must hit windows a few microseconds wide ("after ``_metadata`` is written, before
anything else"), which no outside timing can hit reliably. Production code marks such places
with :func:`crash_point`; a test starts the process with ``KEYEDSTATE_CRASH_AT=<name>[@<n>]``
and the process SIGKILLs itself the n-th time (default the first) it passes that point, exactly
as ``kill -9`` from outside would. Without the variable a crash point costs one dict lookup.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

logger = logging.getLogger(__name__)

ENV = "KEYEDSTATE_CRASH_AT"


def _parse(spec: str) -> dict[str, int]:
    points: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, nth = item.partition("@")
        points[name] = int(nth) if nth else 1
    return points


_armed = _parse(os.environ.get(ENV, ""))
_seen: dict[str, int] = {}
_lock = threading.Lock()


def crash_point(name: str) -> None:
    """SIGKILL this process here if the environment armed ``name`` (see the module docstring)."""
    if not _armed or name not in _armed:
        return
    with _lock:
        _seen[name] = _seen.get(name, 0) + 1
        if _seen[name] != _armed[name]:
            return
    # Say where, so the test log shows it; then die the way kill -9 kills, no cleanup at all.
    print(f"crash point {name} reached (#{_armed[name]}): SIGKILL", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
