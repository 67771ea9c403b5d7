"""JobManager high availability with real processes, real kills and a real S3 API server.

The JobManager keeps its jobs, completed-checkpoint pointers and checkpoint id counter under
``high-availability.storageDir`` on S3 (moto server on loopback); checkpoints go to the same
bucket. Each test drives epochs like a Spark driver, SIGKILLs the JobManager at a precise
point (a crash point, common/faults.py, fires SIGKILL inside the process at that line), starts
a new JobManager on the same port, and checks that:

* the job resumes from its latest completed checkpoint and TaskManagers re-register by themselves;
* a checkpoint that was not fully acknowledged is never treated as complete;
* checkpoint ids never go backwards;
* every key equals a plain-Python reference (nothing lost, nothing doubled);
* no orphan files are left in checkpoint storage.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from typing import Any

import pytest

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.client import BatchAction, ClientSettings, EpochScope, StateClient
from keyedstate.common.errors import KeyedStateError
from keyedstate.common.faults import ENV as CRASH_AT
from keyedstate.common.storage import open_storage
from keyedstate.jobmanager.checkpoint import _paths, load_checkpoint, plan_gc
from tests.fixtures.s3 import s3_configuration
from tests.fixtures.tiers import exhaustive
from tests.integration.ha._driver import JOB, EpochDriver, operators

pytestmark = pytest.mark.s3

RETAINED = 2


@pytest.fixture
def commit_mode() -> str:
    """``execution.checkpointing.commit-mode`` of ``ha_cluster`` (a test parametrizes it to run in both)."""
    return "sync"


@pytest.fixture
def retained() -> int:
    """``execution.checkpointing.num-retained`` of ``ha_cluster`` (a test parametrizes it to keep more)."""
    return RETAINED


@pytest.fixture
def ha_cluster(process_cluster: Any, s3_bucket: tuple[str, str], commit_mode: str, retained: int) -> Any:
    endpoint, bucket = s3_bucket
    s3 = {k: str(v) for k, v in s3_configuration(endpoint).to_dict().items()}
    config = {
        **s3,
        "state.checkpoints.dir": f"s3://{bucket}/checkpoints",
        "high-availability.type": "filesystem",
        "high-availability.storageDir": f"s3://{bucket}/ha",
        "high-availability.filesystem.lease-check-interval": "1 s",
        "execution.checkpointing.num-retained": str(retained),
        "restart-strategy.type": "fixed-delay",
        "restart-strategy.fixed-delay.attempts": "20",
        "restart-strategy.fixed-delay.delay": "200 ms",
        "execution.checkpointing.commit-mode": commit_mode,
    }
    cluster = process_cluster(taskmanagers=2, slots=2, config=config)
    cluster.bucket = bucket
    cluster.retained = retained
    cluster.commit_mode = commit_mode
    cluster.storage = open_storage(f"s3://{bucket}/", s3_configuration(endpoint))
    return cluster


def _job_dir(cluster: Any) -> str:
    return f"s3://{cluster.bucket}/checkpoints/{JOB}"


def _completed_ids(cluster: Any) -> list[int]:
    out = []
    for info in cluster.storage.list(_job_dir(cluster)):
        cid = _paths.parse_checkpoint_dir_name(_paths.name(info.path))
        if cid is not None and cluster.storage.exists(f"{info.path}/_metadata"):
            out.append(cid)
    return sorted(out)


def _latest_checkpoint_epoch(cluster: Any) -> int:
    ids = _completed_ids(cluster)
    return load_checkpoint(cluster.storage, f"{_job_dir(cluster)}/chk-{ids[-1]}").epoch if ids else -1


def _await_checkpoint_at(cluster: Any, epoch: int, timeout_s: float = 60.0) -> None:
    """Wait for a completed checkpoint holding ``epoch`` (overlapped commits checkpoint behind the driver)."""
    deadline = time.monotonic() + timeout_s
    while _latest_checkpoint_epoch(cluster) < epoch:
        assert time.monotonic() < deadline, f"no checkpoint at epoch {epoch} after the overlapped commits"
        time.sleep(0.1)


def _settle(cluster: Any, driver: EpochDriver, epoch: int) -> None:
    """Overlapped commits: wait until ``epoch``, which the driver saw decided, is applied, then take a
    checkpoint holding it.

    The apply and the checkpoint run behind the driver: reads see the epoch only once it is applied,
    and a checkpoint completing between reading the HA store's pointers and listing the ``chk-<n>``
    directories would set the two apart (a race of the test, not of the JobManager). No checkpoint is
    triggered here: the apply of a commit checkpoints by itself, and so does a new leader that replayed
    the epoch (the driver's retry then finds it decided and commits nothing)."""
    if cluster.commit_mode == "overlapped":
        driver.client.wait_for_applied(driver.job, epoch)
        _await_checkpoint_at(cluster, epoch)


def _pointer_ids(cluster: Any) -> list[int]:
    base = f"s3://{cluster.bucket}/ha/default/jobs/{JOB}/checkpoints"
    return sorted(json.loads(cluster.storage.read_bytes(i.path))["checkpoint_id"] for i in cluster.storage.list(base))


def _assert_no_orphans(cluster: Any, timeout_s: float = 30.0) -> None:
    """Everything under the job's checkpoint directory is referenced by a retained checkpoint."""
    deadline = time.monotonic() + timeout_s
    while True:  # subsumed checkpoints are deleted asynchronously after completion
        plan = plan_gc(cluster.storage, _job_dir(cluster), num_retained=cluster.retained)
        if not plan.remove:
            break
        if time.monotonic() > deadline:
            raise AssertionError("orphan files in checkpoint storage:\n" + plan.describe())
        time.sleep(0.2)
    assert _pointer_ids(cluster) == _completed_ids(cluster)[-cluster.retained :]


def _assert_restorable(cluster: Any) -> None:
    """Every file every retained checkpoint references exists (what a restore would download)."""
    missing = []
    for cid in _completed_ids(cluster):
        directory = f"{_job_dir(cluster)}/chk-{cid}"
        for _op, _sub, f in load_checkpoint(cluster.storage, directory).files():
            path = _paths.join(directory, f.path)
            if not cluster.storage.exists(path):
                missing.append(f"chk-{cid}: {f.path}")
    assert not missing, "retained checkpoints reference deleted files:\n" + "\n".join(missing)


def _start(cluster: Any) -> EpochDriver:
    driver = EpochDriver(cluster.jobmanager_address)
    driver.client.submit_job(JOB, operators(2), max_parallelism=32)
    return driver


def _await_crash(cluster: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while cluster.jobmanager.alive:
        assert time.monotonic() < deadline, "the crash point was never reached"
        time.sleep(0.02)
    assert "crash point" in cluster.jobmanager.log_tail(50)


def _run_through_a_crash(
    cluster: Any, crash_at: str, epochs_before: int, total_epochs: int
) -> tuple[EpochDriver, dict[str, Any]]:
    driver = _start(cluster)
    for epoch in range(epochs_before):
        driver.run_epoch(epoch)
    # Overlapped: the checkpoint of the last epoch must not complete behind the ids read here.
    _settle(cluster, driver, epochs_before - 1)
    before = _completed_ids(cluster)
    assert before, "no checkpoint completed before the crash"
    # Arm the crash point in a JobManager started afresh, so the count of passes starts at 0.
    cluster.restart_jobmanager(env={"KEYEDSTATE_CRASH_AT": crash_at})
    driver.wait_running()
    errors: list[BaseException] = []
    done = threading.Event()

    def drive() -> None:
        try:
            for epoch in range(epochs_before, total_epochs):
                driver.run_epoch(epoch)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            done.set()

    worker = threading.Thread(target=drive, daemon=True)
    worker.start()
    _await_crash(cluster)
    killed_at = time.monotonic()
    after_crash = _completed_ids(cluster)
    newest_epoch = load_checkpoint(cluster.storage, f"{_job_dir(cluster)}/chk-{max(after_crash)}").epoch
    pointers_at_crash = _pointer_ids(cluster)
    cluster.start_jobmanager()  # same port, no crash point
    driver_probe = EpochDriver(cluster.jobmanager_address)
    try:
        driver_probe.wait_running(120)
    finally:
        driver_probe.close()
    recovered_s = time.monotonic() - killed_at
    assert done.wait(300), "the driver did not finish after the JobManager came back"
    assert not errors, errors
    _settle(cluster, driver, total_epochs - 1)
    figures = {
        "kill_to_running_s": round(recovered_s, 2),
        "before": before,
        "after_crash": after_crash,
        "newest_epoch_at_crash": newest_epoch,
        "pointers_at_crash": pointers_at_crash,
    }
    return driver, figures


@pytest.mark.parametrize("commit_mode", ["sync", "overlapped"])
def test_jobmanager_killed_between_barrier_and_completion(ha_cluster: Any, commit_mode: str) -> None:
    cluster = ha_cluster
    # 2 subtasks acknowledge each checkpoint. The restarted JobManager first recovers (no acks),
    # then epochs 3.. run: ack 1 is the first of the next checkpoint: kill -9 right there, after
    # the barrier reached every TaskManager and before the checkpoint could complete. Overlapped,
    # that checkpoint runs after epoch 3 was decided and applied, while the driver runs on: the
    # new leader restores the checkpoint before it and replays the decisions above it.
    driver, figures = _run_through_a_crash(cluster, "jobmanager.checkpoint.acknowledged@1", 3, 6)
    try:
        in_flight = max(figures["after_crash"]) + 1
        assert figures["after_crash"] == figures["before"], "a checkpoint completed although the JobManager died first"
        ids = _completed_ids(cluster)
        assert in_flight not in ids, f"checkpoint {in_flight} was not fully acknowledged but has _metadata"
        assert min(i for i in ids if i > max(figures["before"])) > in_flight, (
            f"checkpoint ids went backwards or reused {in_flight}: {ids}"
        )
        info = driver.client.job_info(JOB)
        assert info.status == pb.JOB_STATUS_RUNNING and info.committed_epoch == 5 and info.restarts == 0
        driver.verify()
        _assert_no_orphans(cluster)
        _assert_restorable(cluster)
        print(f"\nJobManager killed between barrier and completion: {figures}, driver re-runs {driver.reruns}")
    finally:
        driver.close()


# Retained long enough that the taken-back checkpoint is still retained at the end: its files
# must all be there (the TaskManagers, never told it completed, once deleted them when a newer
# checkpoint completed).
@pytest.mark.parametrize("retained", [10])
@pytest.mark.parametrize("commit_mode", ["sync", "overlapped"])
def test_jobmanager_killed_right_after_metadata_is_written(ha_cluster: Any, commit_mode: str) -> None:
    cluster = ha_cluster
    driver, figures = _run_through_a_crash(cluster, "jobmanager.checkpoint.metadata-written@1", 3, 6)
    try:
        crashed = max(figures["after_crash"])
        assert crashed > max(figures["before"]), "the crash point fires after _metadata is written"
        # The checkpoint whose _metadata beat its HA pointer is complete and was taken back: the
        # epoch it holds is committed, so the driver's retry of that epoch applied nothing twice.
        # Overlapped, the first checkpoint after the restart runs behind the driver and holds the
        # newest applied epoch then (3, or a later one when the next commits came first); the
        # decisions above it are replayed on top of it.
        if commit_mode == "sync":
            assert figures["newest_epoch_at_crash"] == 3
        else:
            assert 3 <= figures["newest_epoch_at_crash"] <= 5, figures
        assert crashed not in figures["pointers_at_crash"]
        ids = _completed_ids(cluster)
        assert ids[-1] > crashed and all(b > a for a, b in itertools.pairwise(ids))
        info = driver.client.job_info(JOB)
        assert info.status == pb.JOB_STATUS_RUNNING and info.committed_epoch == 5
        driver.verify()
        _assert_no_orphans(cluster)
        # The TaskManagers never heard that the taken-back checkpoint completed: when a newer one
        # subsumes it they must leave its files (newer checkpoints reference its shared ones).
        _assert_restorable(cluster)
        print(f"\nJobManager killed right after _metadata: {figures}, driver re-runs {driver.reruns}")
    finally:
        driver.close()


@pytest.mark.parametrize("commit_mode", ["sync", "overlapped"])
def test_restarted_jobmanager_resumes_its_job(ha_cluster: Any, commit_mode: str) -> None:
    """A plain kill -9 between batches: the job, its routing and its checkpoints come back.

    Overlapped: the decisions and change sets live on S3 (create-only writes through moto), and the
    new leader continues the latest checkpoint with the decided epochs above it."""
    cluster = ha_cluster
    driver = _start(cluster)
    try:
        for epoch in range(2):
            driver.run_epoch(epoch)
        if commit_mode == "overlapped":
            # The checkpoint after the last apply runs behind the driver: let it finish, so that no
            # half-written chk-<n> of the killed leader is left for the orphan check below.
            _await_checkpoint_at(cluster, 1)
        version = driver.client.routing(JOB, refresh=True).version
        tm_pids = [tm.process.pid for tm in cluster.taskmanagers]
        killed = time.monotonic()
        cluster.restart_jobmanager()
        info = driver.wait_running()
        print(f"\nJobManager kill -9 to job RUNNING: {time.monotonic() - killed:.2f} s")
        assert [tm.process.pid for tm in cluster.taskmanagers] == tm_pids  # TaskManagers re-registered by themselves
        assert driver.client.routing(JOB, refresh=True).version > version
        assert info.committed_epoch == 1 and info.latest_checkpoint_id == max(_completed_ids(cluster))
        driver.run_epoch(2)
        if commit_mode == "overlapped":
            # Reads outside an epoch see what the slots applied; the apply of epoch 2 runs behind the
            # driver's return, and the job says when every slot holds it.
            driver.client.wait_for_applied(JOB, 2)
            # ... and so does its checkpoint: the orphan check compares the store's pointers with the
            # completed chk-<n> directories, which a checkpoint completing in between sets apart.
            _await_checkpoint_at(cluster, 2)
        driver.verify()
        _assert_no_orphans(cluster)
    finally:
        driver.close()


def _changelog_epochs(cluster: Any) -> dict[str, list[int]]:
    """The epochs that still have change sets (``changes``) and decision or seal records (``records``)."""
    out: dict[str, list[int]] = {"changes": [], "records": []}
    base = f"{_job_dir(cluster)}/changelog"
    if not cluster.storage.exists(base):
        return out
    directories = [base]
    while directories:
        for info in cluster.storage.list(directories.pop()):
            name = _paths.name(info.path)
            if name.isdigit():
                out["changes"].append(int(name))
            elif "." in name:
                out["records"].append(int(name.split(".")[0]))
            elif name.startswith("g"):  # the job's changelog generation (a new job starts one)
                directories.append(info.path)
    return {k: sorted(v) for k, v in out.items()}


@pytest.mark.parametrize("retained", [1])
@pytest.mark.parametrize("commit_mode", ["overlapped"])
def test_new_leader_checkpoints_the_replayed_epochs_without_a_new_batch(ha_cluster: Any, commit_mode: str) -> None:
    """kill -9 after epoch 2 is decided, before it is applied or checkpointed: the new leader restores the
    checkpoint at epoch 1, replays epoch 2, and checkpoints epoch 2 by itself (no periodic checkpoints,
    no batch after the kill), after which the replayed change sets and decision are deleted."""
    cluster = ha_cluster
    driver = _start(cluster)
    # One attempt per call: the commit that dies with the leader must not be retried on the next one,
    # so that nothing but the restore itself can take the checkpoint this test waits for.
    one_shot = StateClient(cluster.jobmanager_address, ClientSettings(timeout_s=20, max_attempts=1))
    try:
        for epoch in range(2):
            driver.run_epoch(epoch)
        _settle(cluster, driver, 1)
        cluster.restart_jobmanager(env={"KEYEDSTATE_CRASH_AT": "jobmanager.epoch.decided@1"})
        driver.wait_running()
        start = one_shot.begin_batch(JOB, "", 2)
        assert start.action is BatchAction.RUN and start.epoch == 2, start
        scope = EpochScope(pb.EpochContext(epoch=2, partition=0, attempt=1), routing_version=start.routing.version)
        rows = driver.batch(2)
        driver._stage(rows, 2, scope)
        with pytest.raises(KeyedStateError):
            one_shot.commit_epoch(JOB, 2, [scope.winner()], batch_id=2, expected_routing_version=start.routing.version)
        _await_crash(cluster)
        assert _latest_checkpoint_epoch(cluster) == 1
        at_crash = _changelog_epochs(cluster)
        assert 2 in at_crash["changes"] and 2 in at_crash["records"], at_crash
        driver._apply_reference(2, rows)  # decided: the new leader's restore replays it
        killed = time.monotonic()
        cluster.start_jobmanager()
        driver.wait_running()
        _await_checkpoint_at(cluster, 2)
        checkpointed_s = time.monotonic() - killed
        deadline = time.monotonic() + 30
        while (left := _changelog_epochs(cluster))["changes"] or any(e <= 2 for e in left["records"]):
            assert time.monotonic() < deadline, f"the replayed changelog was not deleted: {left}"
            time.sleep(0.1)
        assert left["records"] == [3], left  # only the restore's seal of the epoch after the replay
        info = driver.client.job_info(JOB)
        assert info.status == pb.JOB_STATUS_RUNNING and info.committed_epoch == 2 and info.restarts == 0, info
        driver.client.wait_for_applied(driver.job, 2)
        driver.verify()
        _assert_no_orphans(cluster)
        _assert_restorable(cluster)
        print(f"\nkill -9 to the replayed epoch checkpointed and its changelog deleted: {checkpointed_s:.2f} s")
    finally:
        one_shot.close()
        driver.close()


# -- an operator restore (statectl job restore) of the running job, killed at each step ----------------

SOURCE_JOB = "ha-source"
SOURCE_EPOCH = 1
"""The epoch of the restored checkpoint (another job's, with the same operators)."""
JOB_EPOCHS = 5
"""Epochs 0..4 of the job before its restore: with 10 checkpoints retained their decisions stay (overlapped)."""
FIRST_EPOCH = {"sync": "jobmanager.epoch.committed@1", "overlapped": "jobmanager.epoch.decided@1"}
RESTORE_STEPS = [
    "jobmanager.restore.before-record",  # the old run's slots released, the restored run not recorded
    "jobmanager.restore.recorded",  # the restored run recorded, nothing deployed
    "jobmanager.restore.deployed",  # the source deployed, the old run's checkpoints still in the HA store
    "jobmanager.restore.adopted",  # the job's new coordinator claimed the source, not yet RUNNING
    "first-epoch",  # the first epoch after the restore committed (overlapped: decided, not applied)
]


def _source_checkpoint(cluster: Any) -> tuple[str, EpochDriver]:
    """A checkpoint of another job at epoch SOURCE_EPOCH whose id is above every id the restored job reaches.

    A new leader takes back the newest completed checkpoint among the HA pointers, so a source with a
    higher id than the job's own checkpoints is what it would restore if the restore had claimed it
    without recording the restored run: the window the old order left open."""
    source = EpochDriver(cluster.jobmanager_address, seed=11, job=SOURCE_JOB)
    source.client.submit_job(SOURCE_JOB, operators(2), max_parallelism=32)
    for epoch in range(SOURCE_EPOCH + 1):
        source.run_epoch(epoch)
    latest = None
    for _ in range(JOB_EPOCHS + 8):
        latest = source.client.trigger_checkpoint(SOURCE_JOB, wait=True)
        assert latest.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, latest
    assert latest is not None and latest.epoch == SOURCE_EPOCH
    source.client.cancel_job(SOURCE_JOB)  # its checkpoints stay; nothing of it runs on
    return latest.path, source


# The changelog generation is what overlapped commits add to a restore; sync mode shares the rest of
# the record's order (source, checkpoint ids), so its steps (about 25 s each) run in the exhaustive
# tier, each covered by the same step in overlapped mode, which crosses every sync step and more.
RESTORE_TEST = "test_jobmanager_killed_at_a_step_of_an_operator_restore_leaves_the_old_job_or_the_restored_one"
RESTORE_CASES = [pytest.param(step, "overlapped") for step in RESTORE_STEPS] + [
    exhaustive(step, "sync", covered_by=f"{RESTORE_TEST}[10-{step}-overlapped]") for step in RESTORE_STEPS
]


@pytest.mark.parametrize("retained", [10])
@pytest.mark.parametrize(("step", "commit_mode"), RESTORE_CASES)
def test_jobmanager_killed_at_a_step_of_an_operator_restore_leaves_the_old_job_or_the_restored_one(
    ha_cluster: Any, commit_mode: str, step: str
) -> None:
    """kill -9 at each step of ``statectl job restore`` of a running job: the new leader runs either the
    old job (its checkpoint and the decisions of its changelog generation) or the restored one (the
    source and what committed after it), decided by whether the restored run was recorded, never a
    mix of the two; every key is compared with the reference of the outcome the step must give."""
    cluster = ha_cluster
    source_path, source = _source_checkpoint(cluster)
    driver = _start(cluster)
    # After the restore the job holds the source's state and runs on from the source's epoch.
    restored = EpochDriver(cluster.jobmanager_address, seed=7)
    restored.reference = {k: list(v) for k, v in source.reference.items()}
    restored.events = {k: list(v) for k, v in source.events.items()}
    source.close()
    try:
        for epoch in range(JOB_EPOCHS):
            driver.run_epoch(epoch)
        ids = _completed_ids(cluster)
        source_id = _paths.parse_checkpoint_dir_name(_paths.name(source_path))
        assert source_id is not None and source_id > max(ids) + 2, (source_id, ids)
        crash_at = FIRST_EPOCH[commit_mode] if step == "first-epoch" else step
        cluster.restart_jobmanager(env={CRASH_AT: crash_at})  # armed afresh: the count of passes starts at 0
        driver.wait_running()
        if step == "first-epoch":
            restored.client.restore_job(JOB, source_path, claim_mode="CLAIM")
            first = threading.Thread(target=restored.run_epoch, args=(SOURCE_EPOCH + 1,), daemon=True)
            first.start()
            _await_crash(cluster)
        else:
            with pytest.raises(KeyedStateError):
                driver.client.restore_job(JOB, source_path, claim_mode="CLAIM")
            _await_crash(cluster)
        assert f"crash point {crash_at.partition('@')[0]} reached" in cluster.jobmanager.log_tail(50)
        cluster.start_jobmanager()  # same port, no crash point: the new leader recovers the job
        info = driver.wait_running(120)
        if step == "jobmanager.restore.before-record":
            # The old job, with everything it committed; it runs on.
            assert info.committed_epoch == JOB_EPOCHS - 1, info
            driver.client.wait_for_applied(driver.job, JOB_EPOCHS - 1)
            driver.verify()
            driver.run_epoch(JOB_EPOCHS)
            driver.client.wait_for_applied(driver.job, JOB_EPOCHS)
            driver.verify()
            _assert_restorable(cluster)
            return
        if step == "first-epoch":
            if commit_mode == "overlapped":
                # The new leader continued the source with the restored run's own decision, and only with it.
                assert info.committed_epoch == SOURCE_EPOCH + 1, info
            else:
                # Not durable yet, so the new leader comes back without it. The driver's retry may have run
                # it again already by the time the test looks, hence either epoch here; the proof is below.
                assert info.committed_epoch in (SOURCE_EPOCH, SOURCE_EPOCH + 1), info
            first.join(120)
            assert not first.is_alive(), (
                "the first epoch after the restore did not finish after the JobManager came back"
            )
            if commit_mode == "sync":
                # A leader that had kept the epoch would have answered ALREADY_COMMITTED: no second run.
                assert restored.attempts >= 2, "the new leader kept an epoch no checkpoint held"
        else:
            assert info.committed_epoch == SOURCE_EPOCH, info
            restored.run_epoch(SOURCE_EPOCH + 1)
        restored.client.wait_for_applied(
            restored.job, SOURCE_EPOCH + 1
        )  # overlapped: reads see an epoch once it is applied
        restored.verify()
        restored.run_epoch(SOURCE_EPOCH + 2)
        restored.client.wait_for_applied(restored.job, SOURCE_EPOCH + 2)
        assert restored.client.job_info(JOB).committed_epoch == SOURCE_EPOCH + 2
        restored.verify()
        _assert_restorable(cluster)
    finally:
        driver.close()
        restored.close()
