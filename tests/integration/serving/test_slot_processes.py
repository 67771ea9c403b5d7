"""A TaskManager with slot processes (``taskmanager.slot-processes: 2``): real child processes, real RocksDB.

What must hold: clients reach each slot straight at its slot process; checkpoints and restores
work across them; the TaskManager's lease fences every slot process; a killed slot process is
replaced and only the jobs it hosted fail over; the processes together stay within
``taskmanager.memory.managed.size``; the TaskManager's metrics endpoint shows theirs.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import tempfile
import urllib.request
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common._proto.v1 import taskmanager_pb2 as pb
from keyedstate.common._proto.v1 import taskmanager_pb2_grpc as pb_grpc
from keyedstate.common.client import Routing, StateClient, ValueState
from keyedstate.common.config import Configuration
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.errors import ConfigError
from keyedstate.common.keygroups import key_group
from keyedstate.taskmanager.daemon import TaskManager
from tests.fixtures.waiting import wait_for
from tests.integration.serving._support import reason

pytestmark = pytest.mark.timeout(180)

SLOT_PROCESSES = {"taskmanager.slot-processes": 2}
VALUE = (StateDescriptor("v", StateKind.VALUE),)


def _scrape(tm: TaskManager) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{tm.metrics_port}/metrics", timeout=10) as response:
        text: str = response.read().decode()
    return text


def _key_of(routing: Routing, subtask: int) -> bytes:
    owner = routing.operator("op").subtask_of
    return next(
        k for k in (f"k{i}".encode() for i in range(10_000)) if owner[key_group(k, routing.max_parallelism)] == subtask
    )


def _value_get(address: str, routing: Routing, subtask: int) -> grpc.RpcError | None:
    """A raw ValueGet at ``address`` of a key ``subtask`` owns; the error it got, or None when it was served."""
    with grpc.insecure_channel(address) as channel:
        target = pb.StateTarget(
            job_id=routing.job_id,
            operator_id="op",
            subtask_index=subtask,
            state_name="v",
            routing_version=routing.version,
        )
        request = pb.KeyedRequest(target=target, keys=[_key_of(routing, subtask)])
        try:
            pb_grpc.KeyedStateStub(channel).ValueGet(request, timeout=10)
        except grpc.RpcError as exc:
            return exc
    return None


def test_slots_are_served_by_their_own_processes_and_ports(inprocess_cluster: Any) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=4, tm={**SLOT_PROCESSES, "metrics.reporter.prom.port": "0"})
    tm = cluster.taskmanagers[0]
    assert tm.slot_processes is not None
    pids = tm.slot_processes.pids()
    assert len(set(pids)) == 2 and os.getpid() not in pids
    client = cluster.client()
    client.submit_job("j", [OperatorSpec("op", 4, VALUE)])
    routing = client.routing("j")
    addresses = routing.operator("op").addresses
    # Slot i lives in process i mod 2: two ports, neither of them the TaskManager's own.
    assert addresses[0] == addresses[2] != addresses[1] == addresses[3]
    assert tm.address not in addresses
    assert list(addresses) == tm.slot_processes.slot_addresses()

    state = ValueState[str, Any](client, "j", "op", "v", key_serializer="str", value_serializer="json")
    keys = [f"k{i}" for i in range(5000)]
    state.put_many(keys, list(range(5000)))
    assert state.get_many(keys) == list(range(5000))
    checkpoint = client.trigger_checkpoint("j")
    assert checkpoint.status == jm_pb.CHECKPOINT_STATUS_COMPLETED

    # A stale client still calling the TaskManager's own port is told to refresh its routing.
    err = _value_get(tm.address, routing, 0)
    assert err is not None and err.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert reason(cast(grpc.Call, err)) == "STALE_ROUTING"

    metrics = _scrape(tm)
    for index in ("0", "1"):
        assert f'keyedstate_taskmanager_state_requests_total{{method="ValuePut",slot_process="{index}"}} 2.0' in metrics
    assert "keyedstate_taskmanager_slots 4.0" in metrics
    assert "keyedstate_taskmanager_slots_available 0.0" in metrics
    assert metrics.count("# TYPE keyedstate_taskmanager_state_requests_total counter") == 1


def test_the_lease_fences_every_slot_process(inprocess_cluster: Any) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=2, tm=SLOT_PROCESSES)
    client = cluster.client()
    client.submit_job("j", [OperatorSpec("op", 2, VALUE)])
    routing = client.routing("j")
    addresses = routing.operator("op").addresses
    assert addresses[0] != addresses[1]
    for subtask, address in enumerate(addresses):
        assert _value_get(address, routing, subtask) is None

    # The JobManager goes away: nobody renews the lease, and it runs out in every slot process.
    client.close()
    cluster.jobmanager.stop(grace_s=0)

    def refused(subtask: int) -> bool:
        err = _value_get(addresses[subtask], routing, subtask)
        return err is not None and reason(cast(grpc.Call, err)) == "LEASE_EXPIRED"

    for subtask, address in enumerate(addresses):
        wait_for(functools.partial(refused, subtask), 15, f"slot process at {address} refusing after the lease ran out")
        err = _value_get(address, routing, subtask)
        assert err is not None and err.code() is grpc.StatusCode.UNAVAILABLE
        assert "stopped serving" in (err.details() or "")


def test_a_killed_slot_process_is_replaced_and_only_its_jobs_fail_over(inprocess_cluster: Any) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=2, tm=SLOT_PROCESSES)
    tm = cluster.taskmanagers[0]
    assert tm.slot_processes is not None
    client = cluster.client()
    states: dict[str, ValueState[str, Any]] = {}
    for job in ("a", "b"):
        client.submit_job(job, [OperatorSpec("op", 1, VALUE)])
        states[job] = ValueState[str, Any](client, job, "op", "v", key_serializer="str", value_serializer="json")
        states[job].put_many([f"{job}{i}" for i in range(1000)], list(range(1000)))
        client.trigger_checkpoint(job)
    before = {job: client.routing(job, refresh=True) for job in ("a", "b")}
    slot_addresses = tm.slot_processes.slot_addresses()
    index_b = slot_addresses.index(before["b"].operator("op").addresses[0]) % 2
    index_a = slot_addresses.index(before["a"].operator("op").addresses[0]) % 2
    assert index_a != index_b
    victim = tm.slot_processes.pids()[index_b]
    survivor = tm.slot_processes.pids()[index_a]

    os.kill(victim, signal.SIGKILL)

    def b_recovered() -> Any:
        routing = client.routing("b", refresh=True)
        return routing if routing.version > before["b"].version and routing.job_status == "RUNNING" else None

    after_b = wait_for(b_recovered, 90, "job b running again after its slot process was killed")
    pids = tm.slot_processes.pids()
    assert pids[index_b] not in (0, victim) and pids[index_a] == survivor
    assert after_b.operator("op").addresses[0] != before["b"].operator("op").addresses[0]
    # Job b's state came back from its checkpoint, in the new slot process.
    assert states["b"].get_many([f"b{i}" for i in range(1000)]) == list(range(1000))
    # Job a never moved: same routing version, same process, its state served throughout.
    after_a = client.routing("a", refresh=True)
    assert after_a.version == before["a"].version and after_a.job_status == "RUNNING"
    assert states["a"].get_many([f"a{i}" for i in range(1000)]) == list(range(1000))
    assert tm.failure is None


def test_the_slot_processes_share_the_managed_memory(inprocess_cluster: Any) -> None:
    managed = 64 << 20
    cluster = inprocess_cluster(
        taskmanagers=1,
        slots=2,
        tm={
            **SLOT_PROCESSES,
            "taskmanager.memory.managed.size": "64 mb",
            "metrics.reporter.prom.port": "0",
            "state.backend.rocksdb.metrics.block-cache-capacity": "true",
        },
    )
    tm = cluster.taskmanagers[0]
    client = cluster.client()
    client.submit_job("j", [OperatorSpec("op", 2, VALUE)])
    ValueState[str, Any](client, "j", "op", "v", key_serializer="str", value_serializer="json").put_many(["x"], [1])
    capacity: dict[str, float] = {}
    for line in _scrape(tm).splitlines():
        if line.startswith("flink_taskmanager_job_task_operator_column_family_rocksdb_block_cache_capacity"):
            process = line.split('slot_process="')[1].split('"')[0]
            capacity[process] = float(line.rsplit(" ", 1)[1])
    # One cache per process (block cache + write buffers), half the budget each: never more in all.
    assert capacity == {"0": managed / 2, "1": managed / 2}


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        ({"taskmanager.slot-processes": 3, "taskmanager.numberOfTaskSlots": 2}, ["exceeds", "numberOfTaskSlots 2"]),
        (
            {"taskmanager.slot-processes": 4, "taskmanager.memory.managed.size": "2 mb"},
            ["taskmanager.memory.managed.size", "less than 1mb per slot process"],
        ),
    ],
)
def test_impossible_slot_process_settings_are_refused_naming_the_keys(
    overrides: dict[str, Any], fragments: list[str], tmp_path: Any
) -> None:
    conf = {
        "jobmanager.rpc.port": 1,
        "taskmanager.numberOfTaskSlots": 4,
        "state.backend.rocksdb.localdir": str(tmp_path),
        **overrides,
    }
    with pytest.raises(ConfigError) as info:
        TaskManager(Configuration(conf))
    for fragment in fragments:
        assert fragment in info.value.message


def test_a_slot_process_that_cannot_be_replaced_stops_the_taskmanager(inprocess_cluster: Any) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=2, tm=SLOT_PROCESSES)
    tm = cluster.taskmanagers[0]
    assert tm.slot_processes is not None
    control = tm.slot_processes.control_dir
    # A file where the lease page and the sockets live: no new slot process can start.
    control.rename(control.with_name(control.name + ".moved"))
    control.write_bytes(b"")
    try:
        os.kill(tm.slot_processes.pids()[1], signal.SIGKILL)
        assert tm.wait(60), "the TaskManager did not stop after its slot process could not be replaced"
        assert tm.failure is not None and "slot process 1 died and could not be replaced" in tm.failure
    finally:
        control.unlink()
        control.with_name(control.name + ".moved").rename(control)


def _running(pid: int) -> bool:
    """The process exists and has not exited (a zombie nobody reaped yet has)."""
    import psutil

    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _control_dirs(tmp: Path) -> list[Path]:
    """The slot processes' private directories (lease page, Unix sockets) the TaskManagers made in ``tmp``."""
    return sorted(tmp.glob("keyedstate-slots-*"))


def test_slot_processes_die_with_a_killed_taskmanager_and_its_restart_serves_again_and_cleans_up(
    process_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psutil

    # The daemons' temp directory is this test's own (short: Unix socket paths have 107 bytes at most).
    tmp = Path(tempfile.mkdtemp(prefix="ks-"))
    monkeypatch.setenv("TMPDIR", str(tmp))
    try:
        cluster = process_cluster(taskmanagers=1, slots=2, config=SLOT_PROCESSES)
        daemon = cluster.taskmanagers[0].process
        assert daemon is not None
        slot_pids = [
            p.pid for p in psutil.Process(daemon.pid).children() if "keyedstate.taskmanager.slot_process" in p.cmdline()
        ]
        assert len(slot_pids) == 2
        first = _control_dirs(tmp)
        assert len(first) == 1 and (first[0] / "lease").is_file()
        with StateClient(cluster.jobmanager_address) as client:
            client.submit_job("j", [OperatorSpec("op", 2, VALUE)])
            state = ValueState[str, Any](client, "j", "op", "v", key_serializer="str", value_serializer="json")
            state.put_many([f"k{i}" for i in range(1000)], list(range(1000)))
            client.trigger_checkpoint("j")
            before = client.routing("j").version

            cluster.taskmanagers[0].kill()
            # Their socket to the TaskManager closed: they close their RocksDB instances and exit.
            wait_for(lambda: not any(_running(p) for p in slot_pids), 30, "the slot processes to exit")
            assert _control_dirs(tmp) == first  # nobody was left to remove it
            cluster.restart_taskmanager(0)
            # The restart removed its killed predecessor's directory and made its own.
            second = _control_dirs(tmp)
            assert len(second) == 1 and second != first and (second[0] / "lease").is_file()

            def running_again() -> bool:
                routing = client.routing("j", refresh=True)
                return routing.version > before and routing.job_status == "RUNNING"

            wait_for(running_again, 90, "the job running again on the restarted TaskManager")
            assert state.get_many([f"k{i}" for i in range(1000)]) == list(range(1000))

        # A clean stop (SIGTERM) removes its own directory.
        assert cluster.taskmanagers[0].terminate() == 0
        assert _control_dirs(tmp) == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _statectl_slot_processes(address: str, capsys: pytest.CaptureFixture[str]) -> list[tuple[int, str, str, int]]:
    """``statectl cluster``'s slot-process rows, checked against its ``--json`` twin: (index, slots, address, pid)."""
    from keyedstate.cli.statectl import main

    assert main(["cluster", "-m", address]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("TASKMANAGER") and "SLOT-PROCESS" in line)
    rows = []
    for line in lines[header + 1 :]:
        if not line.strip():
            break
        tm, index, slots, process_address, pid = re.split(r"\s{2,}", line.strip())
        assert tm == "tm-0"
        rows.append((int(index), slots, process_address, int(pid)))
    assert main(["cluster", "-m", address, "--json"]) == 0
    (described,) = json.loads(capsys.readouterr().out)["taskmanagers"]
    assert [(p["index"], p["address"], p["pid"]) for p in described["slot_processes"]] == [
        (index, a, pid) for index, _, a, pid in rows
    ]
    return rows


def test_slot_processes_killed_together_are_all_replaced(
    inprocess_cluster: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=4, tm=SLOT_PROCESSES)
    tm = cluster.taskmanagers[0]
    assert tm.slot_processes is not None
    old = tm.slot_processes.pids()
    addresses = tm.slot_processes.slot_addresses()
    # statectl shows each slot process: its slots (i mod 2), its address and its pid.
    assert _statectl_slot_processes(cluster.address, capsys) == [
        (0, "0, 2", addresses[0], old[0]),
        (1, "1, 3", addresses[1], old[1]),
    ]
    for pid in old:
        os.kill(pid, signal.SIGKILL)

    def replaced() -> bool:
        assert tm.slot_processes is not None
        pids = tm.slot_processes.pids()
        return all(p not in (0, *old) for p in pids) and len(tm.slot_processes.live()) == 2

    wait_for(replaced, 60, "both slot processes replaced")
    # The JobManager learns the new addresses from the registration that follows (next heartbeat).
    wait_for(
        lambda: (
            tm.slot_processes is not None
            and tm.connection.registered_slot_addresses == tm.slot_processes.slot_addresses()
        ),
        30,
        "the TaskManager registering its new slot addresses",
    )
    new = tm.slot_processes.pids()
    assert [(index, pid) for index, _, _, pid in _statectl_slot_processes(cluster.address, capsys)] == [
        (0, new[0]),
        (1, new[1]),
    ]
    client = cluster.client()
    client.submit_job("j", [OperatorSpec("op", 4, VALUE)])
    assert list(client.routing("j").operator("op").addresses) == tm.slot_processes.slot_addresses()
    state = ValueState[str, Any](client, "j", "op", "v", key_serializer="str", value_serializer="json")
    state.put_many([f"k{i}" for i in range(100)], list(range(100)))
    assert state.get_many([f"k{i}" for i in range(100)]) == list(range(100))
    assert tm.failure is None
