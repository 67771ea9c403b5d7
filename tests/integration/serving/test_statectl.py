"""``statectl`` as a subprocess against a running (in-process) cluster and against no cluster at all."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest

from tests.integration.serving._support import JOB, OPERATOR, free_port, operators, run_module

STATECTL = "keyedstate.cli.statectl"


@pytest.fixture
def cluster(inprocess_cluster: Any) -> Any:
    cluster = inprocess_cluster(taskmanagers=2, slots=2)
    cluster.client().submit_job(JOB, operators(parallelism=2))
    return cluster


def test_cluster_table_shows_taskmanagers_slots_and_jobs(cluster: Any) -> None:
    result = run_module(STATECTL, "cluster", "--jobmanager", cluster.address)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "TaskManagers: 2   slots: 4   free: 2" in out
    lines = out.splitlines()
    for tm in cluster.taskmanagers:
        [row] = [line for line in lines if line.startswith(tm.id + " ")]
        columns = row.split()
        assert columns[:5] == [tm.id, tm.address, "ACTIVE", "2", "1"]
    assert sum(f"{JOB}/{OPERATOR}/{i}" in out for i in (0, 1)) == 2
    [job_row] = [line for line in lines if line.startswith(JOB + " ")]
    assert job_row.split()[:4] == [JOB, "RUNNING", f"{OPERATOR}x2", "128"]


def test_cluster_json_is_machine_readable(cluster: Any) -> None:
    result = run_module(STATECTL, "cluster", "--json", "--jobmanager", cluster.address)
    assert result.returncode == 0, result.stderr
    overview = json.loads(result.stdout)
    assert overview["total_slots"] == 4 and overview["free_slots"] == 2
    tms = {t["taskmanager_id"]: t for t in overview["taskmanagers"]}
    assert set(tms) == {tm.id for tm in cluster.taskmanagers}
    hosted = []
    for tm in cluster.taskmanagers:
        entry = tms[tm.id]
        assert (entry["address"], entry["status"], entry["num_slots"], entry["free_slots"]) == (
            tm.address,
            "ACTIVE",
            2,
            1,
        )
        assert len(entry["slots"]) == 2
        hosted += [(s["job_id"], s["operator_id"], s["subtask_index"]) for s in entry["slots"] if s["job_id"]]
    assert sorted(hosted) == [(JOB, OPERATOR, 0), (JOB, OPERATOR, 1)]
    [job] = overview["jobs"]
    assert job["job_id"] == JOB and job["status"] == "RUNNING" and job["max_parallelism"] == 128


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "{address}", "cluster", "--json"],
        ["--jobmanager", "{address}", "--json", "job", "list"],
        ["--json", "cluster", "-m", "{address}"],
    ],
)
def test_options_before_the_command_are_accepted(cluster: Any, argv: list[str]) -> None:
    result = run_module(STATECTL, *(a.format(address=cluster.address) for a in argv))
    assert result.returncode == 0, result.stderr
    assert JOB in {j["job_id"] for j in json.loads(result.stdout)["jobs"]}


def test_rescale_past_the_max_parallelism_names_that_limit_not_taskmanagers(cluster: Any) -> None:
    result = run_module(STATECTL, "job", "rescale", JOB, "--parallelism", "200", "--jobmanager", cluster.address)
    assert result.returncode == 2, result.stderr
    assert "max parallelism is 128" in result.stderr and "at most 128" in result.stderr, result.stderr
    assert "pipeline.max-parallelism" in result.stderr and "start more TaskManagers" not in result.stderr
    info = json.loads(run_module(STATECTL, "job", "info", JOB, "--jobmanager", cluster.address).stdout)
    assert info["status"] == "RUNNING" and info["operators"][0]["parallelism"] == 2


def test_jobmanager_address_from_config_overrides(cluster: Any) -> None:
    host, port = cluster.address.rsplit(":", 1)
    result = run_module(
        STATECTL, "job", "list", "--json", "-D", f"jobmanager.rpc.address={host}", "-D", f"jobmanager.rpc.port={port}"
    )
    assert result.returncode == 0, result.stderr
    assert [j["job_id"] for j in json.loads(result.stdout)["jobs"]] == [JOB]


def test_unknown_job_exits_1_naming_the_job(cluster: Any) -> None:
    result = run_module(STATECTL, "job", "info", "ghost", "--jobmanager", cluster.address)
    assert result.returncode == 1
    assert "unknown job 'ghost'" in result.stderr and JOB in result.stderr


def test_unreachable_jobmanager_exits_1_quickly_with_a_hint() -> None:
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    result = run_module(STATECTL, "cluster", "--jobmanager", address)
    assert result.returncode == 1
    assert address in result.stderr and "UNAVAILABLE" in result.stderr
    assert "is the JobManager running" in result.stderr and "--jobmanager HOST:PORT" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 20


def test_silent_jobmanager_exits_1_within_the_timeout() -> None:
    """A peer that accepts TCP but never speaks HTTP/2 (a hung process) is bounded by --timeout."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        result = run_module(STATECTL, "cluster", "--jobmanager", address, "--timeout", "1")
        elapsed = time.monotonic() - started
    assert result.returncode == 1
    assert address in result.stderr and "DEADLINE_EXCEEDED" in result.stderr
    assert "is the JobManager running" in result.stderr
    # Two attempts of 1 s each plus interpreter start-up.
    assert elapsed < 20
