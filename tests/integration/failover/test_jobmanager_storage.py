"""``execution.checkpointing.storage: jobmanager`` with real processes: TaskManagers send their
snapshots inline in their acks, the JobManager keeps completed checkpoints in its memory (no
files), a killed TaskManager's subtasks fail over to them, a job restores from one by path, a
snapshot over the size limit declines the checkpoint with its own reason, savepoints still go to
their directory, and the combination with high availability stops the JobManager at start-up.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.client import ClientSettings, StateClient
from keyedstate.common.minicluster import MiniCluster, free_port
from tests.fixtures.cluster import FAST_HEARTBEATS
from tests.integration.failover._support import (
    EpochWriter,
    assert_state_equals,
    key_names,
    operators,
    record_figure,
    wait_for_job,
)

IN_MEMORY = {
    "execution.checkpointing.storage": "jobmanager",
    "restart-strategy.type": "fixed-delay",
    "restart-strategy.fixed-delay.attempts": "5",
    "restart-strategy.fixed-delay.delay": "100 ms",
    **FAST_HEARTBEATS,
}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[MiniCluster]:
    """A JobManager and three TaskManagers of two slots as processes, checkpoints in the JobManager's memory."""
    config = {**IN_MEMORY, "state.savepoints.dir": (tmp_path / "savepoints").as_uri()}
    mini = MiniCluster(tmp_path / "cluster", 3, 2, "rocksdb", config)
    mini.start()
    try:
        yield mini
    finally:
        mini.kill_all()


def _client(mini: MiniCluster) -> StateClient:
    return StateClient(mini.jobmanager_address, ClientSettings(timeout_s=30.0, max_attempts=3, backoff_s=0.05))


def _placement(client: StateClient, job: str) -> dict[int, int]:
    return {
        s.subtask_index: int(t.taskmanager_id.removeprefix("tm-"))
        for t in client.cluster().taskmanagers
        for s in t.slots
        if s.job_id == job
    }


def test_failover_and_restore_from_checkpoints_in_the_jobmanagers_memory(cluster: MiniCluster, tmp_path: Path) -> None:
    job = "in-memory"
    client = _client(cluster)
    client.submit_job(job, operators(4))
    writer = EpochWriter(_client(cluster), job, key_names(1200))
    writer.run(3)
    info = client.job_info(job)
    assert info.latest_checkpoint_path.startswith("jobmanager://"), info.latest_checkpoint_path
    assert info.latest_checkpoint_path.endswith(f"/{job}/chk-{info.latest_checkpoint_id}")
    # No files anywhere: the TaskManagers' directories hold their working state only.
    assert not list(tmp_path.rglob("_metadata"))

    victim = _placement(client, job)[0]
    killed_at = time.monotonic()
    cluster.taskmanagers[victim].kill()
    running = wait_for_job(client, job, {"RUNNING"}, min_restarts=1, timeout_s=60)
    record_figure("TaskManager kill, in-memory checkpoints -> job RUNNING again", time.monotonic() - killed_at)
    assert victim not in _placement(client, job).values()
    # The state came back from the in-memory checkpoint, and the job goes on from it.
    writer.committed = running.committed_epoch
    assert running.committed_epoch == 3
    assert_state_equals(writer.read(), writer.expected(3))
    writer.run(6)
    assert_state_equals(writer.read(), writer.expected(6))

    # Restore by path: the checkpoint lives as long as this JobManager, wherever the job goes.
    latest = client.job_info(job).latest_checkpoint_path
    client.cancel_job(job)
    client.submit_job(job, operators(3), restore_path=latest)
    assert_state_equals(writer.read(), writer.expected(6))
    assert client.job_info(job).committed_epoch == 6

    # Savepoints still go to their directory, as in Flink, and restore from there.
    savepoint = client.trigger_checkpoint(job, savepoint=True, timeout_s=60)
    assert savepoint.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, savepoint.failure_reason
    assert savepoint.path.startswith((tmp_path / "savepoints").as_uri()), savepoint.path
    assert Path(savepoint.path.removeprefix("file://"), "_metadata").is_file()
    client.cancel_job(job)
    client.submit_job(job, operators(2), restore_path=savepoint.path)
    assert_state_equals(writer.read(), writer.expected(6))


def test_a_snapshot_over_the_size_limit_declines_the_checkpoint_with_its_own_reason(cluster: MiniCluster) -> None:
    job = "too-big"
    client = _client(cluster)
    limit = {
        "execution.checkpointing.jobmanager-storage.max-state-size": "256kb",
        "execution.checkpointing.tolerable-failed-checkpoints": "10",
        # Lets epoch 1 commit without its own checkpoint; never fires within the test.
        "execution.checkpointing.interval": "1 h",
    }
    client.submit_job(job, operators(2), config=limit)
    writer = EpochWriter(_client(cluster), job, key_names(300), blob_bytes=8 << 10, blob_epochs=frozenset({1}))
    writer.run(0)
    small = client.job_info(job)
    assert small.latest_checkpoint_id > 0

    # Epoch 1 adds 8 KiB of incompressible bytes to each of 200 keys: about 800 KiB a subtask.
    version = client.routing(job, refresh=True).version
    client.commit_epoch(
        job,
        1,
        writer.stage(1),
        checkpoint=False,
        wait_for_checkpoint=False,
        expected_routing_version=version,
        timeout_s=60,
    )
    failed = client.trigger_checkpoint(job, timeout_s=60)
    assert failed.status == jm_pb.CHECKPOINT_STATUS_FAILED
    reason = failed.failure_reason
    assert reason.startswith("STATE_SIZE_LIMIT_EXCEEDED: "), reason
    assert "more than the 262144 bytes" in reason, reason
    assert "execution.checkpointing.jobmanager-storage.max-state-size" in reason, reason
    assert "use execution.checkpointing.storage: filesystem with state.checkpoints.dir" in reason, reason

    # The job runs on, and its latest checkpoint is still the last one that fit.
    now = client.job_info(job)
    assert now.status == pb.JOB_STATUS_RUNNING and now.committed_epoch == 1
    assert now.latest_checkpoint_id == small.latest_checkpoint_id


def test_jobmanager_storage_with_high_availability_stops_the_jobmanager_at_start(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "keyedstate.jobmanager"]
    for key, value in {
        "jobmanager.rpc.port": str(free_port()),
        "rest.port": "-1",
        "execution.checkpointing.storage": "jobmanager",
        "high-availability.type": "filesystem",
        "high-availability.storageDir": (tmp_path / "ha").as_uri(),
    }.items():
        command += ["-D", f"{key}={value}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "execution.checkpointing.storage: jobmanager keeps checkpoints in the JobManager's memory" in done.stderr
    assert "set execution.checkpointing.storage: filesystem with state.checkpoints.dir" in done.stderr
    assert " serving on " not in done.stdout
