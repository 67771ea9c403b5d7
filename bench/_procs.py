"""Helper processes of the benchmarks (redis-server, moto_server): stopping them the same way."""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
    """SIGTERM, then SIGKILL if it has not exited within 10 s."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
