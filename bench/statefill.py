"""Shared plumbing of the state-size scenarios (checkpoint, restore, memory).

* :func:`moto_s3` runs moto's S3 server as its own process on 127.0.0.1, so its CPU use does
  not share the benchmark's GIL.
* :func:`single_slot_cluster` starts a real JobManager and one real TaskManager process.
* :class:`StateFiller` writes a deterministic key space of fixed-size random values through
  the executor client, and knows how much it wrote.
* :class:`RssSampler` samples a process's RSS in the background and keeps the peak.
* :class:`ServingLoad` keeps a client busy with batched gets and puts and counts keys/s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._procs import stop_process
from keyedstate.common.client import ClientSettings, StateClient, ValueState
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.minicluster import MiniCluster, free_port

logger = logging.getLogger(__name__)

ACCESS_KEY = "bench"
SECRET_KEY = "bench"
REGION = "us-east-1"
KEY_BYTES = 16
CHUNK_KEYS = 10_000
"""Keys per generated chunk; chunk ``i`` is always the same keys and (per version) values."""


@dataclass(frozen=True)
class S3Endpoint:
    url: str
    bucket: str
    pid: int

    @property
    def config(self) -> dict[str, str]:
        """The ``s3.*`` keys of the runtime for this endpoint."""
        return {
            "s3.endpoint": self.url,
            "s3.access-key": ACCESS_KEY,
            "s3.secret-key": SECRET_KEY,
            "s3.region": REGION,
            "s3.path.style.access": "true",
        }

    def s3fs(self) -> Any:
        """A plain s3fs file system on the endpoint (the baselines' client)."""
        import s3fs

        return s3fs.S3FileSystem(
            key=ACCESS_KEY,
            secret=SECRET_KEY,
            endpoint_url=self.url,
            client_kwargs={"region_name": REGION},
            skip_instance_cache=True,
            use_listings_cache=False,
            config_kwargs={"s3": {"addressing_style": "path"}},
        )

    def clear(self, prefix: str = "") -> None:
        """Delete every object (under ``prefix``): moto keeps them in this machine's memory."""
        fs = self.s3fs()
        root = f"{self.bucket}/{prefix}".rstrip("/")
        try:
            found = fs.find(root)
        except FileNotFoundError:
            return
        if found:
            fs.rm(found)


@contextlib.contextmanager
def moto_s3(workdir: Path, *, nice: int = 10) -> Iterator[S3Endpoint]:
    """moto's S3 server in its own process on a free loopback port, with one empty bucket.

    ``nice`` lowers the server's CPU priority: a real S3 spends no CPU of the TaskManager's
    host, but here the server shares the machine's two cores with the system under test.
    """
    binary = Path(sys.executable).with_name("moto_server")
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "moto.log", "ab") as log:
        env = {**os.environ, "TMPDIR": str(workdir)}  # spilled object bodies go to the scenario's workdir

        def lower_priority() -> None:
            os.nice(nice)

        proc = subprocess.Popen(
            [str(binary), "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=log,
            env=env,
            preexec_fn=lower_priority if nice else None,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                        break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"moto_server did not start on port {port}; see {workdir / 'moto.log'}"
                        ) from None
                    time.sleep(0.1)
            endpoint = S3Endpoint(f"http://127.0.0.1:{port}", "bench", proc.pid)
            endpoint.s3fs().call_s3("create_bucket", Bucket=endpoint.bucket)
            yield endpoint
        finally:
            stop_process(proc)


class _BenchCluster(MiniCluster):
    """A MiniCluster whose daemons get extra environment variables (MALLOC_ARENA_MAX ...)."""

    def __init__(self, *args: Any, env: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._extra_env = dict(env or {})

    def _env(self) -> dict[str, str]:
        return {**super()._env(), **self._extra_env}


@contextlib.contextmanager
def single_slot_cluster(base: Path, config: dict[str, Any], env: dict[str, str] | None = None) -> Iterator[MiniCluster]:
    """A JobManager and ONE TaskManager with one RocksDB slot, each its own process."""
    conf = {"heartbeat.timeout": "60 s", "heartbeat.interval": "2 s", **config}
    cluster = _BenchCluster(base, num_taskmanagers=1, slots_per_taskmanager=1, backend="rocksdb", config=conf, env=env)
    cluster.start()
    try:
        yield cluster
    finally:
        try:
            cluster.stop()
        finally:
            cluster.kill_all()


JOB = "bench"
OPERATOR = "op"
STATE = "v"


def submit(
    client: StateClient, *, job_id: str = JOB, restore_path: str = "", config: dict[str, Any] | None = None
) -> ValueState[bytes, bytes]:
    """Submit the one-slot job with one ValueState of raw bytes; return its handle."""
    ops = [OperatorSpec(OPERATOR, 1, (StateDescriptor(STATE, StateKind.VALUE),))]
    client.submit_job(
        job_id,
        ops,
        max_parallelism=128,
        restore_path=restore_path,
        config={k: str(v) for k, v in (config or {}).items()},
    )
    return ValueState(client, job_id, OPERATOR, STATE, key_serializer="bytes", value_serializer="bytes")


def bench_client(address: str) -> StateClient:
    return StateClient(address, ClientSettings(timeout_s=120.0, max_attempts=3, batch_size=1000, max_in_flight=4))


class StateFiller:
    """A deterministic key space: chunk ``i`` holds ``CHUNK_KEYS`` keys of 16 random bytes.

    Version ``v`` of a chunk's values is random too (incompressible, so SST bytes are state
    bytes). The filler only generates bytes; writing goes through the executor client.
    """

    def __init__(self, seed: int, value_bytes: int) -> None:
        self.seed = seed
        self.value_bytes = value_bytes
        self.chunks = 0

    @property
    def keys_written(self) -> int:
        return self.chunks * CHUNK_KEYS

    @property
    def bytes_written(self) -> int:
        return self.keys_written * (KEY_BYTES + self.value_bytes)

    def keys(self, chunk: int) -> list[bytes]:
        raw = random.Random(self.seed * 1_000_003 + chunk).randbytes(KEY_BYTES * CHUNK_KEYS)
        return [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]

    def values(self, chunk: int, version: int = 0, n: int = CHUNK_KEYS) -> list[bytes]:
        size = self.value_bytes
        raw = random.Random((self.seed * 7919 + chunk) * 131 + version).randbytes(size * n)
        return [raw[i : i + size] for i in range(0, len(raw), size)]

    def fill_to(self, state: ValueState[bytes, bytes], total_bytes: int) -> float:
        """Write chunks until about ``total_bytes`` of keys and values are stored; returns seconds."""
        t0 = time.perf_counter()
        while self.bytes_written < total_bytes:
            state.put_many(self.keys(self.chunks), self.values(self.chunks))
            self.chunks += 1
        return time.perf_counter() - t0

    def rewrite_fraction(self, state: ValueState[bytes, bytes], fraction: float, version: int) -> int:
        """Give a new value to the first ``fraction`` of every chunk's keys; returns keys changed."""
        per_chunk = max(1, int(CHUNK_KEYS * fraction))
        changed = 0
        for chunk in range(self.chunks):
            keys = self.keys(chunk)[:per_chunk]
            state.put_many(keys, self.values(chunk, version, per_chunk))
            changed += len(keys)
        return changed


@dataclass
class RssSampler:
    """Samples the RSS of one process and its descendants every ``interval_s`` on a daemon thread; keeps peak and series.

    Descendants count: a TaskManager's checkpoint transfer processes are part of its footprint.
    """

    pid: int
    interval_s: float = 0.05
    peak: int = 0
    samples: list[tuple[float, int]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> int:
        import psutil

        proc = psutil.Process(self.pid)
        rss: int = proc.memory_info().rss  # psutil publishes no types
        for child in proc.children(recursive=True):
            try:
                rss += child.memory_info().rss
            except psutil.NoSuchProcess:  # a transfer process replaced between the listing and the read
                pass
        self.peak = max(self.peak, rss)
        self.samples.append((time.monotonic(), rss))
        return rss

    def start(self) -> RssSampler:
        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                try:
                    self.sample()
                except Exception:  # the process exited
                    return

        self._thread = threading.Thread(target=loop, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


class ServingLoad:
    """Batched multi-gets over the whole key space and multi-puts over the ``hot`` prefix of
    each chunk, from one client thread; counts keys served."""

    def __init__(
        self, state: ValueState[bytes, bytes], filler: StateFiller, hot_fraction: float, batch: int = 1000
    ) -> None:
        self.state = state
        self.filler = filler
        self.batch = batch
        self.hot = max(1, int(CHUNK_KEYS * hot_fraction))
        self.keys_done = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rnd = random.Random(filler.seed + 17)
        self._cache: dict[int, list[bytes]] = {}

    def _chunk_keys(self, chunk: int) -> list[bytes]:
        keys = self._cache.get(chunk)
        if keys is None:
            if len(self._cache) > 64:
                self._cache.clear()
            keys = self._cache[chunk] = self.filler.keys(chunk)
        return keys

    def _loop(self) -> None:
        value = bytes(self.filler.value_bytes)
        version = 0
        while not self._stop.is_set():
            chunk = self._rnd.randrange(self.filler.chunks)
            keys = self._chunk_keys(chunk)
            start = self._rnd.randrange(0, len(keys) - self.batch)
            try:
                got = self.state.get_many(keys[start : start + self.batch])
                if any(v is None for v in got):
                    raise AssertionError("a stored key read back as missing")
                hot_start = self._rnd.randrange(0, max(1, self.hot - self.batch))
                hot = keys[hot_start : hot_start + min(self.batch, self.hot)]
                version += 1
                self.state.put_many(hot, [value] * len(hot))
            except BaseException as exc:  # reported by stop(); the benchmark must not hide a failure
                self.errors.append(exc)
                return
            self.keys_done += self.batch + len(hot)

    def start(self) -> ServingLoad:
        self._thread = threading.Thread(target=self._loop, name="serving-load", daemon=True)
        self._thread.start()
        return self

    def rate_during(self, seconds: float) -> float:
        """keys/s over the next ``seconds`` (the load must be running)."""
        k0, t0 = self.keys_done, time.perf_counter()
        time.sleep(seconds)
        return (self.keys_done - k0) / (time.perf_counter() - t0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
        if self.errors:
            raise RuntimeError(f"the serving load failed: {self.errors[0]!r}") from self.errors[0]


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


class TaskManagerMetrics:
    """Reads the TaskManager's Prometheus endpoint (the daemons get a port range; the
    JobManager takes the first free port, the TaskManager the next)."""

    def __init__(self, first_port: int, span: int = 20) -> None:
        self.ports = range(first_port, first_port + span)
        self._port: int | None = None

    @staticmethod
    def port_range() -> tuple[int, str]:
        first = free_port()
        return first, f"{first}-{first + 19}"

    def _fetch(self, port: int) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text: str = answer.read().decode()
            return text

    def scrape(self) -> dict[str, float]:
        """Every sample of the TaskManager, by name (labels dropped; one slot, so no clash)."""
        from prometheus_client.parser import text_string_to_metric_families

        if self._port is None:
            for port in self.ports:
                try:
                    text = self._fetch(port)
                except OSError:
                    continue
                if "keyedstate_taskmanager_slots " in text:
                    self._port = port
                    break
            else:
                raise RuntimeError(f"no TaskManager metrics endpoint on ports {self.ports.start}-{self.ports.stop - 1}")
        text = self._fetch(self._port)
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
        return out

    def wait_quiet(self, timeout_s: float = 600.0, settle: int = 2) -> float:
        """Wait until RocksDB runs no flush or compaction for ``settle`` polls; returns seconds waited."""
        prefix = "flink_taskmanager_job_task_operator_column_family_rocksdb_"
        t0 = time.monotonic()
        quiet = 0
        while quiet < settle:
            m = self.scrape()
            busy = m.get(prefix + "num_running_compactions", 0) + m.get(prefix + "num_running_flushes", 0)
            quiet = quiet + 1 if busy == 0 else 0
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"RocksDB still compacting after {timeout_s:.0f} s")
            if quiet < settle:
                time.sleep(0.25)
        return time.monotonic() - t0
