"""The W1 benchmark's pipeline on real PySpark and a real cluster: exact results and per-batch timings."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from bench.w1 import data as w1data
from bench.w1 import executor, sparkjobs
from keyedstate.common.client import ReducingState
from keyedstate.common.spark import KeyedStateRuntime

pytestmark = pytest.mark.spark

from pyspark import cloudpickle  # noqa: E402

# Executors cannot import the bench package or this module: ship their functions by value.
cloudpickle.register_pickle_by_value(executor)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.mark.parametrize("mode", ["keyed", "shuffle_free"])
def test_ours_variant_equals_the_reference(spark: Any, inprocess_cluster: Any, tmp_path: Path, mode: str) -> None:
    cluster = inprocess_cluster(taskmanagers=2, slots=1, backend="rocksdb")
    data = w1data.generate(tmp_path / "in", events=6_000, users=500, files=3, seed=3)
    run = sparkjobs.run_ours(spark, data, 2, cluster.address, "w1-test", 2, tmp_path / "ours", mode=mode)
    assert run.batches == 2  # three files, two per trigger
    assert w1data.mismatches(data, run.final) == 0
    assert [t.batch_id for t in run.timings] == [0, 1]
    # The job was cancelled at the end, so its slots are free for the next run.
    again = sparkjobs.run_ours(spark, data, 3, cluster.address, "w1-test-2", 2, tmp_path / "ours-2", mode=mode)
    assert again.batches == 1 and w1data.mismatches(data, again.final) == 0


def _sum_amounts(batches: Any, state: Any) -> None:
    agg = executor.preaggregate(batches)
    if agg is not None:
        state.reducing("totals", key_serializer="int").add_many(
            agg.column("user").to_pylist(), list(zip(agg.column("n").to_pylist(), agg.column("total").to_pylist()))
        )


def test_runtime_records_where_each_batch_spent_its_time(spark: Any, inprocess_cluster: Any) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=2, backend="hashmap")
    runtime = KeyedStateRuntime(cluster.address, "timed", sparkjobs.operators(2))
    on_batch = runtime.foreach_batch(_sum_amounts, key_col="user", key_serializer="int")
    frames = [spark.createDataFrame([(u, 10 * b + u) for u in range(50)], "user long, amount long") for b in range(3)]
    for batch_id, df in enumerate(frames):
        on_batch(df, batch_id)
    on_batch(frames[2], 2)  # a replayed batch is skipped and adds no timing
    assert [t.batch_id for t in runtime.timings] == [0, 1, 2]
    for t in runtime.timings:
        assert t.tasks_s > 0 and t.commit_s > 0
        assert t.total_s >= t.tasks_s + t.commit_s
        assert 0 <= t.checkpoint_s <= t.commit_s + 0.01  # the checkpoint is part of the commit call
    state = ReducingState[int](runtime.client, "timed", sparkjobs.OPERATOR, sparkjobs.STATE, key_serializer="int")
    assert state.get_many([0, 49]) == [(3, 30), (3, 30 + 3 * 49)]
    runtime.close()
