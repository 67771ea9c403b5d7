"""Helpers for whole-system checkpoint tests: a workload over every state kind, its Python
reference, storage inspection, and clusters whose checkpoints go to file:// or S3 (moto).

Everything is real: in-process JobManager and TaskManagers (``inprocess_cluster``), real
RocksDB/HashMap backends, real storage. The reference dict is the oracle: whatever the
cluster returns after a restore must equal it exactly, keys the checkpoint does not hold included.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from keyedstate.common.client import ListState, MapState, ReducingState, StateClient, ValueState
from keyedstate.common.config import Configuration
from keyedstate.common.descriptors import (
    NumberType,
    OperatorSpec,
    ReduceField,
    ReduceFunction,
    StateDescriptor,
    StateKind,
)
from keyedstate.common.ids import JobId
from keyedstate.common.storage import CheckpointStorage, open_storage
from keyedstate.jobmanager.checkpoint import CheckpointMetadata
from tests.fixtures.cluster import PATIENT, InProcessCluster
from tests.fixtures.s3 import ACCESS_KEY, REGION, SECRET_KEY

JOB = JobId("orders")
OPERATOR = "sessions"
MAX_P = 128

STATES = (
    StateDescriptor("last", StateKind.VALUE),
    StateDescriptor("events", StateKind.LIST),
    StateDescriptor("attrs", StateKind.MAP),
    StateDescriptor(
        "totals",
        StateKind.REDUCING,
        reduce_fields=(
            ReduceField("count"),
            ReduceField("peak", ReduceFunction.MAX, NumberType.FLOAT64),
        ),
    ),
)


def operators(parallelism: int, operator_id: str = OPERATOR) -> list[OperatorSpec]:
    return [OperatorSpec(operator_id, parallelism, STATES)]


@dataclass
class Reference:
    """What the job's state must be: one dict per state, key -> value."""

    last: dict[str, int] = field(default_factory=dict)
    events: dict[str, list[str]] = field(default_factory=dict)
    attrs: dict[str, dict[str, Any]] = field(default_factory=dict)
    totals: dict[str, tuple[int, float]] = field(default_factory=dict)

    def copy(self) -> Reference:
        return Reference(
            dict(self.last),
            {k: list(v) for k, v in self.events.items()},
            {k: dict(v) for k, v in self.attrs.items()},
            dict(self.totals),
        )

    def num_keys(self) -> int:
        return len(set(self.last) | set(self.events) | set(self.attrs) | set(self.totals))


class Workload:
    """Writes every state kind of one operator through the client, mirroring it in a Reference."""

    def __init__(self, client: StateClient, job_id: str = JOB, operator_id: str = OPERATOR, seed: int = 1) -> None:
        self.client = client
        self.job_id = job_id
        self.operator_id = operator_id
        self.rnd = random.Random(seed)
        self.reference = Reference()

    def _handles(
        self,
    ) -> tuple[ValueState[str, int], ListState[str, str], MapState[str, str, Any], ReducingState[str]]:
        c, j, op = self.client, self.job_id, self.operator_id
        return (
            ValueState(c, j, op, "last", value_serializer="int"),
            ListState(c, j, op, "events", value_serializer="str"),
            MapState(c, j, op, "attrs", user_key_serializer="str", value_serializer="json"),
            ReducingState(c, j, op, "totals"),
        )

    def write(self, keys: list[str], tag: str) -> None:
        """One round of updates: puts, appends, map puts and removes, reduces, and clears."""
        ref, rnd = self.reference, self.rnd
        last, events, attrs, totals = self._handles()
        values = [rnd.randrange(1 << 40) for _ in keys]
        last.put_many(keys, values)
        ref.last.update(zip(keys, values))
        elements = [f"{tag}-{k}-{rnd.randrange(1000)}" for k in keys]
        events.append_many(keys, elements)
        for k, e in zip(keys, elements):
            ref.events.setdefault(k, []).append(e)
        map_keys = keys[::3]
        user_keys = [rnd.choice(("country", "plan", "device", "lang")) for _ in map_keys]
        map_values = [{"tag": tag, "n": rnd.randrange(100)} for _ in map_keys]
        attrs.put_many(map_keys, user_keys, map_values)
        for k, uk, v in zip(map_keys, user_keys, map_values):
            ref.attrs.setdefault(k, {})[uk] = v
        gone = [k for k in map_keys[::4] if k in ref.attrs]
        gone_uk = [next(iter(ref.attrs[k])) for k in gone]
        attrs.remove_many(gone, gone_uk)
        for k, uk in zip(gone, gone_uk):
            del ref.attrs[k][uk]
            if not ref.attrs[k]:
                del ref.attrs[k]
        operands = [(1, round(rnd.uniform(0, 1000), 3)) for _ in keys]
        totals.add_many(keys, operands)
        for k, (n, peak) in zip(keys, operands):
            old = ref.totals.get(k)
            ref.totals[k] = (n, peak) if old is None else (old[0] + n, max(old[1], peak))
        cleared = keys[::7]
        last.clear_many(cleared)
        for k in cleared:
            ref.last.pop(k, None)

    def read(self) -> Reference:
        """The job's state as the cluster serves it, found by scanning every subtask (no key list given)."""
        last, events, attrs, totals = self._handles()
        out = Reference()
        # One state of each kind, each read into its own typed dict of the Reference.
        pairs: list[tuple[Any, dict[str, Any]]] = [
            (last, out.last),
            (events, out.events),
            (attrs, out.attrs),
            (totals, out.totals),
        ]
        for handle, target in pairs:
            keys = list(handle.keys())
            assert len(keys) == len(set(keys)), f"state {handle.name!r}: a key is served by two subtasks"
            if handle is attrs:
                for k in keys:
                    target[k] = dict(attrs.items(k))
            else:
                target.update(zip(keys, handle.get_many(keys)))
        out.events = {k: list(v) for k, v in out.events.items()}
        out.totals = {k: tuple(v) for k, v in out.totals.items()}  # type: ignore[misc]
        return out


def assert_state_equals(actual: Reference, expected: Reference) -> None:
    """Exact equality per state, with a short diff on failure."""
    for name in ("last", "events", "attrs", "totals"):
        got, want = getattr(actual, name), getattr(expected, name)
        if got != want:
            missing = sorted(set(want) - set(got))[:5]
            extra = sorted(set(got) - set(want))[:5]
            wrong = sorted(k for k in set(got) & set(want) if got[k] != want[k])[:5]
            pytest.fail(
                f"state {name!r} differs: {len(want)} keys expected, {len(got)} served; missing {missing}, "
                f"unexpected {extra}, wrong values for {[(k, got[k], want[k]) for k in wrong]}"
            )


def key_names(n: int, prefix: str = "user") -> list[str]:
    return [f"{prefix}-{i:06d}" for i in range(n)]


# -- storage inspection ---------------------------------------------------------------------------


def relative_files(storage: CheckpointStorage, root: str) -> set[str]:
    """Every file below ``root``, as paths relative to it."""
    root = root.rstrip("/")
    return {info.path[len(root) + 1 :] for info in storage.list(root, recursive=True)}


def read_metadata(storage: CheckpointStorage, checkpoint_dir: str) -> CheckpointMetadata:
    return CheckpointMetadata.from_json(storage.read_bytes(f"{checkpoint_dir}/_metadata"), source=checkpoint_dir)


def referenced_files(metadata: CheckpointMetadata, checkpoint_name: str) -> set[str]:
    """The files ``_metadata`` references, relative to the job directory (``chk-2/x``, ``shared/y``)."""
    out = set()
    for _, _, f in metadata.files():
        out.add(f.path[3:] if f.path.startswith("../") else f"{checkpoint_name}/{f.path}")
    return out


def wait_until(
    predicate: Callable[[], bool], what: str, timeout_s: float = 10.0, state: Callable[[], Any] | None = None
) -> None:
    """Wait for work another thread finishes on its own (deletions, late uploads); fail naming
    ``what`` and showing ``state()``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}" + (f"; now: {state()}" if state else ""))
        time.sleep(0.02)


def wait_for_files(
    storage: CheckpointStorage,
    root: str,
    expected: set[str],
    what: str,
    flush: Callable[[], object] = lambda: None,
    timeout_s: float = 10.0,
) -> None:
    """Wait until the files below ``root`` are exactly ``expected``; fail listing the difference."""

    def done() -> bool:
        flush()
        return relative_files(storage, root) == expected

    def diff() -> str:
        now = relative_files(storage, root)
        return f"unexpected {sorted(now - expected)}, missing {sorted(expected - now)}"

    wait_until(done, what, timeout_s, diff)


# -- a network that can stall -------------------------------------------------------------------


class GatedProxy:
    """A loopback TCP proxy to ``target`` that holds every byte while its gate is closed.

    Pointing one daemon's ``s3.endpoint`` at it stalls exactly that daemon's storage calls, for
    real and for as long as a test needs, without touching the code under test.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.gate = threading.Event()
        self.gate.set()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="gated-proxy", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                self.gate.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed.set()
        self.gate.set()
        self._server.close()
        for s in self._sockets:
            s.close()


@pytest.fixture
def gated_s3(s3_bucket: tuple[str, str]) -> Iterator[tuple[GatedProxy, str, str]]:
    """``(proxy, real endpoint, bucket)``: the proxy forwards to the moto server."""
    endpoint, bucket = s3_bucket
    host, port = endpoint.removeprefix("http://").split(":")
    proxy = GatedProxy((host, int(port)))
    try:
        yield proxy, endpoint, bucket
    finally:
        proxy.close()


# -- clusters on file:// and S3 -------------------------------------------------------------------


def s3_keys(endpoint: str) -> dict[str, Any]:
    return {
        "s3.endpoint": endpoint,
        "s3.access-key": ACCESS_KEY,
        "s3.secret-key": SECRET_KEY,
        "s3.region": REGION,
        "s3.path.style.access": True,
    }


@dataclass
class CheckpointCluster:
    """An in-process cluster plus the storage and directories its checkpoints use."""

    cluster: InProcessCluster
    storage: CheckpointStorage
    checkpoints_dir: str
    config: dict[str, Any]
    """Storage keys (``s3.*``) a second reader such as statectl needs."""

    def job_dir(self, job_id: str = JOB) -> str:
        return f"{self.checkpoints_dir}/{job_id}"

    def client(self) -> StateClient:
        return self.cluster.client(timeout_s=30.0)

    def coordinator(self, job_id: JobId = JOB) -> Any:
        return self.cluster.jobmanager.dispatcher.job(job_id).coordinator

    def flush_deletions(self, job_id: JobId = JOB) -> None:
        """Wait for the JobManager's checkpoint cleaner to finish what it queued."""
        assert self.coordinator(job_id).cleaner.flush(timeout=30), "checkpoint deletions did not finish"


@pytest.fixture
def checkpoint_cluster(
    inprocess_cluster: Callable[..., InProcessCluster], request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[..., CheckpointCluster]]:
    """Factory: ``checkpoint_cluster(storage="file"|"s3", backend=..., jm={...}, tm={...})``.

    ``storage="s3"`` puts checkpoints in a fresh moto bucket (the ``s3_bucket`` fixture).
    """

    def make(
        storage: str = "file",
        backend: str = "rocksdb",
        *,
        taskmanagers: int = 2,
        slots: int = 4,
        jm: dict[str, Any] | None = None,
        tm: dict[str, Any] | None = None,
    ) -> CheckpointCluster:
        if storage == "s3":
            endpoint, bucket = request.getfixturevalue("s3_bucket")
            config = s3_keys(endpoint)
            checkpoints_dir = f"s3://{bucket}/checkpoints"
        else:
            config = {}
            checkpoints_dir = (tmp_path / "checkpoints").as_uri()
        cluster = inprocess_cluster(
            taskmanagers=taskmanagers,
            slots=slots,
            backend=backend,
            jm={"state.checkpoints.dir": checkpoints_dir, **config, **PATIENT, **(jm or {})},
            tm={**config, **(tm or {})},
        )
        store = open_storage(checkpoints_dir, Configuration(config))
        return CheckpointCluster(cluster, store, checkpoints_dir, config)

    yield make
