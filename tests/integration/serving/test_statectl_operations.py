"""statectl as operators use it: no traceback on a closed pipe, a savepoint that outlives --timeout is a
failure that says what to do, health checks, and the client package free of the command line's libraries."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.client import ClientSettings, StateClient, ValueState
from tests.integration.serving._support import JOB, OPERATOR, operators

STATECTL = [sys.executable, "-m", "keyedstate.cli.statectl"]


def _closed_pipe_run(*args: str) -> subprocess.CompletedProcess[bytes]:
    """Run statectl with a stdout whose reader is already gone (what `| head` leaves once it has its lines)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([*STATECTL, *args], stdout=write, stderr=subprocess.PIPE, timeout=60)
    finally:
        os.close(write)


def test_a_closed_pipe_ends_statectl_quietly(inprocess_cluster: Any) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=2)
    cluster.client().submit_job(JOB, operators(parallelism=2))
    for args in (
        ["cluster", "-m", cluster.address],
        ["checkpoint", "list", JOB, "-m", cluster.address],
        ["config", "docs"],
    ):
        result = _closed_pipe_run(*args)
        assert result.returncode == 141, (args, result.stderr)
        assert result.stderr == b"", (args, result.stderr.decode())  # no traceback, no "Exception ignored"


def test_health_of_a_jobmanager_and_a_taskmanager(inprocess_cluster: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from keyedstate.cli.statectl import main

    cluster = inprocess_cluster(taskmanagers=1, slots=2)
    tm = cluster.taskmanagers[0].address
    assert main(["health", "-m", cluster.address]) == 0
    assert main(["health", "-m", tm, "--service", "keyedstate.v1.KeyedState", "--json"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{cluster.address}: SERVING\n") and '"status": "SERVING"' in out
    assert main(["health", "-m", tm, "--service", "no.such.Service"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("statectl: ") and "Traceback" not in err


def test_a_savepoint_that_outlives_timeout_exits_1_naming_what_to_do(
    process_cluster: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from keyedstate.cli.statectl import main

    cluster = process_cluster(taskmanagers=1, slots=2)
    with StateClient(cluster.jobmanager_address, ClientSettings(timeout_s=10, max_attempts=3)) as client:
        client.submit_job(JOB, operators(parallelism=2))
        ValueState[str, int](client, JOB, OPERATOR, "last", value_serializer="int").put_many(["a", "b"], [1, 2])
        # The TaskManager takes the barrier, but its transfer processes (which write the files) are stopped.
        process = cluster.taskmanagers[0].process
        assert process is not None
        transfers = psutil.Process(process.pid).children(recursive=True)
        assert transfers, "the TaskManager's transfer processes"
        for child in transfers:
            child.suspend()
        try:
            target = (tmp_path / "savepoints").as_uri()
            code = main(["savepoint", JOB, "--timeout", "2", "--dir", target, "-m", cluster.jobmanager_address])
            captured = capsys.readouterr()
        finally:
            for child in transfers:
                child.resume()
        assert code == 1 and captured.out == ""
        assert "did not complete within --timeout 2 s" in captured.err, captured.err
        assert f"statectl checkpoint list {JOB}" in captured.err and "larger --timeout" in captured.err
        # It was a real savepoint under way, which completes once the TaskManager goes on.
        [pending] = [c for c in client.list_checkpoints(JOB).checkpoints if c.savepoint]
        assert pending.status in (jm_pb.CHECKPOINT_STATUS_IN_PROGRESS, jm_pb.CHECKPOINT_STATUS_COMPLETED)


def test_the_client_package_does_not_load_the_command_line_libraries() -> None:
    code = (
        "import sys, keyedstate.common.client, keyedstate.common.spark\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in {'rich', 'click', 'typer', 'argparse'})\n"
        "print(','.join(loaded))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
