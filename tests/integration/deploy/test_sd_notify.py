"""Readiness through sd_notify: real daemon processes report READY=1 to a datagram socket only once they serve.

The units in deploy/systemd are ``Type=notify``: systemd counts a daemon as started (and starts
what is ordered after it) when READY=1 arrives on ``$NOTIFY_SOCKET``. Here the test plays
systemd: it binds the datagram socket, starts the daemon with the variable set, and the moment
READY=1 arrives asks the daemon's gRPC port for its health without waiting for it to come up.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from keyedstate.common.minicluster import free_port

NO_PORTS = ["-D", "metrics.reporter.prom.port=0", "-D", "rest.port=-1"]


@dataclass
class NotifySocket:
    """The systemd end of sd_notify: a bound datagram socket and the messages it received."""

    path: Path
    sock: socket.socket
    messages: list[dict[str, str]] = field(default_factory=list)

    def receive(self, timeout_s: float) -> dict[str, str]:
        self.sock.settimeout(timeout_s)
        raw = self.sock.recv(4096).decode()
        message = dict(line.split("=", 1) for line in raw.splitlines() if "=" in line)
        self.messages.append(message)
        return message

    def until(self, key: str, timeout_s: float = 60.0) -> dict[str, str]:
        while True:
            message = self.receive(timeout_s)
            if key in message:
                return message


@contextlib.contextmanager
def _bound_socket(tag: str) -> Iterator[NotifySocket]:
    # AF_UNIX paths are limited to 108 bytes: pytest's tmp_path can be longer.
    path = Path(f"/tmp/ks-notify-{tag}-{os.getpid()}-{time.monotonic_ns()}.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    try:
        yield NotifySocket(path, sock)
    finally:
        sock.close()
        path.unlink(missing_ok=True)


@pytest.fixture
def notify_socket() -> Iterator[NotifySocket]:
    with _bound_socket("jm") as notify:
        yield notify


def _start(module: str, args: list[str], notify: NotifySocket, tmp_path: Path, **env: str) -> subprocess.Popen[bytes]:
    log = open(tmp_path / f"{module.rsplit('.', 1)[-1]}.log", "ab")  # noqa: SIM115 - the child keeps it
    environ = {**os.environ, "NOTIFY_SOCKET": str(notify.path), "PYTHONUNBUFFERED": "1", **env}
    with log:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args, *NO_PORTS], stdout=subprocess.DEVNULL, stderr=log, env=environ
        )


def _serving_now(address: str, service: str = "") -> bool:
    """One health call that does not wait for the port: True only if the server answers SERVING right now."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5, wait_for_ready=False
            )
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _stop(process: subprocess.Popen[bytes]) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        raise


@pytest.fixture
def second_notify_socket() -> Iterator[NotifySocket]:
    with _bound_socket("tm") as notify:
        yield notify


def _wait_serving(address: str, service: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not _serving_now(address, service):
        assert time.monotonic() < deadline, f"{address} did not serve within {timeout_s:g} s"
        time.sleep(0.2)


def test_ready_arrives_only_once_the_daemons_serve_and_stopping_on_sigterm(
    notify_socket: NotifySocket, second_notify_socket: NotifySocket, tmp_path: Path
) -> None:
    jm_port, tm_port = free_port(), free_port()
    tm_notify = second_notify_socket
    # The TaskManager first: it serves its port, then waits to register with a JobManager that is
    # not there yet. Its start is not complete, so READY=1 must not come (deterministically: a
    # daemon that reported before or during its start would report now).
    tm = _start(
        "keyedstate.taskmanager",
        [
            "-D",
            f"jobmanager.rpc.port={jm_port}",
            "-D",
            f"taskmanager.rpc.port={tm_port}",
            "-D",
            f"state.backend.rocksdb.localdir={tmp_path / 'tm'}",
        ],
        tm_notify,
        tmp_path,
        WATCHDOG_USEC="1000000",  # WatchdogSec=1s: a WATCHDOG=1 every half second
    )
    jm: subprocess.Popen[bytes] | None = None
    try:
        _wait_serving(f"127.0.0.1:{tm_port}", "keyedstate.v1.KeyedState")
        with pytest.raises(TimeoutError):
            tm_notify.receive(timeout_s=2.0)
        assert tm.poll() is None

        jm = _start(
            "keyedstate.jobmanager",
            ["-D", f"jobmanager.rpc.port={jm_port}", "-D", f"state.checkpoints.dir={(tmp_path / 'chk').as_uri()}"],
            notify_socket,
            tmp_path,
        )
        ready = notify_socket.until("READY", timeout_s=60)
        # Checked the moment READY=1 arrives, without waiting for the port to come up.
        assert _serving_now(f"127.0.0.1:{jm_port}"), "READY=1 arrived before the JobManager's port served"
        assert ready == {"READY": "1", "MAINPID": str(jm.pid), "STATUS": f"serving on 127.0.0.1:{jm_port}"}

        tm_ready = tm_notify.until("READY", timeout_s=60)  # registered now
        assert tm_ready["STATUS"] == f"serving on 127.0.0.1:{tm_port}" and tm_ready["MAINPID"] == str(tm.pid)
        assert _serving_now(f"127.0.0.1:{tm_port}", "keyedstate.v1.KeyedState")
        pings = [tm_notify.until("WATCHDOG", timeout_s=5) for _ in range(3)]
        assert all(p == {"WATCHDOG": "1"} for p in pings)
        assert _stop(tm) == 0
        tm_stopping = tm_notify.until("STOPPING", timeout_s=10)
        assert tm_stopping["STOPPING"] == "1" and "SIGTERM" in tm_stopping["STATUS"]

        assert _stop(jm) == 0
        stopping = notify_socket.until("STOPPING", timeout_s=10)
        assert stopping["STOPPING"] == "1" and "SIGTERM" in stopping["STATUS"]
        assert [m for m in notify_socket.messages if "READY" in m] == [ready]  # READY once
        assert not any("WATCHDOG" in m for m in notify_socket.messages)  # no WATCHDOG_USEC, no pings
    finally:
        for process in (tm, jm):
            if process is not None and process.poll() is None:
                process.kill()


def test_a_daemon_that_cannot_serve_never_reports_ready(notify_socket: NotifySocket, tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        jm = _start("keyedstate.jobmanager", ["-D", f"jobmanager.rpc.port={port}"], notify_socket, tmp_path)
        try:
            assert jm.wait(timeout=60) == 2
        finally:
            if jm.poll() is None:
                jm.kill()
    failed = notify_socket.until("STATUS", timeout_s=5)
    assert "READY" not in failed and failed["STATUS"].startswith("failed to start:")
    assert str(port) in failed["STATUS"]
