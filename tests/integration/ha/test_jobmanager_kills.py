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
import time
from typing import Any

import pytest

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common.storage import open_storage
from keyedstate.jobmanager.checkpoint import _paths, load_checkpoint, plan_gc
from tests.fixtures.s3 import s3_configuration
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
    before = _completed_ids(cluster)
    assert before, "no checkpoint completed before the crash"
    # Arm the crash point in a JobManager started afresh, so the count of passes starts at 0.
    cluster.restart_jobmanager(env={"KEYEDSTATE_CRASH_AT": crash_at})
    driver.wait_running()
    import threading

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
    figures = {
        "kill_to_running_s": round(recovered_s, 2),
        "before": before,
        "after_crash": after_crash,
        "newest_epoch_at_crash": newest_epoch,
        "pointers_at_crash": pointers_at_crash,
    }
    return driver, figures


def test_jobmanager_killed_between_barrier_and_completion(ha_cluster: Any) -> None:
    cluster = ha_cluster
    # 2 subtasks acknowledge each checkpoint. The restarted JobManager first recovers (no acks),
    # then epochs 3.. run: ack 1 is the first of the next checkpoint: kill -9 right there, after
    # the barrier reached every TaskManager and before the checkpoint could complete.
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
def test_jobmanager_killed_right_after_metadata_is_written(ha_cluster: Any) -> None:
    cluster = ha_cluster
    driver, figures = _run_through_a_crash(cluster, "jobmanager.checkpoint.metadata-written@1", 3, 6)
    try:
        crashed = max(figures["after_crash"])
        assert crashed > max(figures["before"]), "the crash point fires after _metadata is written"
        # The checkpoint whose _metadata beat its HA pointer is complete and was taken back: the
        # epoch it holds is committed, so the driver's retry of that epoch applied nothing twice.
        assert figures["newest_epoch_at_crash"] == 3 and crashed not in figures["pointers_at_crash"]
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
            deadline = time.monotonic() + 60
            while driver.client.job_info(JOB).applied_epoch < 2:
                assert time.monotonic() < deadline, "epoch 2 was not applied after the overlapped commit"
                time.sleep(0.05)
            # ... and so does its checkpoint: the orphan check compares the store's pointers with the
            # completed chk-<n> directories, which a checkpoint completing in between sets apart.
            _await_checkpoint_at(cluster, 2)
        driver.verify()
        _assert_no_orphans(cluster)
    finally:
        driver.close()
