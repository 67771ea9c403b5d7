"""A StatefulProcessor with timers, run unchanged on keyedstate and differentially against Spark's own.

The same processor classes run over the same micro-batches through Spark's
``transformWithStateInPandas`` (RocksDB state store) and through
``KeyedStateRuntime.transform_with_state_in_pandas`` / ``processor_batch`` on a real cluster:

* **EventTime**: a sessionization whose sessions close when an event-time timer at
  ``last event + GAP`` fires, with late rows (at or before the previous batch's watermark) that
  Spark drops, handlers that list timers while they run and register timers already due. Both
  run as streaming queries over the same files with ``withWatermark``, so both see the watermark
  Spark records per batch; Spark's no-data batches are turned off in the reference (a
  ``foreachBatch`` query has none, see the README). Every batch's rows must be the same multiset.
* **ProcessingTime**: timers relative to the batch timestamp; the batch timestamps Spark recorded
  in its offset log are replayed into the runtime's injected clock, so outputs that contain
  processing times compare exactly.
* **Exactly once**: on the keyedstate side the first attempt of each task fails at a step drawn from a
  seed (before any key, in a key's rows, in a timer handler, after everything was staged, or not at all),
  one batch is delivered twice, and (in ``test_processor_timers_failover``)
  a TaskManager process is killed mid-run.
"""

from __future__ import annotations

import json
import os
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession
from pyspark.sql.streaming.stateful_processor import (
    ExpiredTimerInfo,
    StatefulProcessor,
    StatefulProcessorHandle,
    TimerValues,
)

from keyedstate.common.client import TimeDomain, TimerService
from keyedstate.common.clock import SYSTEM_CLOCK
from keyedstate.common.descriptors import StateKind
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.spark import KeyedStateRuntime, processor_operator
from keyedstate.common.spark._processor import TIMERS_STATE
from tests.fixtures.cluster import InProcessCluster
from tests.fixtures.tiers import exhaustive

# Each test runs a multi-batch query on Spark and on the runtime (with task failures): longer than the default.
pytestmark = [pytest.mark.spark, pytest.mark.timeout(900)]

from pyspark import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

GAP_MS = 20_000
DELAY = "5 seconds"
INPUT_DDL = "user string, ts timestamp, ms long, page string"
OUT_DDL = "user string, start long, count long, pages long, reason string, expiry long, watermark long, timers string"
T0 = 1_700_000_000_000


class TimerSessions(StatefulProcessor):
    """Per user an open session (start, last, count) and its pages; a timer at ``last + GAP_MS`` closes it.

    An event more than GAP_MS after the last one closes the session in ``handleInputRows`` (reason
    "gap": its timer was not due yet, the watermark lags). The timer handler emits the session
    (reason "timer") with the timers the key has while the handler runs, and for users named
    ``r*`` registers a timer already due (it must fire in the next batch, as in Spark).
    ``failures`` (keyedstate only): the first attempt of each task fails at a step drawn from
    ``seed`` and the task (:data:`FAULT_STEPS`), and leaves a file naming it there.
    """

    def __init__(self, failures: str | None = None, seed: int = 0) -> None:
        self.failures = failures
        self.seed = seed

    def _maybe_fail(self, step: str) -> None:
        if not self.failures:
            return
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if ctx is None or ctx.attemptNumber() != 0:
            return
        if getattr(self, "_task", None) != ctx.taskAttemptId():
            # Partition p's k-th first attempt takes step k of a cycle through every step in an order drawn
            # from (seed, p), and a call number drawn from (seed, p, k): the same schedule every run.
            self._task = ctx.taskAttemptId()
            p = ctx.partitionId()
            k = len(list(Path(self.failures).glob(f"first-{p}-*")))
            Path(self.failures, f"first-{p}-{k}").touch()
            order = list(FAULT_STEPS)
            random.Random(f"{self.seed}-{p}").shuffle(order)
            self._fault = order[k % len(order)]
            self._nth = random.Random(f"{self.seed}-{p}-{k}").randrange(1, 4) if self._fault == "rows" else 1
            self._calls = dict.fromkeys(FAULT_STEPS, 0)
        self._calls[step] += 1
        # The rows step fails at the nth key (a task with fewer keys lives on), the others at their first call.
        if step == self._fault and self._calls[step] == self._nth:
            Path(self.failures, f"task-{ctx.taskAttemptId()}-{step}").touch()
            raise RuntimeError(f"injected task failure at {step}")

    def init(self, handle: StatefulProcessorHandle) -> None:
        self._maybe_fail("init")
        self.handle = handle
        self.session = handle.getValueState("session", "start long, last long, count long")
        self.pages = handle.getListState("pages", "page string")

    def _closed(self, user: str, reason: str, expiry: int, watermark: int) -> tuple[Any, ...]:
        start, _last, count = self.session.get()  # type: ignore[misc]
        pages = len({p for (p,) in self.pages.get()})
        timers = json.dumps(sorted(int(t) for t in self.handle.listTimers()))
        return (user, int(start), int(count), pages, reason, expiry, watermark, timers)

    def handleInputRows(self, key: Any, rows: Iterator[pd.DataFrame], timerValues: TimerValues) -> Iterator[Any]:
        self._maybe_fail("rows")
        user = str(key[0])
        watermark = timerValues.getCurrentWatermarkInMs()
        events = sorted((int(ms), str(p)) for pdf in rows for ms, p in zip(pdf["ms"], pdf["page"]))
        out = []
        current = self.session.get() if self.session.exists() else None
        for ms, page in events:
            if current is not None and ms - current[1] > GAP_MS:
                self.session.update(current)
                out.append(self._closed(user, "gap", -1, watermark))
                self.handle.deleteTimer(current[1] + GAP_MS)
                self.pages.clear()
                current = None
            if current is None:
                current = (ms, ms, 1)
            else:
                self.handle.deleteTimer(current[1] + GAP_MS)
                current = (current[0], max(ms, current[1]), current[2] + 1)
            self.pages.appendValue((page,))
        if current is not None:
            self.session.update(current)
            self.handle.registerTimer(current[1] + GAP_MS)
        yield pd.DataFrame(out, columns=OUT_DDL_COLUMNS)

    def handleExpiredTimer(
        self, key: Any, timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo
    ) -> Iterator[Any]:
        user = str(key[0])
        expiry = expiredTimerInfo.getExpiryTimeInMs()
        self._maybe_fail("timer")  # after earlier timers of the task fired and wrote
        watermark = timerValues.getCurrentWatermarkInMs()
        rows = []
        if self.session.exists():
            rows.append(self._closed(user, "timer", expiry, watermark))
            self.session.clear()
            self.pages.clear()
        else:  # a timer with no session: one a handler registered already due
            rows.append((user, -1, 0, 0, "late-timer", expiry, watermark, json.dumps(sorted(self.handle.listTimers()))))
        if user.startswith("r") and expiry % 2 == 0:
            self.handle.registerTimer(expiry + 1)  # already due: fires in the next batch, as in Spark
        yield pd.DataFrame(rows, columns=OUT_DDL_COLUMNS)

    def close(self) -> None:
        self._maybe_fail("close")  # after the task's writes and fired timers were staged


FAULT_STEPS = ("none", "init", "rows", "timer", "close")
"""Where a task's first attempt fails: nowhere, before any key, in a key's rows, in a timer's handler, after
everything was staged."""
OUT_DDL_COLUMNS = ["user", "start", "count", "pages", "reason", "expiry", "watermark", "timers"]
Rows = list[tuple[Any, ...]]


def _rows(pdf: pd.DataFrame) -> Rows:
    return sorted(tuple(r) for r in pdf[OUT_DDL_COLUMNS].itertuples(index=False))


def event_batches(
    seed: int, users: int = 24, batches: int = 6, per_batch: int = 60
) -> list[list[tuple[str, int, str]]]:
    """Event time advances ~15 s a batch; some rows arrive late; the last two batches flush every session."""
    rnd = random.Random(seed)
    out: list[list[tuple[str, int, str]]] = []
    for b in range(batches):
        rows = []
        for _ in range(per_batch):
            user = f"{rnd.choice('ru')}{rnd.randrange(users)}"
            lateness = rnd.choice([0, 0, 0, 0, 30_000])  # some rows are older than the previous watermark
            rows.append((user, T0 + b * 15_000 + rnd.randrange(15_000) - lateness, rnd.choice("abcd")))
        out.append(rows)
    far = T0 + 10**9
    out.append([("flush", far, "z")])
    out.append([("flush", far + 1, "z")])  # its watermark is past every session's timer
    return out


def write_files(batches: list[list[tuple[str, int, str]]], directory: Path) -> None:
    directory.mkdir()
    for i, rows in enumerate(batches):
        table = pa.table(
            {
                "user": [u for u, _, _ in rows],
                "ts": pa.array([ms * 1000 for _, ms, _ in rows], pa.timestamp("us", tz="UTC")),
                "ms": pa.array([ms for _, ms, _ in rows], pa.int64()),
                "page": [p for _, _, p in rows],
            }
        )
        path = directory / f"part-{i:03d}.parquet"
        pq.write_table(table, path)
        os.utime(path, (1_000_000 + i, 1_000_000 + i))  # the file source takes the oldest first


def reference_session(spark: SparkSession) -> SparkSession:
    session = spark.newSession()  # its own SQL conf: the shared session's stays as it is
    session.conf.set(
        "spark.sql.streaming.stateStore.providerClass",
        "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
    )
    # A foreachBatch query runs no batch without data; the reference runs the same batches.
    session.conf.set("spark.sql.streaming.noDataMicroBatches.enabled", "false")
    return session


def spark_reference(
    spark: SparkSession, source: Path, checkpoint: Path, processor: Any, time_mode: str
) -> dict[int, Rows]:
    session = reference_session(spark)
    out: dict[int, Rows] = {}
    stream = session.readStream.schema(INPUT_DDL).option("maxFilesPerTrigger", 1).parquet(str(source))
    if time_mode == "EventTime":
        stream = stream.withWatermark("ts", DELAY)
    (
        stream.groupBy("user")
        .transformWithStateInPandas(processor, OUT_DDL, "Append", time_mode)
        .writeStream.foreachBatch(lambda df, b: out.__setitem__(b, _rows(df.toPandas())))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
        .awaitTermination()
    )
    return out


EventTimeCase = tuple[Path, dict[int, Rows], set[tuple[str, int]]]
"""The input files, Spark's output per batch, and the timers Spark's state holds at the end."""


@pytest.fixture(scope="module")
def event_time_reference(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> EventTimeCase:
    return event_time_case(spark, tmp_path_factory.mktemp("tws-timers-reference"))


def event_time_case(spark: SparkSession, work: Path) -> EventTimeCase:
    """The EventTime case through Spark's own transformWithStateInPandas, checked to exercise every path."""
    batches = event_batches(seed=11)
    write_files(batches, work / "input")
    expected = spark_reference(spark, work / "input", work / "spark-checkpoint", TimerSessions(), "EventTime")
    assert sorted(expected) == list(range(len(batches)))
    reasons = [r[4] for rows in expected.values() for r in rows]
    # The schedule exercises every path: timer closes, gap closes, timers registered already due.
    assert reasons.count("timer") > 20 and reasons.count("gap") > 0 and reasons.count("late-timer") > 0
    # Timers fired in the stream, not only at the flush, and handlers saw their own timer still listed.
    assert any(r[4] == "timer" for b in range(1, len(batches) - 1) for r in expected[b])
    assert all(r[5] in json.loads(r[7]) for rows in expected.values() for r in rows if r[4] == "timer")
    return work / "input", expected, spark_timers(spark, work / "spark-checkpoint")


def spark_timers(spark: SparkSession, checkpoint: Path) -> set[tuple[str, int]]:
    """The timers Spark's state store holds after the query (its state reader)."""
    rows = spark.read.format("statestore").option("readRegisteredTimers", "true").load(str(checkpoint)).collect()
    return {(r["key"]["user"], int(r["expiration_timestamp_ms"])) for r in rows}


def run_ours(
    spark: SparkSession,
    address: str,
    source: Path,
    checkpoint: Path,
    job_id: str,
    failures: str | None = None,
    seed: int = 0,
    around: Callable[[Callable[[Any, int], None], Any, int], None] | None = None,
    after_sink: Callable[[int, int], None] | None = None,
) -> tuple[KeyedStateRuntime, dict[int, Rows], list[tuple[int, Rows]]]:
    """The EventTime case on keyedstate as a streaming query: (runtime, the rows per batch, every delivery).

    ``around(run, df, batch_id)`` wraps each batch (then through ``processor_batch``, else through
    ``transform_with_state_in_pandas``); ``after_sink(batch_id, deliveries)`` runs after each sink call.
    """
    runtime = KeyedStateRuntime(address, job_id, [processor_operator(TimerSessions(), "sessions", 2, "EventTime")])
    received: dict[int, Rows] = {}
    deliveries: list[tuple[int, Rows]] = []

    def sink(pdf: pd.DataFrame, batch_id: int) -> None:  # idempotent per batch id, as foreachBatch asks
        received[batch_id] = _rows(pdf)
        deliveries.append((batch_id, received[batch_id]))
        if after_sink is not None:
            after_sink(batch_id, len(deliveries))

    stream = spark.readStream.schema(INPUT_DDL).option("maxFilesPerTrigger", 1).parquet(str(source))
    stream = stream.withWatermark("ts", DELAY)
    if around is None:  # the one-line migration of transformWithStateInPandas
        writer = runtime.transform_with_state_in_pandas(
            stream,
            TimerSessions(failures, seed),
            key_col="user",
            output_schema=OUT_DDL,
            sink=sink,
            sink_format="pandas",
            operator="sessions",
            time_mode="EventTime",
        )
    else:
        on_batch = runtime.processor_batch(
            TimerSessions(failures, seed),
            key_col="user",
            output_schema=OUT_DDL,
            sink=sink,
            sink_format="pandas",
            operator="sessions",
            time_mode="EventTime",
        )
        writer = stream.writeStream.foreachBatch(lambda df, batch_id: around(on_batch, df, batch_id))
    query = writer.option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start()
    query.awaitTermination(600)
    assert query.exception() is None
    return runtime, received, deliveries


def remaining_timers(runtime: KeyedStateRuntime) -> set[tuple[str, int]]:
    timers: TimerService[str] = TimerService(runtime.client, runtime.job_id, "sessions", TIMERS_STATE)
    return {(t.key, t.timestamp_ms) for t in timers.due(TimeDomain.EVENT_TIME, (1 << 63) - 1)}


@pytest.mark.parametrize(
    ("backend", "seed"),
    [
        ("rocksdb", 1),
        # Each seed's faults hit every step (asserted below); the timers state on hashmap is compared with a
        # reference model, epochs and rescales included, by tests/integration/timers/test_timer_service.py.
        exhaustive("hashmap", 2, covered_by="test_event_time_timers_give_sparks_output_exactly_once[rocksdb-1]"),
    ],
)
def test_event_time_timers_give_sparks_output_exactly_once(
    spark: SparkSession,
    inprocess_cluster: Callable[..., InProcessCluster],
    tmp_path: Path,
    backend: str,
    seed: int,
    event_time_reference: EventTimeCase,
) -> None:
    source, expected, spark_left = event_time_reference
    cluster = inprocess_cluster(taskmanagers=2, slots=1, backend=backend)
    calls: list[int] = []

    def twice(run: Callable[[Any, int], None], df: Any, batch_id: int) -> None:
        calls.append(batch_id)
        run(df, batch_id)
        if batch_id == 3:
            run(df, batch_id)  # delivered again (a driver restart before Spark recorded it): already committed

    runtime, received, deliveries = run_ours(
        spark, cluster.address, source, tmp_path / "checkpoint", f"tws-timers-{backend}", str(tmp_path), seed, twice
    )
    assert received == expected  # every batch: the same rows as Spark, timers fired once
    assert [b for b, _ in deliveries] == sorted(expected)  # each batch reached the sink once
    assert runtime.batches_skipped == 1
    # The seeded faults hit every step somewhere: before any key, in rows, in a timer handler, after staging.
    assert {f.name.split("-")[-1] for f in tmp_path.glob("task-*")} == set(FAULT_STEPS) - {"none"}
    # The timers left registered are Spark's: the flush key's own and those handlers registered in the last batch.
    assert remaining_timers(runtime) == spark_left and len(spark_left) > 1


def test_timer_calls_without_a_timer_mode_fail_as_in_spark_and_operators_declare_the_timers_state(
    spark: SparkSession, inprocess_cluster: Callable[..., InProcessCluster]
) -> None:
    spec = processor_operator(TimerSessions(), "op", 2, "eventtime")
    assert {d.name: d.kind for d in spec.states}[TIMERS_STATE] is StateKind.TIMERS
    assert TIMERS_STATE not in {d.name for d in processor_operator(TimerSessions(), "op", 2).states}
    cluster = inprocess_cluster(taskmanagers=1, slots=1, backend="hashmap")
    runtime = KeyedStateRuntime(cluster.address, "tws-modes", [processor_operator(TimerSessions(), "sessions", 1)])
    # The operator was submitted without timers: a timer mode names the fix.
    with pytest.raises(InvalidArgumentError, match=r"time_mode='ProcessingTime'\) so the two agree"):
        runtime.processor_batch(
            TimerSessions(), key_col="user", output_schema=OUT_DDL, sink=print, time_mode="processingtime"
        )
    with pytest.raises(InvalidArgumentError, match="not one of None, ProcessingTime, EventTime"):
        runtime.processor_batch(TimerSessions(), key_col="user", output_schema=OUT_DDL, sink=print, time_mode="Wall")
    # In time mode "None" the processor's registerTimer fails the batch with Spark's error class.
    on_batch = runtime.processor_batch(
        TimerSessions(), key_col="user", output_schema=OUT_DDL, sink=print, sink_format="pandas"
    )
    df = spark.createDataFrame([("u1", T0, "a")], "user string, ms long, page string")
    with pytest.raises(Exception, match="STATEFUL_PROCESSOR_CANNOT_PERFORM_OPERATION_WITH_INVALID_TIME_MODE"):
        on_batch(df, 0)

    class Reserved(TimerSessions):
        def init(self, handle: StatefulProcessorHandle) -> None:
            handle.getValueState(TIMERS_STATE, "n long")

    with pytest.raises(InvalidArgumentError, match="is the runtime's"):
        processor_operator(Reserved(), "op", 1, "EventTime")
    # Several grouping columns with a timer mode: only types whose JSON gives them back exactly.
    typed = spark.createDataFrame([("u1", 1.5, T0, "a")], "user string, score double, ms long, page string")
    with pytest.raises(InvalidArgumentError, match="grouping column 'score' is double"):
        runtime.transform_with_state_in_pandas(
            typed, TimerSessions(), key_col=["user", "score"], output_schema=OUT_DDL, sink=print, time_mode="EventTime"
        )


class ProcessingTimers(StatefulProcessor):
    """Processing-time timers relative to the batch timestamp: page "a" in 0 ms (due in this batch, after the
    rows), "b" in 1 ms (the next batch), "c" in a day (never here), "d" deletes the key's timers."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.seen = handle.getValueState("seen", "n long")

    def handleInputRows(self, key: Any, rows: Iterator[pd.DataFrame], timerValues: TimerValues) -> Iterator[Any]:
        now = timerValues.getCurrentProcessingTimeInMs()
        n = 0
        for pdf in rows:
            for page in pdf["page"]:
                n += 1
                if page == "d":
                    for t in list(self.handle.listTimers()):
                        self.handle.deleteTimer(t)
                else:
                    self.handle.registerTimer(now + {"a": 0, "b": 1, "c": 86_400_000}[str(page)])
        seen = self.seen.get()
        self.seen.update(((seen[0] if seen else 0) + n,))
        # Spark lists timers in its storage order (no promised order): compared sorted.
        timers = json.dumps(sorted(t - now for t in self.handle.listTimers()))
        yield pd.DataFrame([(str(key[0]), "rows", now, -1, n, timers)], columns=PT_COLUMNS)

    def handleExpiredTimer(
        self, key: Any, timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo
    ) -> Iterator[Any]:
        now = timerValues.getCurrentProcessingTimeInMs()
        seen = self.seen.get()
        # Spark lists timers in its storage order (no promised order): compared sorted.
        timers = json.dumps(sorted(t - now for t in self.handle.listTimers()))
        yield pd.DataFrame(
            [(str(key[0]), "timer", now, expiredTimerInfo.getExpiryTimeInMs(), seen[0] if seen else 0, timers)],
            columns=PT_COLUMNS,
        )


PT_COLUMNS = ["user", "kind", "now", "expiry", "n", "timers"]
PT_DDL = "user string, kind string, now long, expiry long, n long, timers string"


class ReplayedClock:
    """The batch timestamps Spark recorded, replayed as wall-clock time (monotonic time stays real)."""

    def __init__(self) -> None:
        self.now = 0

    def now_ms(self) -> int:
        return self.now

    def monotonic_ms(self) -> int:
        return SYSTEM_CLOCK.monotonic_ms()

    def boottime_ms(self) -> int:
        return SYSTEM_CLOCK.boottime_ms()


def test_processing_time_timers_give_sparks_output_at_the_same_batch_timestamps(
    spark: SparkSession, inprocess_cluster: Callable[..., InProcessCluster], tmp_path: Path
) -> None:
    rnd = random.Random(5)
    batches = [
        [(f"u{rnd.randrange(12)}", T0 + b * 1000 + i, rnd.choice("aabbcd")) for i in range(30)] for b in range(5)
    ]
    write_files(batches, tmp_path / "input")
    processor = ProcessingTimers()
    session = reference_session(spark)
    expected: dict[int, list[tuple[Any, ...]]] = {}
    checkpoint = tmp_path / "spark-checkpoint"
    (
        session.readStream.schema(INPUT_DDL)
        .option("maxFilesPerTrigger", 1)
        .parquet(str(tmp_path / "input"))
        .groupBy("user")
        .transformWithStateInPandas(processor, PT_DDL, "Append", "ProcessingTime")
        .writeStream.foreachBatch(lambda df, b: expected.__setitem__(b, sorted(tuple(r) for r in df.collect())))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
        .awaitTermination()
    )
    assert sorted(expected) == list(range(len(batches)))
    # The batch timestamps Spark recorded (line 2 of each offset log entry), replayed into our clock.
    stamps = {
        int(f.name): json.loads(f.read_text().splitlines()[1])["batchTimestampMs"]
        for f in (checkpoint / "offsets").iterdir()
        if f.name.isdigit()
    }
    kinds = [r[1] for rows in expected.values() for r in rows]
    assert kinds.count("timer") > 10  # timers fired in the batch they were set in, and in later ones

    cluster = inprocess_cluster(taskmanagers=2, slots=1, backend="rocksdb")
    clock = ReplayedClock()
    runtime = KeyedStateRuntime(
        cluster.address, "tws-pt", [processor_operator(processor, "pt", 2, "ProcessingTime")], clock=clock
    )
    received: dict[int, list[tuple[Any, ...]]] = {}
    on_batch = runtime.processor_batch(
        ProcessingTimers(),
        key_col="user",
        output_schema=PT_DDL,
        sink=lambda pdf, b: received.__setitem__(b, sorted(tuple(r) for r in pdf.itertuples(index=False))),
        sink_format="pandas",
        operator="pt",
        time_mode="ProcessingTime",
    )
    for batch_id in range(len(batches)):
        clock.now = stamps[batch_id]
        on_batch(spark.read.parquet(str(tmp_path / "input" / f"part-{batch_id:03d}.parquet")), batch_id)
    assert received == expected
