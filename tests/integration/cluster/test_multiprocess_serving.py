"""Issue-level test: real JobManager and TaskManager processes serving 100k keys of every kind."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from keyedstate.common.client import ClientSettings, ListState, MapState, StateClient, ValueState
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.minicluster import MiniCluster

N_KEYS = 100_000


def _operators() -> list[OperatorSpec]:
    return [
        OperatorSpec(
            "sessions",
            4,
            (
                StateDescriptor("last", StateKind.VALUE),
                StateDescriptor("events", StateKind.LIST),
                StateDescriptor("attrs", StateKind.MAP),
            ),
        ),
        OperatorSpec("totals", 4, (StateDescriptor("total", StateKind.VALUE),)),
    ]


@pytest.mark.parametrize("backend", ["rocksdb", "hashmap"])
def test_two_taskmanager_processes_serve_100k_keys(process_cluster: Callable[..., MiniCluster], backend: str) -> None:
    cluster = process_cluster(taskmanagers=2, slots=4, backend=backend)
    rnd = random.Random(7)
    keys = [f"user-{i}-{rnd.getrandbits(32):08x}" for i in range(N_KEYS)]
    with StateClient(cluster.jobmanager_address, ClientSettings(timeout_s=30)) as client:
        routing = client.submit_job("multi", _operators())
        # 2 operators x 4 subtasks spread over both TaskManagers, contiguous key-group ranges.
        for op in ("sessions", "totals"):
            assert routing.operator(op).parallelism == 4
            assert len(set(routing.operator(op).addresses)) == 2
        overview = client.cluster()
        assert overview.total_slots == 8 and overview.free_slots == 0

        last = ValueState[str, int](client, "multi", "sessions", "last", value_serializer="int")
        events = ListState[str, str](client, "multi", "sessions", "events", value_serializer="str")
        attrs = MapState[str, str, Any](
            client, "multi", "sessions", "attrs", user_key_serializer="str", value_serializer="json"
        )
        totals = ValueState[str, float](client, "multi", "totals", "total", value_serializer="float")

        last.put_many(keys, list(range(N_KEYS)))
        totals.put_many(keys, [i * 0.5 for i in range(N_KEYS)])
        events.append_many(keys, [f"a{i}" for i in range(N_KEYS)])
        events.append_many(keys, [f"b{i}" for i in range(N_KEYS)])
        attrs.put_many(keys, ["country"] * N_KEYS, [{"n": i} for i in range(N_KEYS)])
        attrs.put_many(keys[:1000], ["plan"] * 1000, ["pro"] * 1000)

        assert last.get_many(keys) == list(range(N_KEYS))
        assert totals.get_many(keys) == [i * 0.5 for i in range(N_KEYS)]
        assert events.get_many(keys) == [[f"a{i}", f"b{i}"] for i in range(N_KEYS)]
        assert attrs.get_many(keys, ["country"] * N_KEYS) == [{"n": i} for i in range(N_KEYS)]
        assert dict(attrs.items(keys[0])) == {"country": {"n": 0}, "plan": "pro"}
        assert attrs.get_many(keys[1000:1010], ["plan"] * 10) == [None] * 10
        # Every key is found again by a full scan across the four subtasks.
        assert set(totals.keys()) == set(keys)


def test_sigusr1_dumps_every_thread_and_the_daemon_goes_on(process_cluster: Callable[..., MiniCluster]) -> None:
    # The tool for a daemon that stopped answering: its threads' stacks, without stopping it.
    import os
    import signal
    import time

    cluster = process_cluster(taskmanagers=1, slots=1)
    jm = cluster.jobmanager
    assert jm is not None and jm.process is not None
    os.kill(jm.process.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 10
    log = ""
    while time.monotonic() < deadline and "most recent call first" not in log:
        time.sleep(0.1)
        log = jm.log_path.read_text(errors="replace")
    assert "most recent call first" in log and "Thread 0x" in log, log[-2000:]
    with StateClient(cluster.jobmanager_address, ClientSettings(timeout_s=10)) as client:
        assert len(client.cluster().taskmanagers) == 1
