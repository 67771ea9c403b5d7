"""Daemon lifecycle: clean shutdown on SIGTERM, loss detection after SIGKILL, re-registration
after a JobManager restart, and RocksDB handed over cleanly to a successor TaskManager."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.client import ClientSettings, StateClient, ValueState
from keyedstate.common.rpc.enums import name_of
from tests.fixtures.waiting import wait_for
from tests.integration.serving._support import JOB, OPERATOR, operators

# Restarts come quickly and keep coming while no TaskManager is there to take the job.
RESTARTS = {
    "restart-strategy.type": "fixed-delay",
    "restart-strategy.fixed-delay.delay": "100 ms",
    "restart-strategy.fixed-delay.attempts": "1000",
}


_wait_for = wait_for


def _taskmanagers(client: StateClient) -> dict[str, str]:
    return {t.taskmanager_id: name_of(jm_pb.TaskManagerStatus, t.status) for t in client.cluster().taskmanagers}


def _fill(client: StateClient, n: int = 500) -> tuple[ValueState[str, int], list[str]]:
    client.submit_job(JOB, operators(parallelism=2))
    state: ValueState[str, int] = ValueState(client, JOB, OPERATOR, "last", value_serializer="int")
    keys = [f"user-{i}" for i in range(n)]
    state.put_many(keys, list(range(n)))
    checkpoint = client.trigger_checkpoint(JOB, timeout_s=60)
    assert checkpoint.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, checkpoint.failure_reason
    return state, keys


def test_sigterm_taskmanager_exits_0_deregisters_and_closes_rocksdb(process_cluster: Any) -> None:
    # A 60 s heartbeat timeout: only the deregistration can make the TaskManager disappear quickly.
    cluster = process_cluster(
        taskmanagers=1, slots=2, config={"heartbeat.interval": "500 ms", "heartbeat.timeout": "60 s", **RESTARTS}
    )
    with StateClient(cluster.jobmanager_address, ClientSettings(timeout_s=10, max_attempts=3)) as client:
        state, keys = _fill(client)
        tm = cluster.taskmanagers[0]
        assert tm.terminate(timeout_s=30) == 0
        # Deregistration happens before the process exits, so the JobManager already knows.
        assert "tm-0" not in _taskmanagers(client)
        assert client.job_info(JOB).status == pb.JOB_STATUS_RESTARTING
        log = tm.log_path.read_text()
        for subtask in (0, 1):
            assert f"closed RocksDB state of {JOB}/{OPERATOR}/{subtask}" in log
        assert "taskmanager tm-0: stopped" in log
        assert "Traceback" not in log and " ERROR " not in log

        # A successor on the same local directory restores into the same RocksDB paths.
        cluster.restart_taskmanager(0)
        _wait_for(lambda: client.job_info(JOB).status == pb.JOB_STATUS_RUNNING, 30, "the job restart")
        assert state.get_many(keys) == list(range(len(keys)))
        successor_log = cluster.taskmanagers[0].log_path.read_text().split("taskmanager tm-0: stopped", 1)[1]
        assert "LOCK" not in successor_log and "Traceback" not in successor_log

        # With the job stuck restarting (no TaskManager), SIGTERM still stops the JobManager
        # promptly: restart loops end with it instead of keeping the process alive. Waiting for
        # slots is part of one restart (slot.request.timeout), so the wait costs one restart only.
        before = client.job_info(JOB).restarts
        assert cluster.taskmanagers[0].terminate(timeout_s=30) == 0
        _wait_for(lambda: client.job_info(JOB).restarts == before + 1, 30, "the restart")
        time.sleep(2)  # many polls for free slots happen meanwhile
        info = client.job_info(JOB)
        assert (info.status, info.restarts) == (pb.JOB_STATUS_RESTARTING, before + 1)
        assert cluster.jobmanager.terminate(timeout_s=10) == 0


def test_sigkill_taskmanager_is_lost_at_once_when_its_connection_breaks(process_cluster: Any) -> None:
    # A 60 s heartbeat timeout: only the broken connection can explain a quick detection.
    cluster = process_cluster(
        taskmanagers=2, slots=1, config={"heartbeat.interval": "500 ms", "heartbeat.timeout": "60 s"}
    )
    with StateClient(cluster.jobmanager_address, ClientSettings(timeout_s=10, max_attempts=3)) as client:
        client.submit_job(JOB, operators(parallelism=2))
        victim = cluster.taskmanagers[1]
        victim.signal(signal.SIGKILL)
        killed = time.monotonic()
        _wait_for(lambda: "tm-1" not in _taskmanagers(client), 30, "loss detection")
        detected = time.monotonic() - killed
        print(f"\nTaskManager kill -9 detected through its broken connection in {detected:.2f} s")
        info = _wait_for(lambda: (i := client.job_info(JOB)).failure_cause and i, 10, "the failover")
        assert "tm-1" in info.failure_cause and "connection" in info.failure_cause and "broke" in info.failure_cause


def test_sigkill_taskmanager_is_lost_after_the_heartbeat_timeout(process_cluster: Any) -> None:
    cluster = process_cluster(
        taskmanagers=2,
        slots=1,
        config={
            "heartbeat.interval": "300 ms",
            "heartbeat.timeout": "3 s",
            "heartbeat.connection-loss-detection": "false",
        },
    )
    with StateClient(cluster.jobmanager_address, ClientSettings(timeout_s=10, max_attempts=3)) as client:
        client.submit_job(JOB, operators(parallelism=2))
        victim = cluster.taskmanagers[1]
        victim.signal(signal.SIGKILL)
        killed = time.monotonic()
        victim.process.wait(timeout=10)
        # No goodbye from a killed process: it stays registered until its heartbeats are overdue.
        assert _taskmanagers(client) == {"tm-0": "ACTIVE", "tm-1": "ACTIVE"}
        _wait_for(lambda: "tm-1" not in _taskmanagers(client), 20, "loss detection")
        assert time.monotonic() - killed >= 2.0
        assert _taskmanagers(client) == {"tm-0": "ACTIVE"}
        info = _wait_for(lambda: (i := client.job_info(JOB)).failure_cause and i, 10, "the failover")
        assert "tm-1" in info.failure_cause and "heartbeat.timeout" in info.failure_cause
        assert info.status in (pb.JOB_STATUS_RESTARTING, pb.JOB_STATUS_FAILED)


def test_taskmanager_reregisters_by_itself_after_a_jobmanager_restart(process_cluster: Any) -> None:
    cluster = process_cluster(taskmanagers=1, slots=2)
    tm = cluster.taskmanagers[0]
    pid = tm.process.pid
    cluster.restart_jobmanager()
    with StateClient(cluster.jobmanager_address, ClientSettings(timeout_s=5, max_attempts=1)) as client:
        _wait_for(lambda: _taskmanagers(client).get("tm-0") == "ACTIVE", 30, "re-registration")
    # The same process registered again; nothing restarted it.
    assert tm.alive and tm.process.pid == pid
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "keyedstate.cli.statectl",
            "cluster",
            "--json",
            "--jobmanager",
            cluster.jobmanager_address,
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    overview = json.loads(result.stdout)
    [entry] = overview["taskmanagers"]
    assert entry["taskmanager_id"] == "tm-0" and entry["status"] == "ACTIVE" and entry["address"] == tm.address
    assert entry["num_slots"] == 2 and overview["free_slots"] == 2


def test_stopped_taskmanager_hands_its_rocksdb_to_a_successor_in_the_same_process(inprocess_cluster: Any) -> None:
    """RocksDB refuses a second open of a path in one process while the first is open ("lock hold by
    current process"), so this fails if stop() leaves any instance open."""
    cluster = inprocess_cluster(taskmanagers=1, slots=2, jm=RESTARTS)
    client = cluster.client()
    state, keys = _fill(client)
    first = cluster.taskmanagers[0]
    first.stop(grace_s=1)
    assert "tm-0" not in _taskmanagers(client)
    cluster.add_taskmanager(
        **{"taskmanager.resource-id": first.id, "state.backend.rocksdb.localdir": str(first.settings.local_dir)}
    )
    _wait_for(lambda: client.job_info(JOB).status == pb.JOB_STATUS_RUNNING, 30, "the job restart")
    assert client.job_info(JOB).restarts >= 1
    assert state.get_many(keys) == list(range(len(keys)))
    assert os.listdir(first.deployer.work_dir)  # the successor works in the same directory
