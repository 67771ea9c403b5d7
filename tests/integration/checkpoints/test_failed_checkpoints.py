"""A checkpoint that fails (declined by a TaskManager, or expired) leaves nothing in storage.

Declined: a plain FILE sits where one subtask must create its checkpoint directory (running as
root, permissions would not stop a write), so that subtask's upload fails for real while the
other subtask uploads and acknowledges. Expired: the TaskManager reaches S3 through a TCP proxy
that holds every byte while closed, so its upload is stuck for real; the JobManager runs on a
manual scheduler and the test moves time past the checkpoint timeout. In both cases the files
the checkpoint did upload, including the late ones, are deleted, and the next checkpoint and a
restore from it work. The reverse case (slow, opt in with ``-m slow``): an acknowledgement whose
answer times out may have completed the checkpoint, so its files must stay.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.config import Configuration
from keyedstate.common.storage import open_storage
from keyedstate.jobmanager.daemon import JobManager
from tests.fakes.scheduler import ManualScheduler
from tests.fixtures.cluster import FAST_HEARTBEATS, PATIENT, InProcessCluster
from tests.integration.checkpoints.conftest import (
    JOB,
    MAX_P,
    CheckpointCluster,
    GatedProxy,
    Workload,
    assert_state_equals,
    key_names,
    operators,
    relative_files,
    s3_keys,
    wait_for_files,
    wait_until,
)

TOLERANT = {"execution.checkpointing.tolerable-failed-checkpoints": "10"}


def _list_checkpoints(client: Any) -> dict[int, Any]:

    listing = client.list_checkpoints(JOB)
    return {c.checkpoint_id: c for c in listing.checkpoints}


@pytest.mark.parametrize(
    "backend,incremental", [("rocksdb", True), ("hashmap", False)], ids=["rocksdb-incremental", "hashmap"]
)
def test_declined_checkpoint_leaves_no_files(
    checkpoint_cluster: Callable[..., CheckpointCluster], backend: str, incremental: bool
) -> None:
    cc = checkpoint_cluster("file", backend)
    client = cc.client()
    client.submit_job(
        JOB,
        operators(2),
        max_parallelism=MAX_P,
        config={"execution.checkpointing.incremental": str(incremental).lower(), **TOLERANT},
    )
    work = Workload(client)
    work.write(key_names(1000), "a")
    first = client.trigger_checkpoint(JOB, timeout_s=60)
    assert first.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, first.failure_reason
    job_dir = cc.job_dir()
    before = relative_files(cc.storage, job_dir)

    work.write(key_names(1000)[::2] + key_names(300, "b"), "b")  # new SSTs for checkpoint 2 to upload
    blocker = Path(job_dir.removeprefix("file://")) / "chk-2" / "sessions-1"
    blocker.parent.mkdir()
    blocker.write_bytes(b"not a directory")
    failed = client.trigger_checkpoint(JOB, timeout_s=60)
    assert (failed.checkpoint_id, failed.status) == (2, jm_pb.CHECKPOINT_STATUS_FAILED)
    assert failed.failure_reason.startswith("CHECKPOINT_DECLINED")
    assert "sessions/1" in failed.failure_reason and "chk-2/sessions-1" in failed.failure_reason

    # The acknowledged subtask's uploads, the failed subtask's partial uploads, the directory:
    # all gone once the JobManager's and the TaskManagers' deletions ran.
    wait_for_files(cc.storage, job_dir, before, "the files of declined checkpoint 2 to be deleted", cc.flush_deletions)
    assert client.job_info(JOB).status == pb.JOB_STATUS_RUNNING, "tolerated failures must not fail the job over"

    third = client.trigger_checkpoint(JOB, timeout_s=60)
    assert third.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, third.failure_reason
    # The directory itself: an upload still in flight when checkpoint 2 was declined can create
    # it again after the first deletion (the TaskManager then deletes its files, not the empty
    # directories), so the cleaner sweeps an aborted checkpoint's directory again each time a later
    # checkpoint completes (CheckpointsCleaner.revisit). After checkpoint 3 it is gone.
    cc.flush_deletions()
    assert not blocker.parent.exists()
    expected = work.reference.copy()
    client.cancel_job(JOB)
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P, restore_path=third.path)
    assert_state_equals(work.read(), expected)


def test_declined_checkpoint_beyond_tolerance_fails_the_job_over_to_the_last_checkpoint(
    checkpoint_cluster: Callable[..., CheckpointCluster],
) -> None:
    cc = checkpoint_cluster("file", "hashmap")
    client = cc.client()
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P)  # tolerable-failed-checkpoints: 0
    work = Workload(client)
    work.write(key_names(500), "a")
    first = client.trigger_checkpoint(JOB, timeout_s=60)
    assert first.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, first.failure_reason
    at_first = work.reference.copy()
    work.write(key_names(500)[:100], "lost")
    blocker = Path(cc.job_dir().removeprefix("file://")) / "chk-2" / "sessions-0"
    blocker.parent.mkdir()
    blocker.write_bytes(b"")
    assert client.trigger_checkpoint(JOB, timeout_s=60).status == jm_pb.CHECKPOINT_STATUS_FAILED

    def restarted() -> bool:
        info = client.job_info(JOB)
        return info.status == pb.JOB_STATUS_RUNNING and info.restarts == 1

    wait_until(restarted, "the job to fail over and run again")
    assert_state_equals(work.read(), at_first)


@pytest.mark.s3
def test_expired_checkpoint_leaves_no_files_even_when_the_upload_finishes_late(
    gated_s3: tuple[GatedProxy, str, str], tmp_path: Path
) -> None:
    proxy, endpoint, bucket = gated_s3
    checkpoints_dir = f"s3://{bucket}/checkpoints"
    scheduler = ManualScheduler()
    # JobManager takes `scheduler or ThreadScheduler()`, and an empty ManualScheduler is falsy
    # (it has __len__): one far-future task keeps it truthy so the JobManager really uses it.
    scheduler.schedule(10**12, lambda: None)
    jm = JobManager(
        Configuration(
            {
                "jobmanager.rpc.port": 0,
                "metrics.reporter.prom.port": "-1",
                "rest.port": -1,
                "state.checkpoints.dir": checkpoints_dir,
                **s3_keys(endpoint),
                **FAST_HEARTBEATS,
                **PATIENT,
            }
        ),
        scheduler=scheduler,
    )
    jm.start()
    cluster = InProcessCluster(
        tmp_path,
        jm,
        tm_config={
            "taskmanager.numberOfTaskSlots": 2,
            "state.backend.type": "rocksdb",
            **s3_keys(f"http://127.0.0.1:{proxy.port}"),
        },
    )
    try:
        cluster.add_taskmanager()
        storage = open_storage(checkpoints_dir, Configuration(s3_keys(endpoint)))
        client = cluster.client(timeout_s=30.0)
        client.submit_job(
            JOB,
            operators(2),
            max_parallelism=MAX_P,
            config={
                "execution.checkpointing.incremental": "true",
                "execution.checkpointing.timeout": "5 s",
                **TOLERANT,
            },
        )
        work = Workload(client)
        work.write(key_names(600), "a")
        first = client.trigger_checkpoint(JOB, timeout_s=60)
        assert first.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, first.failure_reason
        job_dir = f"{checkpoints_dir}/{JOB}"
        before = relative_files(storage, job_dir)

        work.write(key_names(600, "b"), "b")
        proxy.gate.clear()
        started = client.trigger_checkpoint(JOB, wait=False)
        assert (started.checkpoint_id, started.status) == (2, jm_pb.CHECKPOINT_STATUS_IN_PROGRESS)
        scheduler.advance(4_999)
        assert _list_checkpoints(client)[2].status == jm_pb.CHECKPOINT_STATUS_IN_PROGRESS
        scheduler.advance(1)
        expired = _list_checkpoints(client)[2]
        assert expired.status == jm_pb.CHECKPOINT_STATUS_FAILED and expired.failure_reason.startswith(
            "CHECKPOINT_EXPIRED"
        ), expired
        assert "did not acknowledge" in expired.failure_reason

        # The stuck uploads now go through, after the JobManager gave up on them.
        proxy.gate.set()
        coordinator = jm.dispatcher.job(JOB).coordinator
        assert coordinator is not None

        wait_for_files(
            storage,
            job_dir,
            before,
            "the late uploads of expired checkpoint 2 to be deleted",
            lambda: coordinator.cleaner.flush(timeout=30),
            timeout_s=20,
        )

        third = client.trigger_checkpoint(JOB, timeout_s=60)
        assert third.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, third.failure_reason
        expected = work.reference.copy()
        client.cancel_job(JOB)
        client.submit_job(JOB, operators(2), max_parallelism=MAX_P, restore_path=third.path)
        assert_state_equals(work.read(), expected)
    finally:
        proxy.gate.set()  # a failed assertion must not leave uploads stuck while the cluster stops
        cluster.stop()


@pytest.mark.s3
@pytest.mark.slow
def test_ack_whose_answer_times_out_keeps_the_files_of_the_checkpoint_it_completed(
    gated_s3: tuple[GatedProxy, str, str], inprocess_cluster: Callable[..., Any]
) -> None:
    """The last ack completes the checkpoint, but the JobManager's _metadata write stalls past
    the TaskManager's 30 s ack deadline. The TaskManager cannot know the outcome, so it must not
    delete what it uploaded: the checkpoint completes once the write goes through and restores."""
    proxy, endpoint, bucket = gated_s3
    checkpoints_dir = f"s3://{bucket}/checkpoints"
    cluster = inprocess_cluster(
        taskmanagers=1,
        slots=2,
        jm={"state.checkpoints.dir": checkpoints_dir, **s3_keys(f"http://127.0.0.1:{proxy.port}"), **PATIENT},
        tm=s3_keys(endpoint),
    )
    client = cluster.client(timeout_s=30.0)
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P, config={"execution.checkpointing.incremental": "true"})
    work = Workload(client)
    work.write(key_names(300), "a")
    coordinator = cluster.jobmanager.dispatcher.job(JOB).coordinator
    try:
        proxy.gate.clear()
        assert client.trigger_checkpoint(JOB, wait=False).checkpoint_id == 1
        wait_until(
            lambda: [p.status.name for p in coordinator.pending_checkpoints()] == ["FINALIZING"],
            "both subtasks to acknowledge",
        )
        tm = cluster.taskmanagers[0]
        wait_until(
            lambda: all(w.done for ws in tm.checkpoints._inflight.values() for w in ws),
            "the stalled acknowledgement to time out on the TaskManager",
            timeout_s=45,
        )
    finally:
        proxy.gate.set()
    wait_until(lambda: not coordinator.pending_checkpoints(), "checkpoint 1 to complete")
    info = client.job_info(JOB)
    assert info.latest_checkpoint_id == 1, info
    client.cancel_job(JOB)
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P, restore_path=info.latest_checkpoint_path)
    assert_state_equals(work.read(), work.reference)
