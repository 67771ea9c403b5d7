"""``statectl cluster --wait N`` and the exit codes of ``checkpoint trigger`` / ``savepoint`` (run in-process)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from keyedstate.cli.statectl import main
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.errors import UnavailableError
from tests.fixtures.cluster import InProcessCluster

JOB = "cli-job"
OPERATORS = [OperatorSpec("op", 2, (StateDescriptor("v", StateKind.VALUE),))]
NO_FAILOVER = {"execution.checkpointing.tolerable-failed-checkpoints": "100"}


def statectl(cluster: InProcessCluster, *argv: str) -> int:
    return main([*argv, "--jobmanager", cluster.address])


def test_cluster_wait_returns_once_the_taskmanagers_registered(
    inprocess_cluster: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=2)
    codes: list[int] = []
    waiting = threading.Thread(
        target=lambda: codes.append(statectl(cluster, "cluster", "--wait", "2", "--timeout", "30"))
    )
    waiting.start()
    cluster.add_taskmanager()
    waiting.join(30)
    assert codes == [0]
    out = capsys.readouterr().out
    assert "TaskManagers: 2   slots: 4   free: 4" in out
    assert statectl(cluster, "cluster", "--wait", "2") == 0


def test_cluster_wait_exits_1_naming_what_is_missing(
    inprocess_cluster: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = inprocess_cluster(taskmanagers=2, slots=2)
    assert statectl(cluster, "cluster", "--wait", "3", "--timeout", "1") == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"statectl: the cluster at {cluster.address} was not ready within 1 s: 2 of 3 TaskManagers" in captured.err


def test_wait_for_taskmanagers_also_waits_for_slots(inprocess_cluster: Any) -> None:
    cluster = inprocess_cluster(taskmanagers=2, slots=2)
    client = cluster.client()
    assert client.wait_for_taskmanagers(2, slots=4, timeout_s=5).total_slots == 4
    with pytest.raises(UnavailableError) as info:
        client.wait_for_taskmanagers(2, slots=5, timeout_s=1)
    assert info.value.message == (
        f"the cluster at {cluster.address} was not ready within 1 s: 2 of 2 TaskManagers are registered, with 4 of 5 "
        "slots; start more TaskManagers (pointed at this JobManager), or wait longer"
    )


def test_cluster_wait_timeout_names_the_fix_not_an_unreachable_jobmanager(
    inprocess_cluster: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = inprocess_cluster(taskmanagers=2, slots=2)
    assert statectl(cluster, "cluster", "--wait", "3", "--timeout", "1") == 1
    err = capsys.readouterr().err
    assert "is the JobManager running" not in err and "of 0 slots" not in err
    assert "--timeout" in err and "TaskManager" in err


def test_checkpoint_trigger_exits_0_for_a_completed_checkpoint(
    inprocess_cluster: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = inprocess_cluster(taskmanagers=2, slots=2)
    cluster.client().submit_job(JOB, OPERATORS)
    assert statectl(cluster, "checkpoint", "trigger", JOB) == 0
    out = capsys.readouterr().out
    assert out.startswith("checkpoint 1 completed in ") and out.rstrip().endswith(f"/checkpoints/{JOB}/chk-1")


def test_checkpoint_trigger_and_savepoint_exit_1_when_the_checkpoint_fails(
    inprocess_cluster: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = inprocess_cluster(taskmanagers=2, slots=2)
    cluster.client().submit_job(JOB, OPERATORS, config={"execution.checkpointing.timeout": "1 ms", **NO_FAILOVER})
    assert statectl(cluster, "checkpoint", "trigger", JOB) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("statectl: checkpoint 1 FAILED: CHECKPOINT_EXPIRED: checkpoint 1 expired after 1 ms")
    assert "raise execution.checkpointing.timeout if snapshots are just slow" in captured.err

    assert statectl(cluster, "savepoint", JOB, "--dir", (tmp_path / "savepoints").as_uri()) == 1
    err = capsys.readouterr().err
    assert err.startswith("statectl: savepoint 2 FAILED: CHECKPOINT_EXPIRED: checkpoint 2 expired after 1 ms"), err
    assert not list((tmp_path / "savepoints").rglob("_metadata"))
    assert cluster.client().job_info(JOB).latest_checkpoint_id == 0
