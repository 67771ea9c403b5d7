"""A throwaway ``redis-server`` on 127.0.0.1 for the Redis baselines.

Debian's ``redis-server`` is installed by ``make bench`` (apt). It runs with persistence off
(``--save "" --appendonly no``), which is the fastest Redis can be and has no durability:
the comparison is generous to Redis.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from bench._procs import stop_process
from keyedstate.common.minicluster import free_port


class RedisUnavailable(RuntimeError):
    """redis-server (or the redis Python package) is not installed."""


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[int]:
    """Start redis-server on a free loopback port; yield the port; stop it afterwards."""
    binary = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None
    )
    if binary is None:
        raise RedisUnavailable(
            "redis-server is not installed; `make bench` installs it with `apt-get install -y redis-server`"
        )
    try:
        import redis
    except ImportError as exc:  # pragma: no cover - the bench extra has it
        raise RedisUnavailable("the redis package is missing; pip install -e '.[bench]'") from exc
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            "--protected-mode",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        import redis

        client = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RedisUnavailable(f"redis-server did not start on port {port}") from None
                time.sleep(0.05)
        client.close()
        yield port
    finally:
        stop_process(proc)
