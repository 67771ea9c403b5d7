"""Overlapped commits with changelog checkpoints: kill -9 at a step of the overlapped commit, then again later.

The README's PySpark pipeline (real JobManager and TaskManager processes, RocksDB, file://
checkpoints, HA on, real PySpark) runs with ``execution.checkpointing.commit-mode: overlapped``
and ``state.changelog.enabled``, the periodic materialization out of reach (the first
checkpoint's snapshot stays the only materialization unless a restore forces a new one). A
TaskManager dies at a step of the second batch's commit; the restore replays the decided epochs
above its checkpoint, and the checkpoints after it must hold them (in a new materialization:
they are in no changelog segment). When the query is done, another TaskManager is killed, so
the job restores from one of those later checkpoints: the state must still equal the plain-Python
reference exactly. A restore that kept the old materialization and replayed only the segments
would silently lack the replayed epoch here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from keyedstate.common.config import Configuration
from keyedstate.common.faults import ENV as CRASH_AT
from keyedstate.common.storage import open_storage
from tests.integration.checkpoints.conftest import read_metadata
from tests.integration.exactly_once._asserts import QUERY_TIMEOUT_S, assert_finished_exactly
from tests.integration.exactly_once._pipeline import FAST_RESTARTS, ExactlyOncePipeline

pytestmark = [pytest.mark.spark, pytest.mark.timeout(420)]

CONFIG = {
    **FAST_RESTARTS,
    "execution.checkpointing.commit-mode": "overlapped",
    "state.changelog.enabled": "true",
    "state.changelog.periodic-materialize.interval": "1 h",
}


@pytest.fixture
def commit_mode() -> str:
    """The exactly-once pipeline fixture's mode: overlapped commits only."""
    return "overlapped"


@pytest.mark.parametrize("crash_at", ["taskmanager.epoch.before-commit@2", "taskmanager.epoch.committed@2"])
def test_a_restore_that_replays_decided_epochs_keeps_them_in_the_next_changelog_checkpoints(
    exo_pipeline: Callable[..., ExactlyOncePipeline], crash_at: str
) -> None:
    pipeline = exo_pipeline(files=5, config=CONFIG, tm_env={1: {CRASH_AT: crash_at}})
    pipeline.write_files()
    run = pipeline.start_query()
    pipeline.wait_for_dead(1)
    assert "crash point" in pipeline.cluster.taskmanagers[1].log_tail(80)
    pipeline.restart_taskmanager(1)
    outcome = run.wait(QUERY_TIMEOUT_S)
    assert_finished_exactly(pipeline, outcome)
    logs = (pipeline.cluster.base_dir / "log" / "taskmanager-0.log").read_text()
    logs += (pipeline.cluster.base_dir / "log" / "taskmanager-1.log").read_text()
    assert "replayed decided epochs" in logs, "the failover replayed no decided epoch: the test proves nothing"

    # One failover, and checkpoints completed after it: a checkpoint that lacked the replayed epochs
    # would be declined by the JobManager (its segments would not continue the materialization), and
    # each declined one would fail the job over again.
    before = pipeline.job_info()
    assert before.restarts == 1, before.failure_cause
    storage = open_storage(pipeline.checkpoints_dir, Configuration({}))
    latest = read_metadata(storage, before.latest_checkpoint_path)
    assert latest.epoch == before.committed_epoch and latest.has_changelog

    # A second failover restores that latest changelog checkpoint, taken after the replay.
    pipeline.kill_taskmanager(0)
    pipeline.restart_taskmanager(0)
    deadline = time.monotonic() + 120
    while True:
        info = pipeline.job_info()
        if info.restarts > before.restarts and info.status == before.status:
            break
        assert time.monotonic() < deadline, f"the job did not fail over and run again: {info}"
        time.sleep(0.2)
    assert info.committed_epoch == before.committed_epoch and info.restarts == 2, info.failure_cause
    assert pipeline.diff() is None, pipeline.describe_state()
