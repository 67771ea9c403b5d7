"""Timers in foreach_batch on real Spark: sessions closed by event-time timers at the batch's watermark.

The reference model replays Spark's rules: batch N's watermark is the largest event time of
batches 0..N-1 (a zero delay), a task handles its rows first and then the timers due at that
watermark, and a fired timer never fires again. One task attempt fails after firing timers,
so Spark retries it: the retried task must fire the same timers, and the output holds them once.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keyedstate.common.client import StateClient, TimeDomain, TimerService, timers_state
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.spark import KeyedStateRuntime

pytestmark = pytest.mark.spark

from pyspark import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

GAP_MS = 10_000
OPS = [OperatorSpec("sessions", 2, (StateDescriptor("last_seen", StateKind.VALUE), timers_state()))]
MARKERS = ""
"""A directory the failing task attempts leave a file in (set by the test; shipped with the function)."""
OUT = pa.schema(
    [
        ("user", pa.string()),
        ("closed_at", pa.int64()),
        ("batch", pa.int64()),
        ("watermark", pa.int64()),
        ("domain", pa.string()),
        ("batch_timestamp", pa.int64()),
    ]
)


def process(batches: Any, state: Any) -> None:
    latest: dict[str, int] = {}
    for b in batches:
        micros = b.column("ts").cast(pa.int64()).to_pylist()  # Arrow timestamps count from the epoch in UTC
        for user, us in zip(b.column("user").to_pylist(), micros):
            latest[user] = max(latest.get(user, us // 1000), us // 1000)
    if not latest:
        return
    users = sorted(latest)
    last_seen = state.value("last_seen", value_serializer="int")
    timers: TimerService[str] = state.timers()
    old = last_seen.get_many(users)
    known = [(u, o) for u, o in zip(users, old) if o is not None]
    timers.delete_many(TimeDomain.EVENT_TIME, [u for u, _ in known], [o + GAP_MS for _, o in known])
    new = [max(latest[u], o if o is not None else latest[u]) for u, o in zip(users, old)]
    last_seen.put_many(users, new)
    timers.register_many(TimeDomain.EVENT_TIME, users, [n + GAP_MS for n in new])
    # A processing-time timer due at once: it fires in this batch, after the rows.
    timers.register_processing_time_timer(users[0], state.batch_timestamp_ms)


def on_timer(timers: Any, state: Any) -> Any:
    from pyspark import TaskContext

    fired = list(timers)
    closed = [t.key for t in fired if t.domain is TimeDomain.EVENT_TIME]
    state.value("last_seen", value_serializer="int").clear_many(closed)
    ctx = TaskContext.get()
    if state.batch_id == 2 and ctx is not None and ctx.attemptNumber() == 0:
        Path(MARKERS, f"failed-{ctx.partitionId()}").touch()
        raise RuntimeError("injected failure after firing timers")
    yield pa.RecordBatch.from_pylist(
        [
            {
                "user": t.key,
                "closed_at": t.timestamp_ms,
                "batch": state.batch_id,
                "watermark": state.watermark_ms,
                "domain": t.domain.name,
                "batch_timestamp": state.batch_timestamp_ms,
            }
            for t in fired
        ],
        schema=OUT,
    )


def _model(batches: list[list[tuple[str, int]]]) -> tuple[list[tuple[str, int, int]], set[tuple[str, int]]]:
    """(user, timer, batch) of every firing, and the timers still registered after the last batch."""
    last: dict[str, int] = {}
    fired: list[tuple[str, int, int]] = []
    max_ts = 0
    for n, rows in enumerate(batches):
        watermark = max_ts
        for user, ms in rows:
            last[user] = max(last.get(user, ms), ms)
        for user in sorted(last):
            if last[user] + GAP_MS <= watermark:
                fired.append((user, last[user] + GAP_MS, n))
                del last[user]
        max_ts = max([max_ts] + [ms for _, ms in rows])
    return fired, {(u, ms + GAP_MS) for u, ms in last.items()}


def write_batches(source: Path) -> list[list[tuple[str, int]]]:
    """Six Parquet files of (user, ts), one per micro-batch, in time order."""
    source.mkdir()
    t0 = 1_700_000_000_000
    batches: list[list[tuple[str, int]]] = []
    for n in range(6):
        # Users come and go; gaps of up to 25 s close sessions on the way.
        rows = [(f"u{(n * 3 + i) % 20}", t0 + n * 8_000 + i * 500) for i in range(12)]
        batches.append(rows)
        path = source / f"part-{n:02d}.parquet"
        table = pa.table(
            {
                "user": [u for u, _ in rows],
                "ts": pa.array([ms * 1000 for _, ms in rows], pa.timestamp("us", tz="UTC")),
            }
        )
        pq.write_table(table, path)
        # One file per batch, in order (the file source orders by modification time).
        os.utime(path, (1_700_000_000 + n, 1_700_000_000 + n))
    return batches


def run_sessions(
    spark: Any,
    address: str,
    tmp_path: Path,
    around: Callable[[Callable[[Any, int], None], Any, int], None] | None = None,
) -> tuple[KeyedStateRuntime, list[list[tuple[str, int]]], list[dict[str, Any]]]:
    """Run the sessions query to its end: (runtime, the batches' rows, the fired timers' output rows).

    ``around(run, df, batch_id)`` wraps each foreachBatch call (to kill a TaskManager mid-run).
    """
    batches = write_batches(tmp_path / "events")
    global MARKERS
    MARKERS = str(tmp_path)
    runtime = KeyedStateRuntime(address, "timers", OPS)
    outputs: dict[int, pa.Table] = {}

    def sink(table: pa.Table, batch_id: int) -> None:
        outputs[batch_id] = table  # idempotent per batch id, as foreachBatch asks

    run = runtime.foreach_batch(
        process, key_col="user", operator="sessions", on_timer=on_timer, output_schema=OUT, sink=sink
    )
    wrapped = run if around is None else (lambda df, batch_id: around(run, df, batch_id))
    query = (
        spark.readStream.schema("user string, ts timestamp")
        .option("maxFilesPerTrigger", 1)
        .parquet(str(tmp_path / "events"))
        .withWatermark("ts", "0 seconds")
        .writeStream.foreachBatch(wrapped)
        .option("checkpointLocation", str(tmp_path / "spark-checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(300)
    assert query.exception() is None
    assert runtime.last_batch_id == 5
    return runtime, batches, [r for b in sorted(outputs) for r in outputs[b].to_pylist()]


def check_firings(
    client: StateClient, batches: list[list[tuple[str, int]]], out: list[dict[str, Any]]
) -> list[tuple[str, int, int]]:
    """Every timer fired once, in the batch the model says, at the batch's watermark; the rest still wait."""
    # Processing-time timers: one per task and batch (its first user), due at the batch timestamp.
    processing = [r for r in out if r["domain"] == "PROCESSING_TIME"]
    out = [r for r in out if r["domain"] == "EVENT_TIME"]
    routing = client.routing("timers", refresh=True)
    first_users = set()
    for n, rows_ in enumerate(batches):
        by_task: dict[int, set[str]] = {}
        for u, _ in rows_:
            by_task.setdefault(client.subtask_of("timers", "sessions", u.encode()), set()).add(u)
        first_users |= {(min(us), n) for us in by_task.values()}
    assert routing.operator("sessions").parallelism == 2
    assert sorted((r["user"], r["batch"]) for r in processing) == sorted(first_users)
    assert all(r["closed_at"] == r["batch_timestamp"] > 0 for r in processing)
    expected, still_open = _model(batches)
    assert len(expected) >= 5  # the schedule really closes sessions
    assert sorted((r["user"], r["closed_at"], r["batch"]) for r in out) == sorted(expected)
    # Each batch fired at the watermark Spark recorded for it (the largest event time before it).
    for r in out:
        assert r["watermark"] == max(ms for rows_ in batches[: r["batch"]] for _, ms in rows_)
    # Fired timers are gone; the open sessions still have theirs.
    timers: TimerService[str] = TimerService(client, "timers", "sessions")
    assert {(t.key, t.timestamp_ms) for t in timers.due(TimeDomain.EVENT_TIME, 1 << 62)} == still_open
    return expected


def test_event_time_timers_fire_once_at_the_batch_watermark(spark: Any, inprocess_cluster: Any, tmp_path: Path) -> None:
    cluster = inprocess_cluster(taskmanagers=2, slots=1)
    _, batches, out = run_sessions(spark, cluster.address, tmp_path)
    expected = check_firings(cluster.client(), batches, out)
    assert any(b == 2 for _, _, b in expected)  # timers fire in the batch whose tasks fail once ...
    assert list(tmp_path.glob("failed-*"))  # ... and they did fail, after firing
