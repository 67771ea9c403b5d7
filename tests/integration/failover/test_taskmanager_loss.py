"""A TaskManager process dies (SIGKILL) while a writer commits epochs: the job fails over to its
latest completed checkpoint, the writer sees retryable errors, refreshes its routing and carries
on, and every update lands exactly once. With the restart strategy used up, the job goes to
FAILED and statectl shows why.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable

import pytest

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common.errors import KeyedStateError, Reason
from tests.integration.failover._support import (
    RETRYABLE,
    BackgroundWriter,
    EpochWriter,
    assert_no_orphans,
    assert_state_equals,
    key_names,
    operators,
    record_figure,
    wait_for_job,
)
from tests.integration.failover.conftest import FailoverCluster

pytestmark = pytest.mark.s3


def test_kill_of_a_taskmanager_during_writes_loses_and_doubles_no_update(
    failover_cluster: Callable[..., FailoverCluster],
) -> None:
    cluster = failover_cluster(taskmanagers=3, slots=2)
    job = "kill-writes"
    client = cluster.client()
    client.submit_job(job, operators(4))
    placement = cluster.placement(client, job)
    # 4 subtasks on 3 TaskManagers of 2 slots: the 2 free slots are where the lost ones go.
    victim = placement[0]
    lost = sorted(s for s, tm in placement.items() if tm == victim)
    victim_address = next(t.address for t in client.cluster().taskmanagers if t.taskmanager_id == f"tm-{victim}")

    writer = EpochWriter(cluster.client(), job, key_names(1500))
    background = BackgroundWriter(writer, through=12)
    background.wait_for_epoch(3)
    killed_at = cluster.kill_taskmanager(victim)
    epoch_at_kill = writer.committed

    info = wait_for_job(client, job, {"RUNNING"}, min_restarts=1, timeout_s=60)
    running_at = time.monotonic()
    background.join()

    # Whoever noticed first (a broken connection, a failed epoch commit) names the dead TaskManager.
    assert f"TaskManager tm-{victim} lost" in info.failure_cause or victim_address in info.failure_cause, (
        info.failure_cause
    )
    after = cluster.placement(client, job)
    assert sorted(after) == [0, 1, 2, 3] and victim not in after.values(), (
        f"subtasks {lost} moved off tm-{victim}: {after}"
    )

    # The writer was told to retry (and nothing else), then carried on to the last epoch.
    failures = writer.failures()
    assert failures, "the kill must have interrupted the writer"
    assert all(f.error.split(":")[0] in {c.__name__ for c in RETRYABLE} for f in failures), failures
    final = client.job_info(job)
    assert (final.status, final.committed_epoch) == (pb.JOB_STATUS_RUNNING, 12) and final.restarts >= 1
    # Every update exactly once: a lost epoch misses an element, a doubled one adds one.
    assert_state_equals(writer.read(), writer.expected(12))
    assert_no_orphans(cluster.storage, cluster.job_dir(job), [final.latest_checkpoint_path])

    first = writer.first_success_after(killed_at)
    assert first is not None
    record_figure("TaskManager kill during writes -> job RUNNING again", running_at - killed_at)
    record_figure("TaskManager kill during writes -> first committed epoch", first.finished - killed_at)
    kinds = sorted(
        {f.error.split(" on TaskManager")[0].split(":")[0] + ":" + f.error.split(":")[1][:40] for f in failures}
    )
    print(
        f"killed tm-{victim} (subtasks {lost}) after epoch {epoch_at_kill}; {final.restarts} restart(s); "
        f"{len(failures)} failed tries: {kinds}"
    )


def test_exhausted_restart_strategy_fails_the_job_and_statectl_shows_the_cause(
    failover_cluster: Callable[..., FailoverCluster],
) -> None:
    # Every slot is taken and one restart is allowed. Each lost TaskManager comes back at once;
    # the JobManager learns of the loss from its registration (connection-loss detection off),
    # so the restart never races the TaskManager's start.
    cluster = failover_cluster(
        taskmanagers=2,
        slots=2,
        config={"restart-strategy.fixed-delay.attempts": "1", "heartbeat.connection-loss-detection": "false"},
    )
    job = "exhausted"
    client = cluster.client()
    client.submit_job(job, operators(4))
    writer = EpochWriter(cluster.client(), job, key_names(600))
    writer.run(2)

    # First loss: TaskManager 0 dies and comes back at once; its registration reveals the loss
    # (no heartbeat timeout to wait for), and the job uses its one restart.
    killed_at = cluster.kill_taskmanager(0)
    cluster.restart_taskmanager(0)
    info = wait_for_job(client, job, {"RUNNING"}, min_restarts=1)
    record_figure("TaskManager kill + immediate restart -> job RUNNING again", time.monotonic() - killed_at)
    assert "TaskManager tm-0 restarted and lost its slots" in info.failure_cause
    writer.run(4)

    # Second loss: no restart is left, and the job fails with the cause.
    killed_at = cluster.kill_taskmanager(1)
    cluster.restart_taskmanager(1)
    info = wait_for_job(client, job, {"FAILED"}, timeout_s=60)
    record_figure("second TaskManager loss -> job FAILED (restarts exhausted)", time.monotonic() - killed_at)
    assert "TaskManager tm-1 restarted and lost its slots" in info.failure_cause
    assert "restart strategy fixed-delay: 1 of 1 restarts used" in info.failure_cause
    assert info.restarts == 1

    shown = cluster.statectl("job", "info", job)
    assert shown.returncode == 0, shown.stderr
    shown_info = json.loads(shown.stdout)
    assert shown_info["status"] == "FAILED" and shown_info["failure_cause"] == info.failure_cause
    overview = cluster.statectl("job", "list")
    assert overview.returncode == 0 and re.search(rf"^{job}\s+FAILED", overview.stdout, re.M), overview.stdout

    # A FAILED job refuses the next batch with a non-retryable error instead of hanging a client.
    with pytest.raises(KeyedStateError, match="is FAILED") as refused:
        writer.run_epoch(5)
    assert refused.value.reason is Reason.JOB_NOT_RUNNING and not isinstance(refused.value, RETRYABLE)

    # The operator restores the job from its latest checkpoint; the failed job gave its slots back. CLAIM: the
    # job takes its checkpoint back, so it deletes it once subsumed (NO_CLAIM would leave it to the operator).
    restored = cluster.statectl("job", "restore", job, "--from", info.latest_checkpoint_path, "--claim-mode", "CLAIM")
    assert restored.returncode == 0, restored.stderr
    assert wait_for_job(client, job, {"RUNNING"}).committed_epoch == 4
    writer.committed = 4
    writer.run(6)
    assert_state_equals(writer.read(), writer.expected(6))
    assert_no_orphans(cluster.storage, cluster.job_dir(job), [client.job_info(job).latest_checkpoint_path])
