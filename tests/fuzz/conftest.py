"""The fuzz cluster: a real JobManager and two real TaskManagers (RocksDB and HashMap) in-process.

Before the fuzzer runs, a reference job gets known state; afterwards that state must read back
unchanged, and every daemon must still answer health checks and a write/read round trip.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common._proto.v1 import jobmanager_pb2_grpc as jm_grpc
from keyedstate.common.client import ListState, MapState, StateClient, ValueState
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from tests.fuzz.rpc_harness import Stats, as_dict
from tests.fuzz.world import REF_JOB, REF_OPERATOR, World

REF_KEYS = [f"ref-{i}" for i in range(40)]


def long_seconds() -> float:
    """Time budget of each ``fuzz_long`` test (KEYEDSTATE_FUZZ_SECONDS, default 300)."""
    return float(os.environ.get("KEYEDSTATE_FUZZ_SECONDS", "300"))


def default_examples() -> int:
    """Calls per service in the default run (KEYEDSTATE_FUZZ_EXAMPLES, default 300)."""
    return int(os.environ.get("KEYEDSTATE_FUZZ_EXAMPLES", "300"))


def write_report(name: str, stats: Stats, extra: dict[str, Any] | None = None) -> None:
    """Append the run's counts to $KEYEDSTATE_FUZZ_REPORT (JSON lines), when set."""
    target = os.environ.get("KEYEDSTATE_FUZZ_REPORT")
    if target:
        with open(target, "a", encoding="utf-8") as f:
            f.write(json.dumps({"test": name, **as_dict(stats), **(extra or {})}) + "\n")


@dataclass
class Reference:
    client: StateClient

    def states(self) -> tuple[ValueState[str, str], ListState[str, str], MapState[str, str, str]]:
        c = self.client
        return (
            ValueState(c, REF_JOB, REF_OPERATOR, "v", key_serializer="str", value_serializer="str"),
            ListState(c, REF_JOB, REF_OPERATOR, "l", key_serializer="str", value_serializer="str"),
            MapState(
                c, REF_JOB, REF_OPERATOR, "m", key_serializer="str", user_key_serializer="str", value_serializer="str"
            ),
        )

    def write(self) -> None:
        value, lst, mp = self.states()
        value.put_many(REF_KEYS, [f"value of {k}" for k in REF_KEYS])
        lst.append_many(REF_KEYS + REF_KEYS, [f"{k}#1" for k in REF_KEYS] + [f"{k}#2" for k in REF_KEYS])
        mp.put_many(REF_KEYS, [f"uk-{k}" for k in REF_KEYS], [f"mv-{k}" for k in REF_KEYS])

    def assert_unchanged(self) -> None:
        value, lst, mp = self.states()
        assert value.get_many(REF_KEYS) == [f"value of {k}" for k in REF_KEYS]
        assert lst.get_many(REF_KEYS) == [[f"{k}#1", f"{k}#2"] for k in REF_KEYS]
        assert mp.get_many(REF_KEYS, [f"uk-{k}" for k in REF_KEYS]) == [f"mv-{k}" for k in REF_KEYS]
        for state in (value, lst, mp):
            assert sorted(state.keys()) == sorted(REF_KEYS), "keys appeared in or vanished from the reference job"


@dataclass
class FuzzCluster:
    world: World
    reference: Reference
    addresses: list[str]
    tmp: Path

    def assert_healthy(self) -> None:
        """Every daemon answers its health check; the reference reads back; a new job takes a write.

        The TaskManagers the fuzzer registered (unreachable addresses) are deregistered first:
        until their heartbeat timeout passes the JobManager would place the new job's slots on them.
        """
        rm = jm_grpc.ResourceManagerStub(self.world.channel(self.world.jm_address))
        for tm in self.world.client.cluster().taskmanagers:
            if tm.taskmanager_id not in self.world.tm_ids:
                rm.DeregisterTaskManager(
                    jm_pb.DeregisterTaskManagerRequest(taskmanager_id=tm.taskmanager_id), timeout=10
                )
        for address in self.addresses:
            with grpc.insecure_channel(address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, address
        self.reference.assert_unchanged()
        client = self.world.client
        client.submit_job("after-fuzz", [OperatorSpec("aop", 2, (StateDescriptor("v", StateKind.VALUE),))])
        state: ValueState[str, str] = ValueState(
            client, "after-fuzz", "aop", "v", key_serializer="str", value_serializer="str"
        )
        keys = [f"after-{i}" for i in range(20)]
        state.put_many(keys, keys)
        assert state.get_many(keys) == keys

    def assert_no_stray_files(self) -> None:
        """Generated paths stay in the sandbox; nothing lands in the working directory or beside the cluster."""
        assert not any((self.tmp / "cwd").iterdir()), (
            f"files written relative to the working directory: {list((self.tmp / 'cwd').iterdir())}"
        )
        allowed = {"cwd", "sandbox", "cluster-0"}
        stray = sorted(p.name for p in self.tmp.iterdir() if p.name not in allowed)
        assert not stray, f"files written outside the sandbox: {stray}"


@pytest.fixture
def fuzz_cluster(
    inprocess_cluster: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FuzzCluster]:
    (tmp_path / "cwd").mkdir()
    sandbox = tmp_path / "sandbox" / "a" / "b" / "c"
    sandbox.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "cwd")
    cluster = inprocess_cluster(
        taskmanagers=1,
        slots=8,
        backend="rocksdb",
        jm={"slot.request.timeout": "3 s", "execution.checkpointing.timeout": "10 s"},
    )
    cluster.add_taskmanager(**{"state.backend.type": "hashmap"})
    client = cluster.client(max_attempts=2)
    client.wait_for_taskmanagers(2)
    client.submit_job(
        REF_JOB,
        [
            OperatorSpec(
                REF_OPERATOR,
                2,
                (
                    StateDescriptor("v", StateKind.VALUE),
                    StateDescriptor("l", StateKind.LIST),
                    StateDescriptor("m", StateKind.MAP),
                ),
            )
        ],
    )
    reference = Reference(client)
    reference.write()
    reference.assert_unchanged()
    world = World(
        client,
        cluster.address,
        [tm.address for tm in cluster.taskmanagers],
        [tm.id for tm in cluster.taskmanagers],
        sandbox,
    )
    world.start()
    try:
        yield FuzzCluster(world, reference, [cluster.address, *world.tm_addresses], tmp_path)
    finally:
        world.close()
