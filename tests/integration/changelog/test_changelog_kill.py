"""kill -9 of a changelog TaskManager at each step of its checkpoints, then failover: no epoch lost or doubled.

Real processes (a JobManager and three TaskManagers, ``file://`` checkpoint storage). The victim
is started alone and gets every subtask of the job; two spare TaskManagers join afterwards so the
job can fail over. The victim SIGKILLs itself at a crash point (common/faults.py): before its
segments are uploaded, after they are uploaded but before the acknowledgement, after the
acknowledgement is built, and in the middle of a background materialization. The writer drives
epochs through the epoch protocol with a checkpoint each, retries what the failover interrupts,
and the state served at the end must equal epochs ``0..n`` applied exactly once each: an epoch
lost shows as a missing event, one doubled as a repeated event and a wrong count.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from keyedstate.common.client import ClientSettings, StateClient
from keyedstate.common.faults import ENV as CRASH_AT
from keyedstate.common.minicluster import MiniCluster
from tests.fixtures.cluster import FAST_HEARTBEATS
from tests.integration.failover._support import EpochWriter, key_names, operators, wait_for_job

CONFIG = {
    "state.changelog.enabled": "true",
    "state.changelog.periodic-materialize.interval": "300 ms",
    "execution.checkpointing.incremental": "true",
    "restart-strategy.type": "fixed-delay",
    "restart-strategy.fixed-delay.attempts": "10",
    "restart-strategy.fixed-delay.delay": "100 ms",
    **FAST_HEARTBEATS,
}


JOB_CONFIG = {k: v for k, v in CONFIG.items() if k.startswith(("state.changelog", "execution.checkpointing"))}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[MiniCluster]:
    mini = MiniCluster(tmp_path, 3, 2, "rocksdb", {**CONFIG, "state.checkpoints.dir": (tmp_path / "chk").as_uri()})
    yield mini
    mini.kill_all()


@pytest.mark.parametrize(
    "point",
    [
        "taskmanager.changelog.before-segment-upload@5",
        "taskmanager.changelog.segments-uploaded@5",
        "taskmanager.checkpoint.before-ack@5",
        "taskmanager.changelog.materializing@3",
    ],
)
def test_kill_of_a_changelog_taskmanager_at_each_checkpoint_step_loses_and_doubles_no_epoch(
    cluster: MiniCluster, point: str
) -> None:
    cluster.start_jobmanager()
    victim = cluster._taskmanager(0)
    victim.start({**cluster._env(), CRASH_AT: point})
    cluster.taskmanagers.append(victim)
    cluster.wait_for_taskmanagers(1)
    client = StateClient(cluster.jobmanager_address, ClientSettings(timeout_s=30, max_attempts=4, backoff_s=0.05))
    job = "cl-kill"
    # Both subtasks land on the victim, the only TaskManager yet.
    client.submit_job(job, operators(2), max_parallelism=32, config=JOB_CONFIG)
    for i in (1, 2):
        spare = cluster._taskmanager(i)
        spare.start(cluster._env())
        cluster.taskmanagers.append(spare)
    cluster.wait_for_taskmanagers(3)
    writer = EpochWriter(client, job, key_names(200))
    writer.run(2, timeout_s=120)
    # Slow epochs, so a background materialization (300 ms) runs between checkpoints.
    while victim.alive and writer.committed < 40:
        writer.run(writer.committed + 1, timeout_s=120)
        if point.startswith("taskmanager.changelog.materializing"):
            time.sleep(0.4)
    assert not victim.alive, f"the victim never reached {point}: {victim.log_tail()}"
    assert f"crash point {point.split('@')[0]} reached" in victim.log_tail(400), victim.log_tail()
    target = writer.committed + 4
    writer.run(target, timeout_s=180)
    info = wait_for_job(client, job, {"RUNNING"}, min_restarts=1)
    assert info.committed_epoch == target
    assert writer.read() == writer.expected(target)
    # The failover restored a changelog checkpoint: a materialization plus segments replayed on top.
    logs = "".join((cluster.base_dir / "log" / f"taskmanager-{i}.log").read_text() for i in (1, 2))
    assert "replayed changelog epochs" in logs
    client.close()


def test_jobmanager_failover_of_a_changelog_job_loses_and_doubles_no_epoch(tmp_path: Path) -> None:
    config = {
        **CONFIG,
        "state.checkpoints.dir": (tmp_path / "chk").as_uri(),
        "high-availability.type": "filesystem",
        "high-availability.storageDir": (tmp_path / "ha").as_uri(),
        "high-availability.filesystem.lease-check-interval": "200 ms",
    }
    cluster = MiniCluster(tmp_path, 2, 2, "rocksdb", config)
    try:
        cluster.start()
        client = StateClient(cluster.jobmanager_address, ClientSettings(timeout_s=30, max_attempts=4, backoff_s=0.05))
        job = "cl-jm"
        client.submit_job(job, operators(2), max_parallelism=32, config=JOB_CONFIG)
        writer = EpochWriter(client, job, key_names(200))
        writer.run(4, timeout_s=120)
        time.sleep(0.5)  # a materialization runs, so the latest checkpoint is one plus segments
        writer.run(6, timeout_s=120)
        cluster.restart_jobmanager()
        writer.run(10, timeout_s=180)
        assert writer.read() == writer.expected(10)
        # The new JobManager redeployed the job from its latest checkpoint: materialization plus segments.
        logs = "".join((tmp_path / "log" / f"taskmanager-{i}.log").read_text() for i in (0, 1))
        assert "replayed changelog epochs" in logs
        client.close()
    finally:
        cluster.kill_all()
