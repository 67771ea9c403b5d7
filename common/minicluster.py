"""A local cluster of real processes: one JobManager and N TaskManagers on 127.0.0.1.

Used by the main job, the multi-process tests and the benchmarks, like Flink's MiniCluster,
except that every daemon is its own OS process, so it can be killed with SIGKILL.
"""

from __future__ import annotations

import logging
import os

import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from keyedstate.common.errors import UnavailableError

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class DaemonProcess:
    name: str
    args: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    address: str = ""
    _log: IO[bytes] | None = field(default=None, repr=False)

    def start(self, env: dict[str, str], timeout_s: float = 60.0) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=self._log, env=env, start_new_session=True
        )
        ready = threading.Event()
        failure: list[str] = []

        def read_stdout() -> None:
            assert self.process is not None and self.process.stdout is not None
            for raw in self.process.stdout:
                line = raw.decode(errors="replace").strip()
                if " serving on " in line and not ready.is_set():
                    self.address = line.rsplit(" ", 1)[-1]
                    ready.set()
            if not ready.is_set():
                failure.append("exited")
                ready.set()

        threading.Thread(target=read_stdout, name=f"{self.name}-stdout", daemon=True).start()
        if not ready.wait(timeout_s) or failure:
            self.kill()
            tail = self.log_tail()
            raise UnavailableError(f"{self.name} did not start within {timeout_s:.0f} s; log {self.log_path}:\n{tail}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            assert self.process is not None
            os.kill(self.process.pid, sig)

    def kill(self) -> None:
        """SIGKILL: no clean-up, as a crash."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait(timeout=30)
        self._close_log()

    def terminate(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM and wait for the clean shutdown; SIGKILL if it does not come."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s ignored SIGTERM for %.0f s; killing it", self.name, timeout_s)
                self.process.kill()
                self.process.wait(timeout=30)
        self._close_log()
        return self.process.returncode

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


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
    ) -> None:
        self.base_dir = Path(base_dir)
        self.num_taskmanagers = num_taskmanagers
        self.slots = slots_per_taskmanager
        self.backend = backend
        self.config = {str(k): str(v) for k, v in (config or {}).items()}
        self.jobmanager_port = jobmanager_port or free_port()
        self.jobmanager: DaemonProcess | None = None
        self.taskmanagers: list[DaemonProcess] = []

    @property
    def jobmanager_address(self) -> str:
        return f"127.0.0.1:{self.jobmanager_port}"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _overrides(self, extra: dict[str, str]) -> list[str]:
        merged = {
            "jobmanager.rpc.address": "127.0.0.1",
            "jobmanager.rpc.port": str(self.jobmanager_port),
            "metrics.reporter.prom.port": "0",
            "rest.port": "-1",
            **self.config,
            **extra,
        }
        out: list[str] = []
        for k, v in merged.items():
            out += ["-D", f"{k}={v}"]
        return out

    def start(self) -> MiniCluster:
        self.start_jobmanager()
        for i in range(self.num_taskmanagers):
            self.taskmanagers.append(self._taskmanager(i))
            self.taskmanagers[-1].start(self._env())
        self.wait_for_taskmanagers(self.num_taskmanagers)
        return self

    def start_jobmanager(self, env: dict[str, str] | None = None) -> None:
        """Start the JobManager process; ``env`` adds variables (e.g. a crash point, common/faults.py)."""
        self.jobmanager = DaemonProcess(
            "jobmanager",
            [sys.executable, "-m", "keyedstate.jobmanager", *self._overrides({})],
            self.base_dir / "log" / "jobmanager.log",
        )
        self.jobmanager.start({**self._env(), **(env or {})})

    def _taskmanager(self, i: int) -> DaemonProcess:
        extra = {
            "taskmanager.host": "127.0.0.1",
            "taskmanager.rpc.port": "0",
            "taskmanager.numberOfTaskSlots": str(self.slots),
            "taskmanager.resource-id": f"tm-{i}",
            "state.backend.type": self.backend,
            "state.backend.rocksdb.localdir": str(self.base_dir / f"tm-{i}"),
        }
        return DaemonProcess(
            f"taskmanager-{i}",
            [sys.executable, "-m", "keyedstate.taskmanager", *self._overrides(extra)],
            self.base_dir / "log" / f"taskmanager-{i}.log",
        )

    def restart_taskmanager(self, i: int) -> None:
        tm = self._taskmanager(i)
        tm.start(self._env())
        self.taskmanagers[i] = tm

    def restart_jobmanager(self, env: dict[str, str] | None = None) -> None:
        if self.jobmanager is not None and self.jobmanager.alive:
            self.jobmanager.kill()
        self.start_jobmanager(env)

    def wait_for_taskmanagers(self, count: int, timeout_s: float = 60.0) -> None:
        from keyedstate.common.client import ClientSettings, StateClient

        deadline = time.monotonic() + timeout_s
        with StateClient(self.jobmanager_address, ClientSettings(timeout_s=5, max_attempts=1)) as client:
            while True:
                try:
                    active = [t for t in client.cluster().taskmanagers if t.status == "ACTIVE"]
                    if len(active) >= count:
                        return
                except Exception:
                    pass
                if time.monotonic() > deadline:
                    raise UnavailableError(f"only some of {count} TaskManagers registered within {timeout_s:.0f} s")
                time.sleep(0.1)

    def stop(self) -> None:
        for tm in self.taskmanagers:
            tm.terminate()
        if self.jobmanager is not None:
            self.jobmanager.terminate()

    def kill_all(self) -> None:
        for tm in self.taskmanagers:
            tm.kill()
        if self.jobmanager is not None:
            self.jobmanager.kill()

    def __enter__(self) -> MiniCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


