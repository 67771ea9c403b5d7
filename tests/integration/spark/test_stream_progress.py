"""The documented ways to know where a stream is: a ready cluster, a finished query, durable batches."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keyedstate.common.client import ReducingState
from keyedstate.common.descriptors import OperatorSpec, ReduceField, StateDescriptor, StateKind
from keyedstate.common.spark import KeyedStateRuntime

pytestmark = pytest.mark.spark

from pyspark import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

OPS = [
    OperatorSpec(
        "agg", 2, (StateDescriptor("totals", StateKind.REDUCING, reduce_fields=(ReduceField("n"), ReduceField("sum"))),)
    )
]


def process(batches: Any, state: Any) -> None:
    rows = [r for b in batches for r in b.to_pylist()]
    if rows:
        # Every row carries the batch it was written for; the task sees the Spark batch id too.
        assert {r["batch"] for r in rows} == {state.batch_id}, (state.batch_id, {r["batch"] for r in rows})
        state.reducing("totals").add_many([r["user"] for r in rows], [(1, r["amount"]) for r in rows])


def test_an_available_now_query_is_done_and_durable_when_await_termination_returns(
    spark: Any,
    inprocess_cluster: Any,
    tmp_path: Path,
) -> None:
    cluster = inprocess_cluster(taskmanagers=2, slots=1)
    # The cluster is ready once its TaskManagers registered.
    assert len(cluster.client().wait_for_taskmanagers(2, timeout_s=10).taskmanagers) == 2
    source = tmp_path / "events"
    source.mkdir()
    files = 4
    expected: dict[str, list[int]] = {}
    for batch in range(files):
        rows: list[dict[str, Any]] = [
            {"user": f"u{i % 7}", "amount": batch * 100 + i, "batch": batch} for i in range(50)
        ]
        for r in rows:
            t = expected.setdefault(r["user"], [0, 0])
            t[0] += 1
            t[1] += r["amount"]
        path = source / f"part-{batch:02d}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        # One file per batch, in order: Spark's file source takes files by modification time,
        # so each gets its own second (two writes within one clock tick would tie, in any order).
        os.utime(path, (1_700_000_000 + batch, 1_700_000_000 + batch))
    runtime = KeyedStateRuntime(cluster.address, "progress", OPS)
    query = (
        spark.readStream.schema("user string, amount long, batch long")
        .option("maxFilesPerTrigger", 1)
        .parquet(str(source))
        .writeStream.foreachBatch(runtime.foreach_batch(process, key_col="user", operator="agg"))
        .option("checkpointLocation", str(tmp_path / "spark-checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(180)
    assert query.exception() is None
    # Done: every batch returned from foreachBatch, so every batch is in a completed checkpoint.
    assert runtime.last_batch_id == files - 1
    assert runtime.batches_run == files
    assert runtime.durable_epoch() == runtime.committed_epoch() == files - 1
    users = sorted(expected)
    got = ReducingState[str](runtime.client, "progress", "agg", "totals").get_many(users)
    assert {u: list(v) for u, v in zip(users, got)} == expected  # type: ignore[arg-type]  # a missing total (None) fails here
