"""A StatefulProcessor's timers through TaskManager losses: kill -9 TaskManager processes in the middle of
an EventTime query that closes sessions with timers, and compare every batch with Spark's own
``transformWithStateInPandas`` over the same input.

The first kill comes after a batch's tasks fired their timers and its output reached the sink, before
the epoch committed: the job fails over to the previous batch's checkpoint, the batch runs again, and
its timers must fire again (their deletions were never committed) with the same rows. The second
comes before a batch starts. No timer may fire twice or be lost: every batch's rows are Spark's,
and the timers left at the end are the ones Spark's state holds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from keyedstate.common.minicluster import MiniCluster
from tests.integration.spark.test_processor_timers import event_time_case, remaining_timers, run_ours

# Each test runs a multi-batch query on Spark and on the runtime (with task failures): longer than the default.
pytestmark = [pytest.mark.spark, pytest.mark.timeout(900)]


def test_no_processor_timer_fires_twice_or_is_lost_when_taskmanagers_are_killed(
    spark: SparkSession, process_cluster: Callable[..., MiniCluster], tmp_path: Path
) -> None:
    (tmp_path / "reference").mkdir()
    source, expected, spark_left = event_time_case(spark, tmp_path / "reference")
    # The first kill hits a batch that fires timers inside the stream; the second a later batch.
    kill_before_commit = next(b for b in sorted(expected) if b >= 2 and any(r[4] == "timer" for r in expected[b]))
    kill_before_batch = kill_before_commit + 2
    assert kill_before_batch < len(expected)
    cluster = process_cluster(
        taskmanagers=2,
        slots=2,
        backend="rocksdb",
        config={
            "restart-strategy.type": "fixed-delay",
            "restart-strategy.fixed-delay.attempts": "5",
            "restart-strategy.fixed-delay.delay": "100 ms",
        },
    )
    events: list[str] = []

    def after_sink(batch_id: int, deliveries: int) -> None:
        if batch_id == kill_before_commit and "killed-1" not in events:
            cluster.taskmanagers[1].kill()  # SIGKILL: the batch's staged writes (fired timers too) are gone
            cluster.restart_taskmanager(1)
            events.append("killed-1")

    def around(run: Callable[[Any, int], None], df: Any, batch_id: int) -> None:
        if batch_id == kill_before_batch and "killed-0" not in events:
            cluster.taskmanagers[0].kill()
            cluster.restart_taskmanager(0)
            events.append("killed-0")
        run(df, batch_id)

    runtime, received, deliveries = run_ours(
        spark,
        cluster.jobmanager_address,
        source,
        tmp_path / "checkpoint",
        "tws-timers-kill",
        around=around,
        after_sink=after_sink,
    )
    assert events == ["killed-1", "killed-0"]
    assert runtime.client.job_info(runtime.job_id).restarts >= 2  # both kills cost a failover
    # The batch killed before its commit ran again and delivered the same rows; every batch is Spark's.
    batches = [b for b, _ in deliveries]
    assert batches.count(kill_before_commit) == 2
    again = [rows for b, rows in deliveries if b == kill_before_commit]
    assert again[0] == again[1]
    assert received == expected
    assert remaining_timers(runtime) == spark_left
    assert runtime.committed_epoch() == len(expected) - 1
