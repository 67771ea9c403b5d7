"""Timers through a TaskManager loss: kill -9 a TaskManager process in the middle of a streaming
query that closes sessions with event-time timers; the job fails over to its latest checkpoint,
the batch runs again, and every timer still fires exactly once, in the batch it is due in.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from keyedstate.common.client import ClientSettings, StateClient
from tests.integration.spark.test_spark_timers import check_firings, run_sessions

pytestmark = pytest.mark.spark

KILL_AT = 3


def test_no_timer_fires_twice_or_is_lost_when_a_taskmanager_is_killed(
    spark: Any, process_cluster: Any, tmp_path: Path
) -> None:
    cluster = process_cluster(
        taskmanagers=2,
        slots=2,
        config={
            "restart-strategy.type": "fixed-delay",
            "restart-strategy.fixed-delay.attempts": "5",
            "restart-strategy.fixed-delay.delay": "100 ms",
        },
    )
    events: list[str] = []

    def around(run: Callable[[Any, int], None], df: Any, batch_id: int) -> None:
        if batch_id == KILL_AT and "killed" not in events:
            cluster.taskmanagers[1].kill()  # SIGKILL: its slots and staged writes are gone
            events.append("killed")
        run(df, batch_id)
        if "killed" in events and "restarted" not in events:
            cluster.restart_taskmanager(1)
            events.append("restarted")

    runtime, batches, out = run_sessions(spark, cluster.jobmanager_address, tmp_path, around)
    assert events == ["killed", "restarted"]
    info = runtime.client.job_info(runtime.job_id)
    assert info.restarts >= 1  # the kill really cost a failover
    client = StateClient(cluster.jobmanager_address, ClientSettings(timeout_s=10.0))
    try:
        expected = check_firings(client, batches, out)
    finally:
        client.close()
    assert any(b >= KILL_AT for _, _, b in expected)  # timers were due after the failover too
