"""SystemdNotifier against a real datagram socket (the systemd end), with a manual clock for the watchdog."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from keyedstate.common.sd_notify import SystemdNotifier
from tests.fakes.clock import ManualClock


@pytest.fixture
def receiver() -> Iterator[tuple[str, socket.socket]]:
    path = f"/tmp/ks-unit-notify-{os.getpid()}-{id(object())}.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.2)
    try:
        yield path, sock
    finally:
        sock.close()
        Path(path).unlink(missing_ok=True)


def _drain(sock: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except TimeoutError:
            return out


def test_environment_is_taken_so_children_do_not_inherit_it(receiver: tuple[str, socket.socket]) -> None:
    path, sock = receiver
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid()), "OTHER": "x"}
    clock = ManualClock()
    notifier = SystemdNotifier.from_environment(env, clock)
    assert env == {"OTHER": "x"} and notifier.enabled
    notifier.watchdog()  # before READY=1 nothing is due
    notifier.ready("serving on h:1")
    clock.advance(999)
    notifier.watchdog()
    clock.advance(1)
    notifier.watchdog()  # half of WatchdogSec=2s
    notifier.watchdog()  # not due again yet
    notifier.stopping("bye")
    notifier.stopping("again")  # once only
    clock.advance(5000)
    notifier.watchdog()  # stopping: no more pings
    assert _drain(sock) == [
        f"READY=1\nSTATUS=serving on h:1\nMAINPID={os.getpid()}",
        "WATCHDOG=1",
        "STOPPING=1\nSTATUS=bye",
    ]


def test_a_watchdog_meant_for_another_process_is_ignored(receiver: tuple[str, socket.socket]) -> None:
    path, sock = receiver
    clock = ManualClock()
    notifier = SystemdNotifier.from_environment(
        {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}, clock
    )
    notifier.ready("up")
    clock.advance(10_000)
    notifier.watchdog()
    assert _drain(sock) == [f"READY=1\nSTATUS=up\nMAINPID={os.getpid()}"]


def test_abstract_socket_names() -> None:
    name = f"ks-unit-abstract-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(2)
        SystemdNotifier(f"@{name}").status("hello")
        assert sock.recv(100) == b"STATUS=hello"


def test_without_systemd_or_with_its_socket_gone_nothing_fails(caplog: pytest.LogCaptureFixture) -> None:
    quiet = SystemdNotifier.from_environment({})
    assert not quiet.enabled
    quiet.ready("x")
    gone = SystemdNotifier("/tmp/ks-no-such-notify-socket")
    gone.ready("x")
    gone.status("y")
    assert [r.getMessage() for r in caplog.records].count(
        "cannot notify systemd through NOTIFY_SOCKET: [Errno 2] No such file or directory"
    ) == 1
