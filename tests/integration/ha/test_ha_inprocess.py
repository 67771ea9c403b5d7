"""JobManager high availability with in-process daemons: fencing, terminal jobs, resource waits, restore paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.client import ValueState
from keyedstate.common.config import Configuration
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.errors import ConfigError, NotFoundError
from keyedstate.jobmanager.daemon import JobManager
from tests.fixtures.cluster import FAST_HEARTBEATS
from tests.fixtures.waiting import wait_for

OP = "op"


def _ops(parallelism: int = 2) -> list[OperatorSpec]:
    return [OperatorSpec(OP, parallelism, (StateDescriptor("v", StateKind.VALUE),))]


_wait_for = wait_for


def _ha(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "high-availability.type": "filesystem",
        "high-availability.storageDir": (tmp_path / "ha").as_uri(),
        "high-availability.filesystem.lease-check-interval": "100 ms",
        **extra,
    }


def _restart_jobmanager(cluster: Any, tmp_path: Path, **extra: Any) -> JobManager:
    port = cluster.jobmanager.port
    cluster.jobmanager.stop(grace_s=0)
    conf = {
        "jobmanager.rpc.port": port,
        "metrics.reporter.prom.port": "-1",
        "rest.port": -1,
        "state.checkpoints.dir": (cluster.base / "checkpoints").as_uri(),
        **FAST_HEARTBEATS,
        **_ha(tmp_path),
        **extra,
    }
    jm = JobManager(Configuration(conf))
    jm.start()
    cluster.jobmanager = jm
    return jm


def test_a_second_jobmanager_on_the_same_ha_directory_fences_the_first(inprocess_cluster: Any, tmp_path: Path) -> None:
    cluster = inprocess_cluster(taskmanagers=0, jm=_ha(tmp_path))
    first = cluster.jobmanager
    second = JobManager(
        Configuration({"jobmanager.rpc.port": 0, "metrics.reporter.prom.port": "-1", "rest.port": -1, **_ha(tmp_path)})
    )
    second.start()
    try:
        _wait_for(first._stopped.is_set, 30, "the older JobManager stepping down")
        assert not second._stopped.is_set()
    finally:
        second.stop(grace_s=0)


def test_terminal_jobs_stay_terminal_after_a_restart(inprocess_cluster: Any, tmp_path: Path) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=4, jm=_ha(tmp_path))
    client = cluster.client()
    client.submit_job("gone", _ops())
    client.submit_job("kept", _ops())
    client.cancel_job("gone")
    _restart_jobmanager(cluster, tmp_path)
    assert client.job_info("gone").status == pb.JOB_STATUS_CANCELED
    _wait_for(lambda: client.job_info("kept").status == pb.JOB_STATUS_RUNNING, 30, "the running job resuming")


def test_a_recovered_job_that_gets_no_slots_fails_naming_the_timeout(inprocess_cluster: Any, tmp_path: Path) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=2, jm=_ha(tmp_path))
    client = cluster.client()
    client.submit_job("job", _ops())
    cluster.taskmanagers[0].stop(grace_s=0)
    cluster.taskmanagers.clear()
    _restart_jobmanager(cluster, tmp_path, **{"slot.request.timeout": "500 ms", "restart-strategy.type": "none"})
    info = _wait_for(lambda: (i := client.job_info("job")).status == pb.JOB_STATUS_FAILED and i, 30, "the job failing")
    assert "slot.request.timeout" in info.failure_cause and "start more TaskManagers" in info.failure_cause


def test_failover_before_the_first_checkpoint_restores_what_the_job_was_submitted_from(
    inprocess_cluster: Any, tmp_path: Path
) -> None:
    cluster = inprocess_cluster(
        taskmanagers=2,
        slots=2,
        jm={
            "restart-strategy.type": "fixed-delay",
            "restart-strategy.fixed-delay.delay": "50 ms",
            "restart-strategy.fixed-delay.attempts": "100",
            "state.savepoints.dir": (tmp_path / "sp").as_uri(),
        },
    )
    client = cluster.client()
    client.submit_job("a", _ops())
    state = ValueState[str, int](client, "a", OP, "v", value_serializer="int")
    keys = [f"k{i}" for i in range(300)]
    state.put_many(keys, list(range(300)))
    savepoint = client.trigger_checkpoint("a", savepoint=True, timeout_s=60)
    assert savepoint.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, savepoint.failure_reason
    client.submit_job("b", _ops(), restore_path=savepoint.path)
    restored = ValueState[str, int](client, "b", OP, "v", value_serializer="int")
    assert restored.get_many(keys) == list(range(300))
    # Lose a TaskManager before job b completed any checkpoint of its own: the restart must
    # restore the savepoint again, not come back empty.
    cluster.taskmanagers[1].stop(grace_s=0)
    cluster.add_taskmanager()
    _wait_for(
        lambda: client.job_info("b").restarts >= 1 and client.job_info("b").status == pb.JOB_STATUS_RUNNING,
        60,
        "job b restarting",
    )
    assert restored.get_many(keys) == list(range(300))


@pytest.mark.parametrize("claim_mode", ["CLAIM", "NO_CLAIM"])
def test_a_jobmanager_restart_after_an_in_place_restore_keeps_the_restored_state(
    inprocess_cluster: Any,
    tmp_path: Path,
    claim_mode: str,
) -> None:
    # The checkpoint the restore takes first (newest in the job's directory, with _metadata) belongs
    # to the state the restore replaced: a new leader must not take it back.
    cluster = inprocess_cluster(taskmanagers=1, slots=2, jm=_ha(tmp_path))
    client = cluster.client()
    client.submit_job("job", _ops())
    state = ValueState[str, int](client, "job", OP, "v", value_serializer="int")
    keys = [f"k{i}" for i in range(200)]
    state.put_many(keys, [1] * 200)
    source = client.trigger_checkpoint("job", timeout_s=60)
    assert source.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, source.failure_reason
    state.put_many(keys, [2] * 200)
    client.restore_job("job", source.path, claim_mode=claim_mode)
    assert state.get_many(keys) == [1] * 200

    _restart_jobmanager(cluster, tmp_path)
    _wait_for(lambda: client.job_info("job").status == pb.JOB_STATUS_RUNNING, 30, "the job resuming")
    assert state.get_many(keys) == [1] * 200
    # CLAIM made the source the job's own checkpoint; under NO_CLAIM it stays the user's, outside the job's store
    # (the new leader still restores it: the job's record names it, with its claim mode).
    expected = source.path if claim_mode == "CLAIM" else ""
    assert client.job_info("job").latest_checkpoint_path == expected


def test_a_terminal_job_still_names_its_latest_checkpoint_after_a_restart(
    inprocess_cluster: Any, tmp_path: Path
) -> None:
    # Chaos seed 1071: a job FAILED (restart budget used up), the JobManager restarted, and job info
    # named no checkpoint any more, so the operator could not find the one to restore it from.
    cluster = inprocess_cluster(taskmanagers=1, slots=4, jm=_ha(tmp_path))
    client = cluster.client()
    client.submit_job("job", _ops())
    ValueState[str, int](client, "job", OP, "v", value_serializer="int").put_many(["a", "b"], [1, 2])
    checkpoint = client.trigger_checkpoint("job", timeout_s=60)
    assert checkpoint.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, checkpoint.failure_reason
    client.cancel_job("job")
    before = client.job_info("job")
    assert (before.latest_checkpoint_id, before.latest_checkpoint_path) == (checkpoint.checkpoint_id, checkpoint.path)
    _restart_jobmanager(cluster, tmp_path)
    after = client.job_info("job")
    assert after.status == pb.JOB_STATUS_CANCELED
    assert (after.latest_checkpoint_id, after.latest_checkpoint_path) == (checkpoint.checkpoint_id, checkpoint.path)
    client.wait_for_taskmanagers(1, timeout_s=30)
    client.submit_job("again", _ops(), restore_path=after.latest_checkpoint_path)
    _wait_for(lambda: client.job_info("again").status == pb.JOB_STATUS_RUNNING, 30, "the job restored from it running")
    assert ValueState[str, int](client, "again", OP, "v", value_serializer="int").get_many(["a", "b"]) == [1, 2]


def test_a_job_asking_for_jobmanager_checkpoint_storage_under_ha_is_refused(
    inprocess_cluster: Any, tmp_path: Path
) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=2, jm=_ha(tmp_path))
    client = cluster.client()
    with pytest.raises(ConfigError) as info:
        client.submit_job("in-memory", _ops(), config={"execution.checkpointing.storage": "jobmanager"})
    assert "cannot be combined with high-availability.type: filesystem" in info.value.message
    assert "set execution.checkpointing.storage: filesystem with state.checkpoints.dir" in info.value.message
    with pytest.raises(NotFoundError):
        client.job_info("in-memory")
    # Nothing was taken: the same job with file checkpoints runs on the same slots.
    client.submit_job("in-memory", _ops())
    assert client.job_info("in-memory").status == pb.JOB_STATUS_RUNNING
