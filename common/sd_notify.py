"""systemd's readiness protocol (sd_notify(3)): READY=1, STOPPING=1, STATUS= and the watchdog.

A unit with ``Type=notify`` counts the daemon as started only when ``READY=1`` arrives on the
datagram socket named by ``$NOTIFY_SOCKET``, so units ordered ``After=`` it (and ``systemctl
start`` itself) wait until the gRPC port serves, not merely until the process exists. With
``WatchdogSec=`` systemd restarts a daemon whose main loop stops sending ``WATCHDOG=1``.

Outside systemd (no ``$NOTIFY_SOCKET``) every call is a no-op. The protocol is a few lines of
socket code, so no library is added for it.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import MutableMapping

from keyedstate.common.clock import Clock, SystemClock

logger = logging.getLogger(__name__)

_ENVIRONMENT = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class SystemdNotifier:
    """Sends sd_notify messages to one socket; never raises (a lost notification must not stop a daemon)."""

    def __init__(self, socket_path: str | None, watchdog_interval_ms: int = 0, clock: Clock | None = None) -> None:
        self._address = _socket_address(socket_path) if socket_path else None
        self._watchdog_interval_ms = watchdog_interval_ms if self._address else 0
        self._clock = clock or SystemClock()
        self._last_ping_ms: int | None = None
        self._stopping = False
        self._warned = False

    @classmethod
    def from_environment(
        cls, environ: MutableMapping[str, str] | None = None, clock: Clock | None = None
    ) -> SystemdNotifier:
        """The notifier systemd asked for, taking its variables out of ``environ`` (``os.environ``).

        They are removed so that the processes a daemon starts (the TaskManager's transfer
        processes) do not inherit a socket that speaks for the main process.
        """
        env = os.environ if environ is None else environ
        values = {name: env.pop(name, "") for name in _ENVIRONMENT}
        interval_ms = 0
        pid = values["WATCHDOG_PID"]
        if values["WATCHDOG_USEC"].isdigit() and (not pid or pid == str(os.getpid())):
            interval_ms = int(values["WATCHDOG_USEC"]) // 1000
        return cls(values["NOTIFY_SOCKET"] or None, interval_ms, clock)

    @property
    def enabled(self) -> bool:
        """True when started by systemd with a notify socket."""
        return self._address is not None

    def ready(self, status: str) -> None:
        """The daemon serves: ``READY=1`` with a status line for ``systemctl status``."""
        self._send(f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}")
        self._last_ping_ms = self._clock.monotonic_ms()

    def stopping(self, status: str = "stopping") -> None:
        """Shutdown began (sent once): systemd waits for the exit instead of counting it a crash."""
        if self._stopping:
            return
        self._stopping = True
        self._send(f"STOPPING=1\nSTATUS={status}")

    def status(self, status: str) -> None:
        """A free-form status line shown by ``systemctl status``."""
        self._send(f"STATUS={status}")

    def watchdog(self) -> None:
        """Send ``WATCHDOG=1`` when half of ``WatchdogSec`` passed since the last one; call it from the main loop."""
        if not self._watchdog_interval_ms or self._last_ping_ms is None or self._stopping:
            return
        now = self._clock.monotonic_ms()
        if now - self._last_ping_ms >= self._watchdog_interval_ms // 2:
            self._send("WATCHDOG=1")
            self._last_ping_ms = now

    def _send(self, message: str) -> None:
        if self._address is None:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(message.encode(), self._address)
        except OSError as exc:
            if not self._warned:  # once: a socket that is gone stays gone
                self._warned = True
                logger.warning("cannot notify systemd through NOTIFY_SOCKET: %s", exc)


def _socket_address(path: str) -> str | bytes:
    """``@name`` is a socket in the abstract namespace (a leading NUL byte), as sd_notify(3) reads it."""
    if path.startswith("@"):
        return b"\0" + path[1:].encode()
    return path
