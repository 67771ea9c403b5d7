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
from keyedstate.common.config import Configuration
from keyedstate.common.faults import ENV as CRASH_AT
from keyedstate.common.minicluster import MiniCluster
from keyedstate.common.storage import open_storage
from tests.fixtures.cluster import FAST_HEARTBEATS
from tests.integration.checkpoints.conftest import read_metadata
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


def _uploaded_by(job_dir: Path, checkpoint: str) -> dict[str, int]:
    """What checkpoint ``chk-<n>`` uploaded itself (its directory and ``shared/chk-<n>/``), by file: bytes."""
    files = [p for p in (job_dir / checkpoint).rglob("*") if p.is_file() and p.name != "_metadata"]
    files += [p for p in (job_dir / "shared" / checkpoint).rglob("*") if p.is_file()]
    return {str(p.relative_to(job_dir)): p.stat().st_size for p in files}


@pytest.mark.parametrize("backend", ["rocksdb", "hashmap"])
def test_the_first_checkpoint_after_a_kill_9_failover_uploads_only_new_segments(tmp_path: Path, backend: str) -> None:
    """A failover restores a materialization plus a changelog tail and keeps that materialization as the
    confirmed one: the next checkpoint references it and the restored segments, and uploads only the
    segment of the epoch committed since (not a new snapshot of the whole state)."""
    config = {
        **CONFIG,
        # The first checkpoint's snapshot stays the only materialization of the test.
        "state.changelog.periodic-materialize.interval": "1 h",
        "execution.checkpointing.num-retained": "20",
        "state.checkpoints.dir": (tmp_path / "chk").as_uri(),
    }
    cluster = MiniCluster(tmp_path, 2, 2, backend, config)
    try:
        cluster.start_jobmanager()
        victim = cluster._taskmanager(0)
        victim.start(cluster._env())
        cluster.taskmanagers.append(victim)
        cluster.wait_for_taskmanagers(1)
        client = StateClient(cluster.jobmanager_address, ClientSettings(timeout_s=30, max_attempts=4, backoff_s=0.05))
        job = "cl-restored-mat"
        job_config = {**JOB_CONFIG, "state.changelog.periodic-materialize.interval": "1 h"}
        client.submit_job(job, operators(2), max_parallelism=32, config=job_config)  # both subtasks on the victim
        spare = cluster._taskmanager(1)
        spare.start(cluster._env())
        cluster.taskmanagers.append(spare)
        cluster.wait_for_taskmanagers(2)
        # 2.7 MB of incompressible values at epoch 0 (the materialization), a few KB per epoch after it.
        writer = EpochWriter(client, job, key_names(200), blob_bytes=20_000, blob_epochs=frozenset({0}))
        writer.run(4, timeout_s=120)
        job_dir = tmp_path / "chk" / job
        before = {p.name for p in job_dir.glob("chk-*")}
        first = min(before, key=lambda name: int(name.split("-")[1]))
        materialization = _uploaded_by(job_dir, first)
        assert sum(materialization.values()) > 2_000_000, materialization

        victim.kill()  # kill -9: no cleanup, no deregistration
        writer.run(5, timeout_s=180)
        info = wait_for_job(client, job, {"RUNNING"}, min_restarts=1)
        assert info.committed_epoch == 5
        assert writer.read() == writer.expected(5)

        after = sorted(
            ({p.name for p in job_dir.glob("chk-*") if (p / "_metadata").exists()} - before),
            key=lambda name: int(name.split("-")[1]),
        )
        assert after, f"no checkpoint completed after the failover: {sorted(before)}"
        uploaded = {name: size for chk in after for name, size in _uploaded_by(job_dir, chk).items()}
        # Only the changelog segment of epoch 5: no snapshot file (SST, MANIFEST, .kvs) of a second
        # materialization, which is what a restore that forgot its materialization uploads.
        assert uploaded and all(name.endswith(".seg") for name in uploaded), uploaded
        assert sum(uploaded.values()) * 50 < sum(materialization.values()), (uploaded, sum(materialization.values()))
        storage = open_storage((tmp_path / "chk").as_uri(), Configuration({}))
        meta = read_metadata(storage, (job_dir / after[-1]).as_uri())
        assert meta.epoch == 5
        for sub in meta.operators[0].subtasks:
            # The restored materialization (epoch 0, uploaded by the first checkpoint) and every segment since.
            assert sub.materialized_epoch == 0, sub
            assert all(f.path.startswith(f"../shared/{first}/") for f in sub.files), sub.files
            assert sub.changelog[0].first_epoch == 1 and sub.changelog[-1].last_epoch == 5, sub.changelog
        client.close()
    finally:
        cluster.kill_all()
