"""Leadership with fencing over a plain file system: the newest session wins.

Each JobManager that starts on an HA directory creates ``leader/session-<n>`` with the next
free ``n`` (create-only, so two starting at once cannot take the same number). A JobManager
that later sees a session newer than its own has been replaced (a restarted pod while the old
one still runs, an operator starting a second one by mistake) and must stop writing at once:
the HA stores call :meth:`LeadershipLease.check` before every durable write, and a background
check stops the process within ``high-availability.filesystem.lease-check-interval``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
from collections.abc import Callable

from keyedstate.common.errors import Reason, UnavailableError
from keyedstate.common.storage import CheckpointStorage

logger = logging.getLogger(__name__)

_SESSION = re.compile(r"^session-(\d{12})$")
_KEEP_OLD_SESSIONS = 3  # older session files are deleted; a few stay for post-mortems


class LeadershipLostError(UnavailableError):
    """A newer JobManager took over this HA directory; this one must stop."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason=Reason.UNAVAILABLE)


class LeadershipLease:
    def __init__(self, storage: CheckpointStorage, directory: str, address: str) -> None:
        self._storage = storage
        self._dir = directory.rstrip("/")
        self._address = address
        self.session = 0
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sessions(self) -> list[int]:
        out = []
        for info in self._storage.list(self._dir):
            m = _SESSION.match(info.path.rstrip("/").rsplit("/", 1)[-1])
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def acquire(self, address: str | None = None) -> int:
        """Take the next session number; returns it.

        ``address`` (the JobManager's, recorded in the session file for operators) replaces the one
        given at construction: a JobManager knows it only once its server is bound.
        """
        if address is not None:
            self._address = address
        record = json.dumps({"address": self._address, "host": socket.gethostname(), "pid": os.getpid()}).encode()
        while True:
            sessions = self._sessions()
            n = (sessions[-1] if sessions else 0) + 1
            try:
                self._storage.create_exclusive(f"{self._dir}/session-{n:012d}", record)
            except FileExistsError:
                continue  # another JobManager took n at the same moment; the next one is ours to try
            self.session = n
            for old in sessions[:-_KEEP_OLD_SESSIONS]:
                self._storage.delete(f"{self._dir}/session-{old:012d}")
            logger.info("high availability: leadership session %d at %s", n, self._dir)
            return n

    def check(self) -> None:
        """Raise LeadershipLostError if a newer session exists."""
        if self._lost is None:
            sessions = self._sessions()
            if sessions and sessions[-1] > self.session:
                self._lost = (
                    f"JobManager session {self.session} was replaced by session {sessions[-1]} in {self._dir}; "
                    "only one JobManager may use a high-availability directory (check for a second JobManager "
                    "with the same high-availability.storageDir and cluster-id)"
                )
        if self._lost is not None:
            raise LeadershipLostError(self._lost)

    def watch(self, interval_ms: int, on_lost: Callable[[str], None]) -> None:
        """Check in the background; call ``on_lost(message)`` once when leadership is gone."""

        def loop() -> None:
            while not self._stop.wait(interval_ms / 1000.0):
                try:
                    self.check()
                except LeadershipLostError as exc:
                    logger.error("%s", exc.message)
                    on_lost(exc.message)
                    return
                except Exception as exc:  # storage hiccup: keep serving, check again later
                    logger.warning("high availability: lease check failed: %s", exc)

        self._thread = threading.Thread(target=loop, name="jm-ha-lease", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the watcher thread; the session stays until a newer JobManager starts one."""
        self._stop.set()
