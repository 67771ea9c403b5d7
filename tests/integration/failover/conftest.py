"""Clusters of real processes for the failover proofs, with checkpoints in a real S3 API server.

``failover_cluster(taskmanagers=3, slots=2, config={...})`` starts a JobManager and TaskManagers
as OS processes on 127.0.0.1 (``process_cluster``'s MiniCluster) with incremental checkpoints in
a fresh moto bucket. Each TaskManager reaches S3 through its own :class:`HttpProxy`, so a test
can count one TaskManager's storage reads or slow down its uploads; the JobManager talks to moto
directly. Everything is SIGKILLed at the end if it did not stop.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from keyedstate.common.client import ClientSettings, StateClient
from keyedstate.common.config import Configuration
from keyedstate.common.minicluster import DaemonProcess, MiniCluster
from keyedstate.common.storage import CheckpointStorage, open_storage
from tests.fixtures.cluster import FAST_HEARTBEATS
from tests.fixtures.proxy import HttpProxy
from tests.fixtures.s3 import ACCESS_KEY, REGION, SECRET_KEY
from tests.integration.failover._support import FIGURES, scrape

DEFAULTS = {
    "execution.checkpointing.incremental": "true",
    "restart-strategy.type": "fixed-delay",
    "restart-strategy.fixed-delay.attempts": "5",
    "restart-strategy.fixed-delay.delay": "100 ms",
}


class _ProxiedMiniCluster(MiniCluster):
    """A MiniCluster whose TaskManager ``i`` uses ``s3_endpoints[i]``."""

    def __init__(self, *args: Any, s3_endpoints: list[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.s3_endpoints = s3_endpoints

    def _taskmanager(self, i: int) -> DaemonProcess:
        daemon = super()._taskmanager(i)
        daemon.args += ["-D", f"s3.endpoint={self.s3_endpoints[i]}"]  # the last -D of a key wins
        return daemon


@dataclass
class FailoverCluster:
    mini: MiniCluster
    proxies: list[HttpProxy]
    storage: CheckpointStorage
    checkpoints_dir: str
    base: Path

    @property
    def address(self) -> str:
        return self.mini.jobmanager_address

    def client(self, **settings: Any) -> StateClient:
        return StateClient(
            self.address, ClientSettings(**{"timeout_s": 30.0, "max_attempts": 3, "backoff_s": 0.05, **settings})
        )

    def job_dir(self, job_id: str) -> str:
        return f"{self.checkpoints_dir}/{job_id}"

    # -- processes ---------------------------------------------------------------------------
    def kill_taskmanager(self, i: int) -> float:
        """SIGKILL TaskManager ``i``; returns the monotonic time of the kill."""
        t = time.monotonic()
        self.mini.taskmanagers[i].kill()
        return t

    def restart_taskmanager(self, i: int) -> None:
        """Start TaskManager ``i`` again: same resource id, same local directory, same S3 proxy."""
        self.mini.restart_taskmanager(i)

    def placement(self, client: StateClient, job_id: str) -> dict[int, int]:
        """subtask index -> index of the TaskManager hosting it, as the JobManager reports slots."""
        return {
            s.subtask_index: int(t.taskmanager_id.removeprefix("tm-"))
            for t in client.cluster().taskmanagers
            for s in t.slots
            if s.job_id == job_id
        }

    def local_dir(self, i: int) -> Path:
        return self.base / f"tm-{i}"

    # -- logs and metrics --------------------------------------------------------------------
    def log_path(self, i: int) -> Path:
        return self.base / "log" / f"taskmanager-{i}.log"

    def log_size(self, i: int) -> int:
        path = self.log_path(i)
        return path.stat().st_size if path.exists() else 0

    def log_since(self, i: int, offset: int) -> str:
        with open(self.log_path(i), "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def wait_for_log(self, i: int, pattern: str, offset: int = 0, timeout_s: float = 30.0) -> re.Match[str]:
        """Watch TaskManager ``i``'s log (from byte ``offset``) for ``pattern``; the match."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        while True:
            match = regex.search(self.log_since(i, offset))
            if match:
                return match
            if time.monotonic() > deadline:
                pytest.fail(f"taskmanager-{i} logged no line matching {pattern!r} within {timeout_s:.0f} s")
            time.sleep(0.01)

    def taskmanager_metrics(self, client: StateClient, i: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """Scrape TaskManager ``i``'s Prometheus endpoint (its port as registered with the JobManager)."""
        tm_id = f"tm-{i}"
        port = next(t.metrics_port for t in client.cluster().taskmanagers if t.taskmanager_id == tm_id)
        assert port > 0, f"{tm_id} registered no metrics port"
        return scrape(port)

    # -- the command line --------------------------------------------------------------------
    def statectl(self, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run the ``statectl`` console script (or ``python -m``) against this cluster."""
        script = Path(sys.executable).parent / "statectl"
        command = [str(script)] if script.exists() else [sys.executable, "-m", "keyedstate.cli.statectl"]
        return subprocess.run(
            [*command, *args, "--jobmanager", self.address],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=dict(os.environ),
        )


@pytest.fixture
def failover_cluster(tmp_path: Path, s3_bucket: tuple[str, str]) -> Iterator[Callable[..., FailoverCluster]]:
    """Factory: ``failover_cluster(taskmanagers=3, slots=2, config={...})``."""
    endpoint, bucket = s3_bucket
    host, port = endpoint.removeprefix("http://").split(":")
    started: list[FailoverCluster] = []

    def make(taskmanagers: int = 3, slots: int = 2, config: dict[str, Any] | None = None) -> FailoverCluster:
        base = tmp_path / f"cluster-{len(started)}"
        s3 = {
            "s3.endpoint": endpoint,
            "s3.access-key": ACCESS_KEY,
            "s3.secret-key": SECRET_KEY,
            "s3.region": REGION,
            "s3.path.style.access": "true",
        }
        checkpoints_dir = f"s3://{bucket}/checkpoints"
        conf = {
            "state.checkpoints.dir": checkpoints_dir,
            **s3,
            **FAST_HEARTBEATS,
            **DEFAULTS,
            **{k: str(v) for k, v in (config or {}).items()},
        }
        proxies = [HttpProxy((host, int(port)), f"s3-tm-{i}") for i in range(taskmanagers)]
        mini = _ProxiedMiniCluster(
            base, taskmanagers, slots, "rocksdb", conf, s3_endpoints=[p.endpoint for p in proxies]
        )
        cluster = FailoverCluster(
            mini, proxies, open_storage(checkpoints_dir, Configuration(s3)), checkpoints_dir, base
        )
        started.append(cluster)
        mini.start()
        return cluster

    yield make
    for cluster in started:
        try:
            # Daemons that are still up get SIGKILL at once: nothing after the test needs a clean stop.
            cluster.mini.kill_all()
        finally:
            for proxy in cluster.proxies:
                proxy.close()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    terminalreporter.section("failover recovery times")
    for name, seconds in FIGURES:
        terminalreporter.write_line(f"{seconds:7.2f} s  {name}")
