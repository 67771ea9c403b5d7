"""Local recovery (``execution.state-recovery.from-local: true``): a TaskManager restarted on the
same host with its local directory intact restores from the local copy of the last completed
checkpoint and reads nothing from checkpoint storage; a local file that is missing or does not
verify is downloaded instead (and named in the log), and the state is the same either way.

Reads are counted twice: by the TaskManagers' own Prometheus counters
(``keyedstate_taskmanager_job_task_operator_restore_{downloaded,local}_{files,bytes}_total``) and by the S3 proxy
in front of each TaskManager, which sees every GET that reaches the S3 server.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from keyedstate.common.ids import SubtaskId
from tests.integration.failover._support import (
    OPERATOR,
    EpochWriter,
    assert_no_orphans,
    assert_state_equals,
    key_names,
    metric_total,
    operators,
    record_figure,
    wait_for_job,
)
from tests.integration.failover.conftest import FailoverCluster

pytestmark = pytest.mark.s3

DOWNLOADED_FILES = "keyedstate_taskmanager_job_task_operator_restore_downloaded_files_total"
DOWNLOADED_BYTES = "keyedstate_taskmanager_job_task_operator_restore_downloaded_bytes_total"
LOCAL_FILES = "keyedstate_taskmanager_job_task_operator_restore_local_files_total"


def _object_gets(cluster: FailoverCluster, since: float) -> list[str]:
    """Objects the TaskManagers read from S3 since ``since`` (listings excluded)."""
    return [r.path for p in cluster.proxies for r in p.requests(since) if r.method == "GET" and "?" not in r.path]


def _local_copy(cluster: FailoverCluster, tm: int, job: str, subtask: int) -> Path:
    """The one local snapshot TaskManager ``tm`` keeps for ``subtask`` (the last completed checkpoint)."""
    snapshots = (
        cluster.local_dir(tm) / f"tm_tm-{tm}" / SubtaskId(job, OPERATOR, subtask).instance_dir_name() / "snapshots"
    )
    copies = sorted(snapshots.glob("chk-*"))
    assert len(copies) == 1, f"expected one local copy in {snapshots}, found {copies}"
    return copies[0]


def test_restart_on_the_same_host_restores_from_the_local_copy(
    failover_cluster: Callable[..., FailoverCluster],
) -> None:
    # One slot per TaskManager: a lost subtask can only go back to its restarted TaskManager
    # (with a spare slot elsewhere it would move there at once, and download its state). The
    # restart delay gives the TaskManager time to come back; an attempt before that finds no
    # slot and is retried.
    cluster = failover_cluster(
        taskmanagers=2,
        slots=1,
        config={
            "execution.state-recovery.from-local": "true",
            "restart-strategy.fixed-delay.delay": "1 s",
            "restart-strategy.fixed-delay.attempts": "20",
        },
    )
    job = "local"
    client = cluster.client()
    client.submit_job(job, operators(2))
    writer = EpochWriter(cluster.client(), job, key_names(2000))
    writer.run(3)
    placement = cluster.placement(client, job)
    assert sorted(placement.values()) == [0, 1], placement
    victim, other = placement[0], placement[1]
    checkpoint = client.job_info(job).latest_checkpoint_id
    assert _local_copy(cluster, victim, job, 0).name == f"chk-{checkpoint}"

    # -- 1: the TaskManager dies and is started again with its local directory intact ----------
    restarts = client.job_info(job).restarts
    offset = cluster.log_size(victim)
    killed_at = cluster.kill_taskmanager(victim)
    cluster.restart_taskmanager(victim)
    wait_for_job(client, job, {"RUNNING"}, min_restarts=restarts + 1)
    record_figure(
        "TaskManager kill + restart, local recovery (no download) -> job RUNNING again (restart delay 1 s)",
        time.monotonic() - killed_at,
    )
    # A restart on the same host finds each subtask where it was; local recovery depends on it.
    assert cluster.placement(client, job) == placement

    assert _object_gets(cluster, killed_at) == [], "a restore from local copies read from S3"
    for tm in (victim, other):
        samples = cluster.taskmanager_metrics(client, tm)
        assert metric_total(samples, DOWNLOADED_FILES, job_id=job) == 0
        assert metric_total(samples, DOWNLOADED_BYTES, job_id=job) == 0
        assert metric_total(samples, LOCAL_FILES, job_id=job) > 0, f"tm-{tm} restored nothing from its local copy"
    assert f"from checkpoint {checkpoint}: 1 snapshot(s), 0 files (0 bytes) downloaded" in cluster.log_since(
        victim, offset
    )
    # What a slot restored from stays its local copy until the next checkpoint completes.
    assert _local_copy(cluster, victim, job, 0).name == f"chk-{checkpoint}"
    assert_state_equals(writer.read(), writer.expected(3))
    writer.run(5)

    # -- 2: one local file does not verify: only that one is downloaded, and the log names it ---
    checkpoint = client.job_info(job).latest_checkpoint_id
    copy = _local_copy(cluster, victim, job, 0)
    assert copy.name == f"chk-{checkpoint}", "a completed checkpoint leaves its local copy"
    damaged = max(copy.glob("*.sst"), key=lambda p: p.stat().st_size)
    restarts = client.job_info(job).restarts
    offset = cluster.log_size(victim)
    killed_at = cluster.kill_taskmanager(victim)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    cluster.restart_taskmanager(victim)
    wait_for_job(client, job, {"RUNNING"}, min_restarts=restarts + 1)
    record_figure(
        "TaskManager kill + restart, one local file damaged -> job RUNNING again (restart delay 1 s)",
        time.monotonic() - killed_at,
    )

    log = cluster.log_since(victim, offset)
    assert f"local copy {damaged} does not verify" in log
    gets = _object_gets(cluster, killed_at)
    assert len(gets) == 1 and gets[0].endswith(damaged.name), gets
    samples = cluster.taskmanager_metrics(client, victim)
    assert metric_total(samples, DOWNLOADED_FILES, job_id=job) == 1
    assert metric_total(samples, DOWNLOADED_BYTES, job_id=job) == len(data)
    assert metric_total(samples, LOCAL_FILES, job_id=job) > 0
    assert metric_total(cluster.taskmanager_metrics(client, other), DOWNLOADED_FILES, job_id=job) == 0
    assert_state_equals(writer.read(), writer.expected(5))
    writer.run(7)

    # -- 3: the local copy is gone: everything of that subtask comes from S3 -------------------
    checkpoint = client.job_info(job).latest_checkpoint_id
    copy = _local_copy(cluster, other, job, 1)
    restarts = client.job_info(job).restarts
    offset = cluster.log_size(other)
    killed_at = cluster.kill_taskmanager(other)
    files = sorted(p.name for p in copy.iterdir())
    for p in copy.iterdir():
        p.unlink()
    copy.rmdir()
    cluster.restart_taskmanager(other)
    wait_for_job(client, job, {"RUNNING"}, min_restarts=restarts + 1)
    record_figure(
        "TaskManager kill + restart, local copy missing (full download) -> job RUNNING again (restart delay 1 s)",
        time.monotonic() - killed_at,
    )
    assert f"no local copy of checkpoint {checkpoint}" in cluster.log_since(other, offset)
    samples = cluster.taskmanager_metrics(client, other)
    assert metric_total(samples, DOWNLOADED_FILES, job_id=job) == len(files)
    assert metric_total(samples, LOCAL_FILES, job_id=job) == 0
    assert sorted(g.rsplit("/", 1)[-1].split("-")[-1] for g in _object_gets(cluster, killed_at)) == sorted(
        f.split("-")[-1] for f in files
    )
    assert_state_equals(writer.read(), writer.expected(7))
    writer.run(8)
    assert_state_equals(writer.read(), writer.expected(8))
    assert_no_orphans(cluster.storage, cluster.job_dir(job), [client.job_info(job).latest_checkpoint_path])
