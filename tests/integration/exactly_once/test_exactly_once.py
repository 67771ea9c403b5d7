"""Every micro-batch applied exactly once through any single failure or operator action.

Each test drives the README's PySpark pipeline (``_pipeline.py``: real JobManager and
TaskManager processes, real PySpark, Parquet files, one file per micro-batch) through one fault
or operator action, and compares every key's count, sum and exact multiset of event ids with a
plain-Python reference. Tests are numbered after the failures of the exactly-once issue.

Every test runs in both commit modes (``commit_mode``, conftest.py). The default suite keeps, per
commit mode, one test per failure class; the other combinations of a class run in the exhaustive
tier (``make test-all``, ``pytest -m exhaustive``), each naming the default test that covers it:

* the shuffle-free twins of tests 1 and 2: the kill and its detection are the same, and the
  shuffle-free commit path (a slot applying the winners of several partitions) meets a TaskManager
  death in test 4's shuffle-free case, kept in the default suite in both commit modes;
* test 4 (a TaskManager dying in the commit) keeps one crash point per foreach_batch mode: in
  sync mode ``before-commit`` keyed and ``committed`` shuffle-free; in overlapped mode
  ``before-commit`` shuffle-free, while its keyed cases are the very kills of
  tests/integration/overlapped/test_overlapped_kills.py (which kills TaskManagers at two more steps
  of the overlapped commit); the slot-process variant keeps ``before-commit`` in sync mode and
  ``committed`` in overlapped mode, so each crash point stays in the default suite in one mode;
* test 7 with 2 slot processes: the restart counted once is the JobManager's; that a kill -9 of
  the TaskManager takes its slot processes down and its restart serves again is
  tests/integration/serving/test_slot_processes.py's
  ``test_slot_processes_die_with_a_killed_taskmanager_and_its_restart_serves_again_and_cleans_up``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.client import CheckpointStatus
from keyedstate.common.errors import KeyedStateError
from keyedstate.common.faults import ENV as CRASH_AT
from keyedstate.common.keygroups import subtask_for_key_group
from tests.fixtures.tiers import exhaustive
from tests.integration.exactly_once._asserts import (
    QUERY_TIMEOUT_S,
    assert_finished_exactly,
    assert_state_is_one_of,
)
from tests.integration.exactly_once._pipeline import (
    FAST_RESTARTS,
    ExactlyOncePipeline,
    QueryRun,
    operators,
    read_reports,
)

pytestmark = [pytest.mark.spark, pytest.mark.timeout(240)]


def _keyed_by_default(test: str) -> pytest.MarkDecorator:
    """``commit_mode`` x ``mode`` (the foreach_batch mode): the keyed case in the default suite, the
    shuffle-free twin in the exhaustive tier (the module docstring says why)."""
    return pytest.mark.parametrize(
        ("commit_mode", "mode"),
        [
            ("sync", "keyed"),
            exhaustive("sync", "shuffle_free", covered_by=f"{test}[sync-keyed]"),
            ("overlapped", "keyed"),
            exhaustive("overlapped", "shuffle_free", covered_by=f"{test}[overlapped-keyed]"),
        ],
    )


@_keyed_by_default("test_1_kill_between_epoch_commit_and_its_checkpoint_loses_no_batch")
def test_1_kill_between_epoch_commit_and_its_checkpoint_loses_no_batch(
    exo_pipeline: Callable[..., ExactlyOncePipeline], mode: str
) -> None:
    # Default configuration. TaskManager 1 dies when the barrier of the first checkpoint reaches it:
    # both TaskManagers have committed epoch 0, its checkpoint cannot complete, and the job has no
    # completed checkpoint to restart from.
    pipeline = exo_pipeline(tm_env={1: {CRASH_AT: "taskmanager.checkpoint.barrier@1"}}, mode=mode)
    pipeline.write_files()
    run = pipeline.start_query()
    pipeline.wait_for_dead(1)
    pipeline.restart_taskmanager(1)
    outcome = run.wait(QUERY_TIMEOUT_S)
    assert_finished_exactly(pipeline, outcome)


@_keyed_by_default("test_2_kill_noticed_by_heartbeat_only_loses_no_batch")
def test_2_kill_noticed_by_heartbeat_only_loses_no_batch(
    exo_pipeline: Callable[..., ExactlyOncePipeline], mode: str
) -> None:
    # No connection-loss detection: the JobManager learns of the loss by missed heartbeats only.
    # TaskManager 1 dies on the barrier of the third checkpoint, the one of epoch 2, so the job's
    # latest completed checkpoint holds epoch 1.
    pipeline = exo_pipeline(
        config={
            "heartbeat.connection-loss-detection": "false",
            "heartbeat.interval": "100 ms",
            "heartbeat.timeout": "1 s",
            **FAST_RESTARTS,
        },
        tm_env={1: {CRASH_AT: "taskmanager.checkpoint.barrier@3"}},
        mode=mode,
    )
    pipeline.write_files()
    run = pipeline.start_query()
    pipeline.wait_for_dead(1)
    # The TaskManager comes back only once the heartbeat timeout declared it lost.
    pipeline.wait_for_job(
        lambda i: i.status != pb.JOB_STATUS_RUNNING or i.restarts >= 1, "the heartbeat-detected loss", 30
    )
    pipeline.restart_taskmanager(1)
    outcome = run.wait(QUERY_TIMEOUT_S)
    assert_finished_exactly(pipeline, outcome)


def test_3_failing_checkpoints_on_slow_storage_never_lose_a_batch_silently(
    exo_pipeline: Callable[..., ExactlyOncePipeline],
) -> None:
    # Storage too slow for the checkpoint timeout. A checkpoint of this pipeline takes 50-100 ms on
    # this machine's local disk, so the 100 ms fails only some of them; 10 ms makes every
    # checkpoint expire, as a ten times slower storage does with 100 ms. No process fault at all.
    pipeline = exo_pipeline(config={"execution.checkpointing.timeout": "10 ms", **FAST_RESTARTS})
    pipeline.write_files()
    outcome = pipeline.run(QUERY_TIMEOUT_S)
    assert outcome.finished, f"the query did not end within its deadline: {outcome.describe()}"
    if outcome.error is None:
        assert_finished_exactly(pipeline, outcome)
        return
    # Stopping is acceptable only loudly, naming the checkpoint failure, and with no batch Spark
    # recorded missing from the state (the failed batch itself either applied whole or not at all).
    assert "CHECKPOINT_EXPIRED" in outcome.error, (
        f"the query stopped, but not naming the checkpoint failure: {outcome.describe()}"
    )
    recorded = sorted(outcome.recorded)
    assert recorded == list(range(len(recorded))), outcome.describe()
    assert_state_is_one_of(
        pipeline,
        [recorded, recorded + [len(recorded)]],
        f"the query {outcome.describe()}; Spark recorded batches {recorded} as done",
    )


BEFORE_COMMIT = "taskmanager.epoch.before-commit"
COMMITTED = "taskmanager.epoch.committed"
_T4 = "test_4_taskmanager_dying_during_an_epoch_commit_reruns_the_batch"


_OVERLAPPED_KILLS = (
    "tests/integration/overlapped/test_overlapped_kills.py::"
    "test_a_taskmanager_killed_at_a_step_of_the_overlapped_commit_loses_and_doubles_nothing"
)


@pytest.mark.parametrize(
    ("commit_mode", "crash_point", "mode"),
    [
        ("sync", BEFORE_COMMIT, "keyed"),
        exhaustive("sync", BEFORE_COMMIT, "shuffle_free", covered_by=f"{_T4}[sync-{COMMITTED}-shuffle_free]"),
        exhaustive("sync", COMMITTED, "keyed", covered_by=f"{_T4}[sync-{BEFORE_COMMIT}-keyed]"),
        ("sync", COMMITTED, "shuffle_free"),
        # The same kill as the overlapped kill tests' (crash point @2, keyed, 5 files, FAST_RESTARTS).
        exhaustive("overlapped", BEFORE_COMMIT, "keyed", covered_by=f"{_OVERLAPPED_KILLS}[{BEFORE_COMMIT}@2]"),
        ("overlapped", BEFORE_COMMIT, "shuffle_free"),
        exhaustive("overlapped", COMMITTED, "keyed", covered_by=f"{_OVERLAPPED_KILLS}[{COMMITTED}@2]"),
        exhaustive(
            "overlapped", COMMITTED, "shuffle_free", covered_by=f"{_T4}[overlapped-{BEFORE_COMMIT}-shuffle_free]"
        ),
    ],
)
def test_4_taskmanager_dying_during_an_epoch_commit_reruns_the_batch(
    exo_pipeline: Callable[..., ExactlyOncePipeline], crash_point: str, mode: str
) -> None:
    # TaskManager 1 dies inside the commit of epoch 1 (its second commit): before applying it, or
    # right after. Epoch 0 and its checkpoint are complete, so the job restarts from epoch 0.
    pipeline = exo_pipeline(config=FAST_RESTARTS, tm_env={1: {CRASH_AT: f"{crash_point}@2"}}, mode=mode)
    pipeline.write_files()
    run = pipeline.start_query()
    pipeline.wait_for_dead(1)
    pipeline.restart_taskmanager(1)
    outcome = run.wait(QUERY_TIMEOUT_S)
    assert_finished_exactly(pipeline, outcome)


_T4S = "test_4_slot_process_dying_during_an_epoch_commit_reruns_the_batch"


@pytest.mark.parametrize(
    ("commit_mode", "crash_point"),
    [
        ("sync", BEFORE_COMMIT),
        exhaustive("sync", COMMITTED, covered_by=f"{_T4S}[sync-{BEFORE_COMMIT}]"),
        exhaustive("overlapped", BEFORE_COMMIT, covered_by=f"{_T4S}[overlapped-{COMMITTED}]"),
        ("overlapped", COMMITTED),
    ],
)
def test_4_slot_process_dying_during_an_epoch_commit_reruns_the_batch(
    exo_pipeline: Callable[..., ExactlyOncePipeline], crash_point: str
) -> None:
    # With 2 slot processes per TaskManager the commit code runs in the slot processes: those of
    # TaskManager 1 die inside the commit of epoch 1 (before applying it, or right after). The
    # TaskManager lives on, replaces them and registers again; the job fails over and reruns the batch.
    pipeline = exo_pipeline(
        config={**FAST_RESTARTS, "taskmanager.slot-processes": "2"},
        tm_env={1: {CRASH_AT: f"{crash_point}@2"}},
    )
    pipeline.write_files()
    outcome = pipeline.start_query().wait(QUERY_TIMEOUT_S)
    assert pipeline.cluster.taskmanagers[1].alive
    assert_finished_exactly(pipeline, outcome)


def test_6_commit_whose_checkpoint_was_refused_survives_a_later_failover(
    exo_pipeline: Callable[..., ExactlyOncePipeline],
) -> None:
    # Periodic checkpoints as often as a 30 ms min-pause allows, at most one at a time, so the
    # checkpoint an epoch commit asks for often finds one in flight and is refused with
    # TOO_MANY_CHECKPOINT_REQUESTS. After a batch whose foreachBatch returned that way, the test
    # waits until no checkpoint is in flight (the one that refused it was triggered before the
    # commit) and kills TaskManager 1 within the min-pause that follows: no checkpoint holding the
    # batch's epoch can complete before the failover then. (If one holding it completed first,
    # nothing can be lost that time, and the next such batch is tried.) Without such a batch
    # TaskManager 1 is killed after batch 5 all the same, so the test always covers a failover
    # (there, a checkpoint refused with MINIMUM_TIME_BETWEEN_CHECKPOINTS is the same accepted
    # failure). Batch 0 is left out: a job without any checkpoint is failure 1.
    pipeline = exo_pipeline(
        files=8,
        config={
            "execution.checkpointing.interval": "10 ms",
            "execution.checkpointing.min-pause": "30 ms",
            "execution.checkpointing.max-concurrent-checkpoints": "1",
            # Back-to-back periodic checkpoints sometimes fail on their own; none of that is this test's business.
            "execution.checkpointing.tolerable-failed-checkpoints": "1000",
            **FAST_RESTARTS,
        },
    )
    pipeline.write_files()
    kills: list[tuple[int, str, int]] = []  # (batch, its last checkpoint answer, committed epoch after the restart)

    def quiet_moment_without(epoch: int) -> bool:
        """Wait until no checkpoint is in flight; False if one holding ``epoch`` completed first."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            checkpoints = [c for c in _checkpoints(pipeline) if not c.savepoint]
            if any(c.status == jm_pb.CHECKPOINT_STATUS_COMPLETED and c.epoch >= epoch for c in checkpoints):
                return False
            if not any(c.status == jm_pb.CHECKPOINT_STATUS_IN_PROGRESS for c in checkpoints):
                return True
            time.sleep(0.001)
        return False

    def after_batch(batch_id: int, run: QueryRun) -> None:
        if batch_id == 0 or len(kills) >= 3 or any(committed < batch for batch, _, committed in kills):
            return
        last = run.runtime.last_checkpoint if run.runtime is not None else None
        refused = last is not None and last.status is not CheckpointStatus.COMPLETED
        too_many = refused and last is not None and "TOO_MANY_CHECKPOINT_REQUESTS" in last.failure_reason
        last_chance = batch_id == 5 and not kills
        if not (too_many or last_chance):
            return
        if refused and not quiet_moment_without(batch_id) and not last_chance:
            return
        pipeline.kill_taskmanager(1)
        pipeline.wait_for_job(lambda i: i.status != pb.JOB_STATUS_RUNNING, "the failover after the kill", 30)
        pipeline.restart_taskmanager(1)
        info = pipeline.wait_for_job(lambda i: i.status == pb.JOB_STATUS_RUNNING, "RUNNING after the failover", 60)
        answer = f"{last.status} {last.failure_reason[:110]}" if last is not None else "none"
        kills.append((batch_id, answer, info.committed_epoch))

    outcome = pipeline.run(QUERY_TIMEOUT_S, after_batch=after_batch)
    assert kills, outcome.describe()
    try:
        assert_finished_exactly(pipeline, outcome)
    except AssertionError as exc:
        shown = " | ".join(
            f"after batch {b} (the checkpoint of its epoch: {c}) the job restarted at epoch {e}" for b, c, e in kills
        )
        raise AssertionError(f"{exc}\nTaskManager 1 killed: {shown}") from None


_T7 = "test_7_waiting_for_a_lost_taskmanager_counts_as_one_restart"


@pytest.mark.parametrize(
    ("commit_mode", "slot_processes"),
    [
        pytest.param("sync", 1, id="sync-one-process"),
        exhaustive("sync", 2, covered_by=f"{_T7}[sync-one-process]", case_id="sync-slot-processes-2"),
        pytest.param("overlapped", 1, id="overlapped-one-process"),
        exhaustive("overlapped", 2, covered_by=f"{_T7}[overlapped-one-process]", case_id="overlapped-slot-processes-2"),
    ],
)
def test_7_waiting_for_a_lost_taskmanager_counts_as_one_restart(
    exo_pipeline: Callable[..., ExactlyOncePipeline], slot_processes: int
) -> None:
    # No spare slots and a budget of two restarts: a TaskManager that takes several seconds to come
    # back must cost one restart, as in Flink (the job waits for slots up to slot.request.timeout).
    # With slot processes, kill -9 of the TaskManager takes its slot processes down with it.
    pipeline = exo_pipeline(
        files=5,
        config={
            "restart-strategy.type": "fixed-delay",
            "restart-strategy.fixed-delay.attempts": "2",
            "restart-strategy.fixed-delay.delay": "500 ms",
            "taskmanager.slot-processes": str(slot_processes),
        },
    )
    pipeline.write_files()
    run = pipeline.start_query()
    deadline = time.monotonic() + 60
    while not run.recorded and time.monotonic() < deadline:
        time.sleep(0.05)
    assert run.recorded, "the query committed no batch within 60 s"
    killed_at = time.monotonic()
    pipeline.kill_taskmanager(1)
    pipeline.wait_for_job(lambda i: i.status != pb.JOB_STATUS_RUNNING or i.restarts >= 1, "the loss to be noticed", 30)
    time.sleep(max(0.0, killed_at + 5.0 - time.monotonic()))  # a slow TaskManager restart: 5 s
    pipeline.restart_taskmanager(1)
    info = pipeline.wait_for_job(
        lambda i: i.status in (pb.JOB_STATUS_RUNNING, pb.JOB_STATUS_FAILED) and i.restarts >= 1,
        "RUNNING or FAILED after the TaskManager came back",
        60,
    )
    assert (info.status, info.restarts) == (pb.JOB_STATUS_RUNNING, 1), (
        f"one TaskManager loss, back after 5 s: job {info.status} after {info.restarts} restart(s) "
        f"(budget 2); cause: {info.failure_cause}"
    )
    assert_finished_exactly(pipeline, run.wait(QUERY_TIMEOUT_S))


def _savepoint(pipeline: ExactlyOncePipeline) -> tuple[str, int]:
    """``statectl savepoint JOB``, as an operator runs it: the savepoint's path and the epoch it holds."""
    done = pipeline.statectl("savepoint", pipeline.job_id, "--json")
    assert done.returncode == 0, f"statectl savepoint failed: {done.stdout} {done.stderr}"
    info = json.loads(done.stdout)
    assert info["status"] == "COMPLETED", info
    return info["path"], int(info.get("epoch", 0))


def test_8_restoring_a_savepoint_older_than_the_last_recorded_batch_is_refused(
    exo_pipeline: Callable[..., ExactlyOncePipeline],
) -> None:
    # The operator takes a savepoint after batch 1, the query runs batch 2 and stops; then the
    # savepoint is restored (statectl job restore) and the query restarts on its checkpointLocation.
    # Spark carries on with batch 3: batch 2 is in neither the state nor Spark's plan.
    pipeline = exo_pipeline(files=5, config=FAST_RESTARTS)
    pipeline.write_files(range(3))
    savepoint: list[tuple[str, int]] = []

    def after_batch(batch_id: int, run: QueryRun) -> None:
        if batch_id == 1:
            savepoint.append(_savepoint(pipeline))

    assert_finished_exactly(pipeline, pipeline.run(QUERY_TIMEOUT_S, after_batch=after_batch), range(3))
    path, epoch = savepoint[0]
    assert epoch == 1, f"the savepoint taken after batch 1 holds epoch {epoch}"
    restored = pipeline.statectl("job", "restore", pipeline.job_id, "--from", path)
    assert restored.returncode == 0, restored.stderr

    pipeline.write_files(range(3, 5))
    outcome = pipeline.run(QUERY_TIMEOUT_S)
    assert outcome.finished, outcome.describe()
    state = _state_if_served(pipeline, [0, 1])
    assert outcome.error is not None and "EpochGapError" in outcome.error, (
        f"restored a savepoint holding epoch 1 while Spark had recorded batch 2; the restarted query "
        f"{outcome.describe()}; state against the savepoint's batches 0-1: {state}"
    )
    assert state == EXACT, f"the query refused, but the state is not the savepoint's: {state}"


def test_9_restart_recipe_after_job_cancel_is_refused(exo_pipeline: Callable[..., ExactlyOncePipeline]) -> None:
    # The README's restart recipe after `statectl job cancel`: the restarted driver resubmits the
    # job id, which starts empty, and Spark carries on from its next batch.
    pipeline = exo_pipeline(files=5, config=FAST_RESTARTS)
    pipeline.write_files(range(3))
    assert_finished_exactly(pipeline, pipeline.run(QUERY_TIMEOUT_S), range(3))
    canceled = pipeline.statectl("job", "cancel", pipeline.job_id)
    assert canceled.returncode == 0, canceled.stderr

    pipeline.write_files(range(3, 5))
    outcome = pipeline.run(QUERY_TIMEOUT_S)
    assert outcome.finished, outcome.describe()
    state = _state_if_served(pipeline, [])
    assert outcome.error is not None and "EpochGapError" in outcome.error, (
        f"the job was cancelled after batch 2 and resubmitted empty; the restarted query {outcome.describe()}; "
        f"state against an empty job: {state}"
    )
    assert state in (EXACT, NOT_SERVED), f"the query refused, but applied batches on the empty job: {state}"


def test_10_restarted_driver_adopts_a_rescaled_job(exo_pipeline: Callable[..., ExactlyOncePipeline]) -> None:
    # `statectl job rescale` between two runs of the driver, which still declares parallelism 4.
    pipeline = exo_pipeline(files=5, config=FAST_RESTARTS)
    pipeline.write_files(range(3))
    assert_finished_exactly(pipeline, pipeline.run(QUERY_TIMEOUT_S), range(3))
    rescaled = pipeline.statectl("job", "rescale", pipeline.job_id, "--parallelism", "2")
    assert rescaled.returncode == 0, rescaled.stderr

    pipeline.write_files(range(3, 5))
    assert_finished_exactly(pipeline, pipeline.run(QUERY_TIMEOUT_S))
    parallelism = [op.parallelism for op in pipeline.job_info().operators]
    assert parallelism == [2], (
        f"the restarted driver must adopt the rescaled job, not undo it: parallelism {parallelism}"
    )


def test_11_batches_after_a_rescale_are_partitioned_by_the_new_parallelism(
    exo_pipeline: Callable[..., ExactlyOncePipeline], tmp_path: Path
) -> None:
    # A rescale from 4 to 2 between batch 1 and batch 2 while the query runs. Each task reports
    # its Spark partition and the key groups of its keys (_pipeline.make_process).
    reports = tmp_path / "reports"
    reports.mkdir()
    pipeline = exo_pipeline(files=5, config=FAST_RESTARTS)
    pipeline.write_files()

    def after_batch(batch_id: int, run: QueryRun) -> None:
        if batch_id == 1:
            rescaled = pipeline.statectl("job", "rescale", pipeline.job_id, "--parallelism", "2")
            assert rescaled.returncode == 0, rescaled.stderr

    assert_finished_exactly(pipeline, pipeline.run(QUERY_TIMEOUT_S, after_batch=after_batch, report_dir=reports))
    by_epoch: dict[int, list[dict[str, Any]]] = {}
    for r in read_reports(reports):
        by_epoch.setdefault(r["epoch"], []).append(r)
    assert sorted(by_epoch) == list(range(5)), sorted(by_epoch)
    problems = []
    for epoch, tasks in sorted(by_epoch.items()):
        parallelism = 4 if epoch <= 1 else 2
        partitions = sorted({t["partition"] for t in tasks})
        if partitions != list(range(parallelism)):
            problems.append(f"batch {epoch} ran in Spark partitions {partitions}, expected 0..{parallelism - 1}")
        for t in tasks:
            owners = sorted({subtask_for_key_group(t["max_parallelism"], parallelism, g) for g in t["key_groups"]})
            if owners not in ([], [t["partition"]]):
                problems.append(f"batch {epoch}: partition {t['partition']} held keys of subtasks {owners}")
    assert not problems, "after the rescale to 2: " + "; ".join(problems[:8])


def _state_if_served(pipeline: ExactlyOncePipeline, files: list[int]) -> str:
    """``EXACT`` if the job serves exactly the reference of ``files``, ``NOT_SERVED`` if it does not run
    (a refused resubmission leaves it cancelled), else what differs."""
    if pipeline.job_info().status in (pb.JOB_STATUS_CANCELED, pb.JOB_STATUS_FAILED):
        return NOT_SERVED
    return pipeline.diff(files) or EXACT


EXACT = "exactly the reference"
NOT_SERVED = "not served (the job is not running)"


BALLAST_MB = 128
"""State that makes a full snapshot's upload take a moment (savepoints are full, checkpoints incremental)."""
BIG_STATE = {"state.backend.rocksdb.writebuffer.size": "4 mb", **FAST_RESTARTS}
"""Small memtables: the ballast lands in SST files that incremental checkpoints upload once."""


def _checkpoints(pipeline: ExactlyOncePipeline) -> list[Any]:
    """``statectl checkpoint list``'s source: every checkpoint the JobManager remembers, newest first."""
    return list(pipeline.client.list_checkpoints(pipeline.job_id).checkpoints)


def _wait_for_epoch_checkpoint(
    pipeline: ExactlyOncePipeline, after_id: int, run: QueryRun, timeout_s: float = 60.0
) -> Any:
    """The first epoch checkpoint newer than ``after_id``, caught while IN_PROGRESS when polling can
    catch it; None if the query ended first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        newer = [c for c in _checkpoints(pipeline) if not c.savepoint and c.checkpoint_id > after_id]
        if newer:
            return min(newer, key=lambda c: c.checkpoint_id)
        if run.query is None or not run.query.isActive:
            return None
        time.sleep(0.001)
    raise AssertionError(f"no checkpoint after {after_id} within {timeout_s:.0f} s")


def test_12_savepoints_taken_while_the_stream_runs_all_succeed(
    exo_pipeline: Callable[..., ExactlyOncePipeline],
) -> None:
    # Each savepoint is triggered while a batch's epoch checkpoint is in flight, so that checkpoint
    # (incremental, small) completes while the savepoint (a full snapshot of 128 MB) still uploads.
    pipeline = exo_pipeline(files=6, config=BIG_STATE)
    pipeline.write_files()
    runtime = pipeline.runtime()
    pipeline.write_ballast(BALLAST_MB)
    run = pipeline.start_query(runtime=runtime)
    taken: list[tuple[Any, Any]] = []  # (the epoch checkpoint it raced, the savepoint)
    last_id = 0
    while len(taken) < 5:
        checkpoint = _wait_for_epoch_checkpoint(pipeline, last_id, run)
        if checkpoint is None:
            break
        savepoint = pipeline.client.trigger_checkpoint(pipeline.job_id, savepoint=True, timeout_s=120)
        taken.append((checkpoint, savepoint))
        last_id = max(checkpoint.checkpoint_id, savepoint.checkpoint_id)
    assert_finished_exactly(pipeline, run.wait(QUERY_TIMEOUT_S))
    failed = [
        f"savepoint {i.checkpoint_id} (triggered while checkpoint {c.checkpoint_id} was {c.status}): {i.status} "
        f"{i.failure_reason[:300]}"
        for c, i in taken
        if i.status != jm_pb.CHECKPOINT_STATUS_COMPLETED
    ]
    assert len(taken) >= 3, f"only {len(taken)} savepoints could be taken while the stream ran"
    if failed:
        pytest.fail(f"{len(failed)} of {len(taken)} savepoints taken while the stream ran failed: " + "; ".join(failed))

    pipeline.client.cancel_job(pipeline.job_id)
    assert_each_savepoint_restores(pipeline, [i.path for _, i in taken])


def assert_each_savepoint_restores(pipeline: ExactlyOncePipeline, paths: list[str]) -> None:
    """Each savepoint has its ``_metadata`` and restores (as a new job) exactly the epochs it holds."""
    for n, path in enumerate(paths):
        metadata = Path(path.removeprefix("file://")) / "_metadata"
        assert metadata.is_file(), f"savepoint {path} has no _metadata"
        epoch = json.loads(metadata.read_text(encoding="utf-8"))["epoch"]
        job = f"restored-{n}"
        pipeline.client.submit_job(job, operators(pipeline.parallelism), restore_path=path)
        diff = pipeline.diff(range(epoch + 1), job_id=job)
        assert diff is None, f"savepoint {path} (epoch {epoch}) restores other state than batches 0-{epoch}: {diff}"
        pipeline.client.cancel_job(job)


def test_12_rescale_requested_during_an_inflight_checkpoint_waits_for_it(
    exo_pipeline: Callable[..., ExactlyOncePipeline],
) -> None:
    # Two rescales (4 -> 2 -> 4), each requested the moment a batch's epoch checkpoint is in flight.
    pipeline = exo_pipeline(files=6, config=BIG_STATE)
    pipeline.write_files()
    runtime = pipeline.runtime()
    pipeline.write_ballast(BALLAST_MB // 4)
    run = pipeline.start_query(runtime=runtime)
    results: list[tuple[bool, str]] = []  # (done, what happened)
    last_id = 0
    for parallelism in (2, 4):
        checkpoint = _wait_for_epoch_checkpoint(pipeline, last_id, run)
        assert checkpoint is not None, f"the query ended before rescale {len(results) + 1}: {run.wait(0).describe()}"
        try:
            table = pipeline.client.rescale_job(pipeline.job_id, parallelism, timeout_s=120)
            results.append(
                (
                    True,
                    f"to {parallelism} during checkpoint {checkpoint.checkpoint_id} "
                    f"({checkpoint.status}): done (routing v{table.version})",
                )
            )
        except KeyedStateError as exc:
            results.append(
                (
                    False,
                    f"to {parallelism} during checkpoint {checkpoint.checkpoint_id} "
                    f"({checkpoint.status}): {type(exc).__name__}: {exc.message}",
                )
            )
        last_id = max(c.checkpoint_id for c in _checkpoints(pipeline))
    if not all(done for done, _ in results):
        pytest.fail(
            "a rescale requested while an epoch checkpoint was in flight was refused instead of waiting "
            "for it: " + "; ".join(text for _, text in results)
        )
    assert_finished_exactly(pipeline, run.wait(QUERY_TIMEOUT_S))
    parallelism_now = [op.parallelism for op in pipeline.job_info().operators]
    assert parallelism_now == [4], parallelism_now
