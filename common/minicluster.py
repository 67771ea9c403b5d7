"""A local cluster of real processes: one JobManager and N TaskManagers on 127.0.0.1.

Used by the main job, the multi-process tests and the benchmarks, like Flink's MiniCluster,
except that every daemon is its own OS process, so it can be killed with SIGKILL (or paused
with SIGSTOP: :meth:`DaemonProcess.pause`).

A ``placement`` hook puts daemons elsewhere than 127.0.0.1: called with a daemon's name
(``"jobmanager"``, ``"taskmanager-0"``, ...), it returns a :class:`Placement`, the command prefix
to start it under (such as ``ip netns exec NS``) and the address it binds and advertises. The
network-partition tests use it to run each daemon in its own network namespace
(``tests/fixtures/netns.py``).
"""

from __future__ import annotations

import logging
import os
import signal as signals
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keyedstate.common.errors import UnavailableError

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Placement:
    """Where one daemon of a :class:`MiniCluster` runs."""

    host: str = "127.0.0.1"
    """The address the daemon binds and advertises (``jobmanager.rpc.address`` and
    ``jobmanager.bind-host``, or ``taskmanager.host`` and ``taskmanager.bind-host``)."""
    command_prefix: tuple[str, ...] = ()
    """Prepended to the daemon's command line, e.g. ``("ip", "netns", "exec", "ns1")``; the
    prefix must exec the daemon (keep its pid), so that signals reach the daemon itself."""


PlacementFn = Callable[[str], Placement]
"""Maps a daemon name (``"jobmanager"``, ``"taskmanager-<i>"``) to its :class:`Placement`."""


@dataclass
class DaemonProcess:
    name: str
    args: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    address: str = ""

    _ready: threading.Event | None = field(default=None, init=False, repr=False)
    _failed: bool = field(default=False, init=False, repr=False)

    def start(self, env: dict[str, str], timeout_s: float = 60.0) -> None:
        """Launch the process and block until it prints `` serving on <address>`` (kept in :attr:`address`).

        If it exits first or takes longer than ``timeout_s`` seconds, it is killed and UnavailableError
        is raised with the tail of its log.
        """
        self.launch(env)
        self.wait_started(timeout_s)

    def launch(self, env: dict[str, str]) -> None:
        """Start the process without waiting for it (then :meth:`wait_started`): daemons start side by side."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # The child keeps its own descriptor for stderr; the parent's copy closes at once.
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.args, stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True
            )
        ready = self._ready = threading.Event()
        self._failed = False

        def read_stdout() -> None:
            assert self.process is not None and self.process.stdout is not None
            for raw in self.process.stdout:
                line = raw.decode(errors="replace").strip()
                if " serving on " in line and not ready.is_set():
                    self.address = line.rsplit(" ", 1)[-1]
                    ready.set()
            if not ready.is_set():
                self._failed = True
                ready.set()

        threading.Thread(target=read_stdout, name=f"{self.name}-stdout", daemon=True).start()

    def wait_started(self, timeout_s: float = 60.0) -> None:
        """Block until the launched process serves; kills it and raises UnavailableError (its log's tail) if it
        exits first or takes longer than ``timeout_s`` seconds."""
        assert self._ready is not None, "launch() first"
        if not self._ready.wait(timeout_s) or self._failed:
            self.kill()
            tail = self.log_tail()
            raise UnavailableError(f"{self.name} did not start within {timeout_s:.0f} s; log {self.log_path}:\n{tail}")

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the daemon's stderr log; empty if the log cannot be read."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        """True while the process exists and has not exited (a paused process is alive)."""
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        """Send signal ``sig`` to the daemon; a no-op when it is not running."""
        if self.alive:
            assert self.process is not None
            os.kill(self.process.pid, sig)

    def pause(self) -> None:
        """SIGSTOP: the process hangs (as on a stalled host) until :meth:`resume`; a pause is not a crash."""
        self.signal(signals.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        self.signal(signals.SIGCONT)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Paused inside the ``with`` block, resumed on leaving it (also on an error)."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def kill(self) -> None:
        """SIGKILL: no clean-up, as a crash."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait(timeout=30)

    def terminate(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM and wait for the clean shutdown; SIGKILL if it does not come."""
        return self.wait_terminated(timeout_s) if self.send_terminate() else self._returncode()

    def send_terminate(self) -> bool:
        """SIGTERM once (then :meth:`wait_terminated`); False when no process runs, so there is nothing to wait for."""
        if self.process is None or self.process.poll() is not None:
            return False
        self.process.terminate()
        return True

    def wait_terminated(self, timeout_s: float = 30.0) -> int | None:
        """After :meth:`send_terminate`: wait for the clean shutdown; SIGKILL if it does not come in ``timeout_s``."""
        assert self.process is not None
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s ignored SIGTERM for %.0f s; killing it", self.name, timeout_s)
            self.process.kill()
            self.process.wait(timeout=30)
        return self.process.returncode

    def _returncode(self) -> int | None:
        return self.process.returncode if self.process is not None else None


class MiniCluster:
    """Start, kill and restart a JobManager and TaskManagers as real processes."""

    def __init__(
        self,
        base_dir: Path,
        num_taskmanagers: int = 2,
        slots_per_taskmanager: int = 4,
        backend: str = "rocksdb",
        config: dict[str, Any] | None = None,
        jobmanager_port: int | None = None,
        placement: PlacementFn | None = None,
        client_token: str | None = None,
    ) -> None:
        """``placement`` (optional) says where each daemon runs; without it all run on 127.0.0.1.

        ``client_token``: the token the MiniCluster's own calls (waiting for TaskManagers) carry
        on a cluster with security.auth.enabled; None: the environment's (KEYEDSTATE_TOKEN...)."""
        self.base_dir = Path(base_dir)
        self.num_taskmanagers = num_taskmanagers
        self.slots = slots_per_taskmanager
        self.backend = backend
        self.config = {str(k): str(v) for k, v in (config or {}).items()}
        # In another network namespace the port is free anyway; 127.0.0.1's answer does no harm.
        self.jobmanager_port = jobmanager_port or free_port()
        self.placement = placement
        self.client_token = client_token
        self.jobmanager: DaemonProcess | None = None
        self.taskmanagers: list[DaemonProcess] = []

    def placement_of(self, daemon: str) -> Placement:
        """The :class:`Placement` of daemon ``daemon`` (``"jobmanager"``, ``"taskmanager-<i>"``)."""
        return self.placement(daemon) if self.placement is not None else Placement()

    @property
    def jobmanager_address(self) -> str:
        """``host:port`` of the JobManager's RPC endpoint, what a StateClient connects to."""
        return f"{self.placement_of('jobmanager').host}:{self.jobmanager_port}"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _overrides(self, extra: dict[str, str]) -> list[str]:
        merged = {
            "jobmanager.rpc.address": self.placement_of("jobmanager").host,
            "jobmanager.rpc.port": str(self.jobmanager_port),
            "metrics.reporter.prom.port": "0",
            "rest.port": "-1",
            # A placement puts daemons on addresses of network namespaces the test made itself:
            # a trusted network, so protected mode (which wants TLS beyond loopback) stands aside.
            **({"security.protected-mode": "false"} if self.placement is not None else {}),
            **self.config,
            **extra,
        }
        out: list[str] = []
        for k, v in merged.items():
            out += ["-D", f"{k}={v}"]
        return out

    def start(
        self, jm_env: Mapping[str, str] | None = None, tm_env: Mapping[int, Mapping[str, str]] | None = None
    ) -> MiniCluster:
        """Start the JobManager and every TaskManager, and wait until all registered; returns self.

        ``jm_env`` and ``tm_env`` (by TaskManager index) add environment variables to one daemon
        (e.g. a crash point, common/faults.py). Call :meth:`stop` (or use the cluster as a context
        manager) so that no daemon outlives the test. If one does not start, every daemon started is
        killed and UnavailableError raised.
        """
        # Side by side: each daemon spends about a second importing and starting its children, and a
        # TaskManager that is up first retries its registration until the JobManager answers.
        tm_env = tm_env or {}
        self.jobmanager = self._jobmanager()
        self.jobmanager.launch({**self._env(), **(jm_env or {})})
        for i in range(self.num_taskmanagers):
            self.taskmanagers.append(self._taskmanager(i))
            self.taskmanagers[-1].launch({**self._env(), **tm_env.get(i, {})})
        try:
            self.jobmanager.wait_started()
            for tm in self.taskmanagers:
                tm.wait_started()
            self.wait_for_taskmanagers(self.num_taskmanagers)
        except BaseException:
            self.kill_all()
            raise
        return self

    def start_jobmanager(self, env: dict[str, str] | None = None) -> None:
        """Start the JobManager process; ``env`` adds variables (e.g. a crash point, common/faults.py)."""
        self.jobmanager = self._jobmanager()
        self.jobmanager.start({**self._env(), **(env or {})})

    def _jobmanager(self) -> DaemonProcess:
        where = self.placement_of("jobmanager")
        # Bound to its own address only with a placement, so the default command line is unchanged.
        extra = {"jobmanager.bind-host": where.host} if self.placement is not None else {}
        return DaemonProcess(
            "jobmanager",
            [*where.command_prefix, sys.executable, "-m", "keyedstate.jobmanager", *self._overrides(extra)],
            self.base_dir / "log" / "jobmanager.log",
        )

    def _taskmanager(self, i: int) -> DaemonProcess:
        where = self.placement_of(f"taskmanager-{i}")
        extra = {
            "taskmanager.host": where.host,
            "taskmanager.rpc.port": "0",
            "taskmanager.numberOfTaskSlots": str(self.slots),
            "taskmanager.resource-id": f"tm-{i}",
            "state.backend.type": self.backend,
            "state.backend.rocksdb.localdir": str(self.base_dir / f"tm-{i}"),
        }
        if self.placement is not None:
            extra["taskmanager.bind-host"] = where.host
        return DaemonProcess(
            f"taskmanager-{i}",
            [*where.command_prefix, sys.executable, "-m", "keyedstate.taskmanager", *self._overrides(extra)],
            self.base_dir / "log" / f"taskmanager-{i}.log",
        )

    def restart_taskmanager(self, i: int) -> None:
        """Start a new process for TaskManager ``i`` (same resource id and local directory).

        Does not stop the old one: kill or terminate it first.
        """
        tm = self._taskmanager(i)
        tm.start(self._env())
        self.taskmanagers[i] = tm

    def restart_jobmanager(self, env: dict[str, str] | None = None) -> None:
        """SIGKILL the JobManager if it runs (a crash, not a clean stop) and start a new one with ``env``."""
        if self.jobmanager is not None and self.jobmanager.alive:
            self.jobmanager.kill()
        self.start_jobmanager(env)

    def wait_for_taskmanagers(self, count: int, timeout_s: float = 60.0) -> None:
        """Block until ``count`` TaskManagers have registered with the JobManager, at most ``timeout_s`` seconds."""
        from keyedstate.common.client import ClientSettings, StateClient, client_security
        from keyedstate.common.config import Configuration

        # The cluster's own security.ssl.rest.* keys: a TLS cluster is asked over TLS.
        security = client_security(Configuration(self.config))
        with StateClient(
            self.jobmanager_address, ClientSettings(timeout_s=5, max_attempts=1), security, token=self.client_token
        ) as client:
            client.wait_for_taskmanagers(count, timeout_s=timeout_s)

    def stop(self) -> None:
        """SIGTERM every daemon (TaskManagers first) and wait for clean shutdowns; SIGKILL any that take over 30 s."""
        # The TaskManagers close their backends and child processes side by side, as they started.
        stopping = [tm for tm in self.taskmanagers if tm.send_terminate()]
        for tm in stopping:
            tm.wait_terminated()
        if self.jobmanager is not None:
            self.jobmanager.terminate()

    def kill_all(self) -> None:
        """SIGKILL every daemon (TaskManagers first): a crash of the whole cluster, no clean-up."""
        for tm in self.taskmanagers:
            tm.kill()
        if self.jobmanager is not None:
            self.jobmanager.kill()

    def __enter__(self) -> MiniCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
