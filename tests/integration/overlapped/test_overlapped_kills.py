"""kill -9 at every step of the overlapped commit protocol, with an exact comparison to a reference.

The README's PySpark pipeline (``tests/integration/exactly_once/_pipeline.py``: real JobManager
and TaskManager processes, RocksDB, file:// checkpoints, HA on, real PySpark) runs with
``execution.checkpointing.commit-mode: overlapped``. A crash point (common/faults.py) SIGKILLs
one process at one step of the second batch's commit:

* a TaskManager after its change set is durable, before it answers the Prepare;
* the JobManager after every change set came back, before the decision;
* the JobManager after the decision, before the driver's answer (the decision must be replayed);
* the JobManager in the background apply, after the answer (the apply never comes);
* a TaskManager during the apply of a decided epoch, and right after it applied;
* the JobManager after the apply, before the checkpoint;
* a TaskManager at the checkpoint barrier after the apply.

The killed process is started again; the query must finish by itself, and every key's count,
sum and exact multiset of event ids must equal the plain-Python reference: nothing lost, nothing
doubled. The race of a decision write in flight with a new leader's seal is a storage race, not
a process step: ``tests/unit/jobmanager/checkpoint/test_decisions.py`` runs it with real
concurrent writers on file:// and S3.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from keyedstate.common.faults import ENV as CRASH_AT
from tests.integration.exactly_once._asserts import QUERY_TIMEOUT_S, assert_finished_exactly
from tests.integration.exactly_once._pipeline import FAST_RESTARTS, ExactlyOncePipeline

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

OVERLAPPED = {**FAST_RESTARTS, "execution.checkpointing.commit-mode": "overlapped"}


@pytest.fixture
def commit_mode() -> str:
    """The exactly-once pipeline fixture's mode: these tests are about the overlapped protocol only."""
    return "overlapped"


TASKMANAGER_STEPS = [
    "taskmanager.epoch.change-set-written@2",
    "taskmanager.epoch.before-commit@2",
    "taskmanager.epoch.committed@2",
    "taskmanager.checkpoint.barrier@2",
]
JOBMANAGER_STEPS = [
    "jobmanager.epoch.before-decision@2",
    "jobmanager.epoch.decided@2",
    "jobmanager.epoch.before-apply@2",
    "jobmanager.epoch.applied@2",
]


@pytest.mark.parametrize("crash_at", TASKMANAGER_STEPS)
def test_a_taskmanager_killed_at_a_step_of_the_overlapped_commit_loses_and_doubles_nothing(
    exo_pipeline: Callable[..., ExactlyOncePipeline], crash_at: str
) -> None:
    pipeline = exo_pipeline(files=5, config=OVERLAPPED, tm_env={1: {CRASH_AT: crash_at}})
    pipeline.write_files()
    run = pipeline.start_query()
    pipeline.wait_for_dead(1)
    assert "crash point" in pipeline.cluster.taskmanagers[1].log_tail(80)
    pipeline.restart_taskmanager(1)
    outcome = run.wait(QUERY_TIMEOUT_S)
    assert_finished_exactly(pipeline, outcome)


@pytest.mark.parametrize("crash_at", JOBMANAGER_STEPS)
def test_the_jobmanager_killed_at_a_step_of_the_overlapped_commit_loses_and_doubles_nothing(
    exo_pipeline: Callable[..., ExactlyOncePipeline], crash_at: str
) -> None:
    pipeline = exo_pipeline(files=5, config=OVERLAPPED, jm_env={CRASH_AT: crash_at})
    pipeline.write_files()
    run = pipeline.start_query()
    jobmanager = pipeline.cluster.jobmanager
    assert jobmanager is not None
    deadline = time.monotonic() + 120
    while jobmanager.alive:
        assert time.monotonic() < deadline, f"the crash point {crash_at} was never reached"
        time.sleep(0.05)
    assert "crash point" in jobmanager.log_tail(80)
    pipeline.cluster.restart_jobmanager()  # a new leader: HA store, latest checkpoint, decisions above it
    outcome = run.wait(QUERY_TIMEOUT_S)
    assert_finished_exactly(pipeline, outcome)
