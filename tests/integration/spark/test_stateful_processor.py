"""A PySpark StatefulProcessor run unchanged on keyedstate, differentially against Spark's own transformWithStateInPandas.

The same processor class (a W2-like sessionization with value, list and map state) runs on the
same micro-batches twice: in a real Structured Streaming query through Spark's
``transformWithStateInPandas`` (RocksDB state store), and through
``KeyedStateRuntime.processor_batch`` on a real cluster, with the first attempt of every even task
failing after its writes were staged and a batch delivered again. Every batch's output must be the
same rows; a last batch closes every open session, so the state each left behind is compared too.
"""

from __future__ import annotations

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
from pyspark.sql.streaming.stateful_processor import StatefulProcessor, StatefulProcessorHandle, TimerValues

from keyedstate.common.descriptors import StateKind, TtlConfig
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.minicluster import MiniCluster
from keyedstate.common.spark import KeyedStateRuntime, processor_operator, processor_states
from tests.fixtures.cluster import InProcessCluster
from tests.fixtures.tiers import exhaustive

pytestmark = pytest.mark.spark

from pyspark import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

GAP = 1800
OUTPUT_DDL = "user string, start long, count long, duration long, pages long"
INPUT_DDL = "user string, ts long, page string"
INITIAL_DDL = "user string, start long, page string"
FLUSH_TS = 10**12  # an event this late closes every open session


class Sessionize(StatefulProcessor):
    """Per user: the open session (start, last, count), its event times, and events per page.

    An event more than GAP seconds after the session's last one closes it and emits (user, start,
    count, duration, distinct pages). ``failures`` (a directory, set on the keyedstate run only): the
    first attempt of every even task fails in ``close``, after the task's writes were staged, and
    leaves a file there saying so.
    """

    def __init__(self, failures: str | None = None) -> None:
        self.failures = failures

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.session = handle.getValueState("session", "start long, last long, count long")
        self.times = handle.getListState("times", "ts long")
        self.pages = handle.getMapState("pages", "page string", "n long")

    def handleInputRows(
        self, key: Any, rows: Iterator[pd.DataFrame], timerValues: TimerValues
    ) -> Iterator[pd.DataFrame]:
        events = sorted((int(t), str(p)) for pdf in rows for t, p in zip(pdf["ts"], pdf["page"]))
        user = str(key[0])
        closed: list[tuple[str, int, int, int, int]] = []
        current = self.session.get() if self.session.exists() else None
        for ts, page in events:
            if current is not None and ts - current[1] > GAP:
                start, last, count = current
                times = [t for (t,) in self.times.get()]
                assert len(times) == count and times[0] == start, (times, current)
                closed.append((user, start, count, last - start, len(list(self.pages.keys()))))
                self.times.clear()
                self.pages.clear()
                current = None
            if current is None:
                current = (ts, ts, 1)
                self.times.put([(ts,)])
            else:
                current = (current[0], ts, current[2] + 1)
                self.times.appendValue((ts,))
            seen = self.pages.getValue((page,))
            self.pages.updateValue((page,), ((seen[0] if seen else 0) + 1,))
        if current is not None and current[0] >= FLUSH_TS:
            self.session.clear()  # the flush event's own session is not kept
            self.times.clear()
            self.pages.clear()
        elif current is not None:
            self.session.update(current)
        yield pd.DataFrame(closed, columns=["user", "start", "count", "duration", "pages"])

    def handleInitialState(self, key: Any, initialState: pd.DataFrame, timerValues: TimerValues) -> None:
        """A session already open when the query starts: one event at ``start`` on page ``page``."""
        for start, page in zip(initialState["start"], initialState["page"]):
            self.session.update((int(start), int(start), 1))
            self.times.put([(int(start),)])
            self.pages.updateValue((str(page),), (1,))

    def close(self) -> None:
        if self.failures:
            from pyspark import TaskContext

            ctx = TaskContext.get()
            if ctx is not None and ctx.attemptNumber() == 0 and ctx.partitionId() % 2 == 0:
                Path(self.failures, f"task-{ctx.taskAttemptId()}").touch()
                raise RuntimeError("injected task failure after the writes were staged")


def _batches(seed: int, users: int = 40, batches: int = 4, per_batch: int = 300) -> list[pd.DataFrame]:
    """Event time grows batch by batch (an hour each), arrival order shuffled inside a batch; then a flush batch."""
    rnd = random.Random(seed)
    out = []
    for b in range(batches):
        rows = [
            (f"u{rnd.randrange(users)}", 1_700_000_000 + b * 3600 + rnd.randrange(3600), rnd.choice("abcde"))
            for _ in range(per_batch)
        ]
        out.append(pd.DataFrame(rows, columns=["user", "ts", "page"]))
    out.append(pd.DataFrame([(f"u{u}", FLUSH_TS, "z") for u in range(users)], columns=["user", "ts", "page"]))
    return out


def _write_files(batches: list[pd.DataFrame], directory: Path) -> list[Path]:
    directory.mkdir()
    schema = pa.schema([("user", pa.string()), ("ts", pa.int64()), ("page", pa.string())])
    paths = []
    for i, pdf in enumerate(batches):
        path = directory / f"part-{i:03d}.parquet"
        pq.write_table(pa.Table.from_pandas(pdf, schema=schema, preserve_index=False), path)
        os.utime(path, (1_000_000 + i, 1_000_000 + i))  # the file source takes files oldest first
        paths.append(path)
    return paths


Rows = list[tuple[Any, ...]]


def _rows(pdf: pd.DataFrame) -> Rows:
    return sorted(tuple(r) for r in pdf[["user", "start", "count", "duration", "pages"]].itertuples(index=False))


def _spark_reference(
    spark: SparkSession, directory: Path, checkpoint: Path, initial: pd.DataFrame | None = None
) -> dict[int, Rows]:
    """Spark's own transformWithStateInPandas over the files, one file per micro-batch: the output per batch."""
    session = spark.newSession()  # its own SQL conf: the shared session's stays as it is
    session.conf.set(
        "spark.sql.streaming.stateStore.providerClass",
        "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
    )
    out: dict[int, Rows] = {}

    def collect(df: Any, batch_id: int) -> None:
        out[batch_id] = _rows(df.toPandas())

    initial_state = None if initial is None else session.createDataFrame(initial, INITIAL_DDL).groupBy("user")
    stream = (
        session.readStream.schema(INPUT_DDL)
        .option("maxFilesPerTrigger", 1)
        .parquet(str(directory))
        .groupBy("user")
        .transformWithStateInPandas(Sessionize(), OUTPUT_DDL, "Append", "None", initialState=initial_state)
    )
    query = (
        stream.writeStream.foreachBatch(collect)
        .outputMode("append")
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return out


@pytest.fixture(scope="module")
def reference(
    spark: SparkSession, tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[pd.DataFrame], list[Path], dict[int, Rows]]:
    """The input batches, their files, and Spark's output per batch (computed once for both backends)."""
    work = tmp_path_factory.mktemp("tws-reference")
    batches = _batches(seed=7)
    paths = _write_files(batches, work / "input")
    expected = _spark_reference(spark, work / "input", work / "spark-checkpoint")
    assert sorted(expected) == list(range(len(batches)))
    # Sessions closed inside the stream (not only by the flush batch), and each closed with several pages.
    assert sum(len(expected[b]) for b in range(1, len(batches) - 1)) > 20
    assert max(r[4] for rows in expected.values() for r in rows) > 2
    return batches, paths, expected


@pytest.mark.parametrize(
    "backend",
    [
        "rocksdb",
        # The handles' value and list state are the backends' (tests/contract runs each on both).
        exhaustive("hashmap", covered_by="test_the_same_processor_gives_sparks_output_exactly_once[rocksdb]"),
    ],
)
def test_the_same_processor_gives_sparks_output_exactly_once(
    spark: SparkSession,
    inprocess_cluster: Callable[..., InProcessCluster],
    tmp_path: Path,
    backend: str,
    reference: tuple[list[pd.DataFrame], list[Path], dict[int, Rows]],
) -> None:
    batches, paths, expected = reference

    cluster = inprocess_cluster(taskmanagers=2, slots=1, backend=backend)
    runtime = KeyedStateRuntime(cluster.address, f"tws-{backend}", [processor_operator(Sessionize(), "sessions", 2)])
    received: dict[int, list[Rows]] = {}
    on_batch = runtime.processor_batch(
        Sessionize(failures=str(tmp_path)),
        key_col="user",
        output_schema=OUTPUT_DDL,
        sink=lambda pdf, batch_id: received.setdefault(batch_id, []).append(_rows(pdf)),
        sink_format="pandas",
        operator="sessions",
    )
    frames = [spark.read.parquet(str(p)) for p in paths]
    for batch_id, df in enumerate(frames[:3]):
        on_batch(df, batch_id)
    on_batch(frames[2], 2)  # delivered again (a driver restart before Spark recorded it): already committed
    assert runtime.batches_skipped == 1
    for batch_id in range(3, len(frames)):
        on_batch(frames[batch_id], batch_id)
    # Every batch reached the sink once (failed attempts' rows never arrive) with exactly Spark's rows.
    assert {b: len(runs) for b, runs in received.items()} == dict.fromkeys(range(len(batches)), 1)
    assert {b: runs[0] for b, runs in received.items()} == expected
    assert runtime.committed_epoch() == len(batches) - 1
    assert len(list(tmp_path.glob("task-*"))) >= len(batches)  # a failed first attempt in every batch's Spark job
    # The flush batch closed every session and cleared its state: nothing is left in any state.
    state = runtime.client
    users = sorted({u for pdf in batches for u in pdf["user"]})
    from keyedstate.common.client import ListState, ValueState

    assert ValueState[str, Any](state, runtime.job_id, "sessions", "session").get_many(users) == [None] * len(users)
    assert ListState[str, Any](state, runtime.job_id, "sessions", "times").get_many(users) == [[]] * len(users)


def test_descriptors_come_from_init() -> None:
    class WithTtl(Sessionize):
        def init(self, handle: StatefulProcessorHandle) -> None:
            super().init(handle)
            self.seen = handle.getValueState("seen", "n long", 60_000)

    states = {s.name: s for s in processor_states(WithTtl())}
    assert {n: s.kind for n, s in states.items()} == {
        "session": StateKind.VALUE,
        "times": StateKind.LIST,
        "pages": StateKind.MAP,
        "seen": StateKind.VALUE,
    }
    spec = processor_operator(WithTtl(), "op", 3)
    assert spec.parallelism == 3
    assert {d.name: d.ttl for d in spec.states}["seen"] == TtlConfig(60_000)


def test_a_processor_unlike_its_operator_or_without_its_timers_state_is_refused(
    spark: SparkSession, inprocess_cluster: Callable[..., InProcessCluster]
) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=1, backend="hashmap")

    class Other(Sessionize):
        def init(self, handle: StatefulProcessorHandle) -> None:
            super().init(handle)
            self.more = handle.getListState("more", "x long")

    runtime = KeyedStateRuntime(cluster.address, "tws-refused", [processor_operator(Sessionize(), "sessions", 1)])
    with pytest.raises(InvalidArgumentError, match="processor_operator"):
        runtime.processor_batch(Other(), key_col="user", output_schema=OUTPUT_DDL, sink=print)
    # A timer mode needs the timers state, which this operator was submitted without.
    with pytest.raises(InvalidArgumentError, match=r"time_mode='ProcessingTime'\) so the two agree"):
        runtime.processor_batch(
            Sessionize(), key_col="user", output_schema=OUTPUT_DDL, sink=print, time_mode="processingtime"
        )
    with pytest.raises(InvalidArgumentError, match="cannot parse schema"):
        runtime.processor_batch(Sessionize(), key_col="user", output_schema="user strin g", sink=print)
    df = spark.createDataFrame([(1.5, 1)], "user double, ts long")
    with pytest.raises(InvalidArgumentError, match="group by a string or integral column"):
        runtime.transform_with_state_in_pandas(df, Sessionize(), key_col="user", output_schema=OUTPUT_DDL, sink=print)


def test_a_streaming_query_through_transform_with_state_in_pandas_feeds_a_foreach_batch_function(
    spark: SparkSession,
    inprocess_cluster: Callable[..., InProcessCluster],
    tmp_path: Path,
    reference: tuple[list[pd.DataFrame], list[Path], dict[int, Rows]],
) -> None:
    batches, paths, expected = reference
    cluster = inprocess_cluster(taskmanagers=2, slots=1, backend="hashmap")
    runtime = KeyedStateRuntime(cluster.address, "tws-stream", [processor_operator(Sessionize(), "sessions", 2)])
    received: dict[int, Rows] = {}

    def write(df: Any, batch_id: int) -> None:  # a function written for Spark's own foreachBatch
        received[batch_id] = _rows(df.toPandas())

    stream = spark.readStream.schema(INPUT_DDL).option("maxFilesPerTrigger", 1).parquet(str(paths[0].parent))
    query = (
        runtime.transform_with_state_in_pandas(
            stream, Sessionize(), key_col="user", output_schema=OUTPUT_DDL, sink=write
        )
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    assert received == expected
    assert runtime.last_batch_id == len(batches) - 1 and runtime.durable_epoch() == len(batches) - 1


def test_a_taskmanager_killed_before_the_commit_reruns_the_batch_with_the_same_output(
    spark: SparkSession,
    process_cluster: Callable[..., MiniCluster],
    reference: tuple[list[pd.DataFrame], list[Path], dict[int, Rows]],
) -> None:
    """SIGKILL of a TaskManager process after a batch's tasks ran and its output reached the sink,
    before its commit: the job fails over to the checkpoint of the previous batch, the batch runs
    again, and the sink gets the same rows again for the same batch id (at-least-once delivery,
    idempotent per batch id); the state ends as Spark's."""
    batches, paths, expected = reference
    cluster = process_cluster(taskmanagers=2, slots=1, backend="rocksdb")
    runtime = KeyedStateRuntime(
        cluster.jobmanager_address, "tws-kill", [processor_operator(Sessionize(), "sessions", 2)]
    )
    deliveries: list[tuple[int, Rows]] = []

    def sink(pdf: pd.DataFrame, batch_id: int) -> None:
        deliveries.append((batch_id, _rows(pdf)))
        if batch_id == 2 and len(deliveries) == 3:
            cluster.taskmanagers[1].kill()
            cluster.restart_taskmanager(1)

    on_batch = runtime.processor_batch(
        Sessionize(), key_col="user", output_schema=OUTPUT_DDL, sink=sink, sink_format="pandas", operator="sessions"
    )
    for batch_id, path in enumerate(paths):
        on_batch(spark.read.parquet(str(path)), batch_id)
    assert [b for b, _ in deliveries] == [0, 1, 2, 2, *range(3, len(batches))]
    assert deliveries[2] == deliveries[3]  # the re-run emitted the same rows
    assert dict(deliveries) == expected
    assert runtime.batch_attempts == len(batches) + 1
    assert runtime.committed_epoch() == len(batches) - 1


def test_initial_state_goes_through_handle_initial_state_in_the_first_batch_as_in_spark(
    spark: SparkSession,
    inprocess_cluster: Callable[..., InProcessCluster],
    tmp_path: Path,
    reference: tuple[list[pd.DataFrame], list[Path], dict[int, Rows]],
) -> None:
    _, paths, without_initial = reference
    # Sessions open before the stream starts: most go on into batch 0, u45 has no input at all.
    initial = pd.DataFrame(
        [(f"u{u}", 1_700_000_000 - 100 - u * 60, "init") for u in (*range(10), 45)], columns=["user", "start", "page"]
    )
    expected = _spark_reference(spark, paths[0].parent, tmp_path / "spark-checkpoint", initial)
    assert expected != without_initial  # the initial state changed the output
    cluster = inprocess_cluster(taskmanagers=2, slots=1, backend="hashmap")
    runtime = KeyedStateRuntime(cluster.address, "tws-initial", [processor_operator(Sessionize(), "sessions", 2)])
    received: dict[int, Rows] = {}
    on_batch = runtime.processor_batch(
        Sessionize(),
        key_col="user",
        output_schema=OUTPUT_DDL,
        sink=lambda pdf, batch_id: received.__setitem__(batch_id, _rows(pdf)),
        sink_format="pandas",
        operator="sessions",
        initial_state=spark.createDataFrame(initial, INITIAL_DDL),
    )
    frames = [spark.read.parquet(str(p)) for p in paths]
    on_batch(frames[0], 0)
    on_batch(frames[0], 0)  # batch 0 again: committed already, its initial state is not applied twice
    for batch_id in range(1, len(frames)):
        on_batch(frames[batch_id], batch_id)
    assert runtime.batches_skipped == 1
    assert received == expected
    from keyedstate.common.client import ValueState

    # u45 had only initial state: its session is still open (the flush batch closed users 0..39 only).
    assert ValueState[str, Any](runtime.client, runtime.job_id, "sessions", "session").get("u45") == (
        1_700_000_000 - 100 - 45 * 60,
        1_700_000_000 - 100 - 45 * 60,
        1,
    )


class CountPerPage(StatefulProcessor):
    """Grouped by (user, page): the running count of the pair, emitted every batch it has events."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", "n long")

    def handleInputRows(
        self, key: Any, rows: Iterator[pd.DataFrame], timerValues: TimerValues
    ) -> Iterator[pd.DataFrame]:
        current = self.count.get()
        n = sum(len(pdf) for pdf in rows) + (current[0] if current is not None else 0)
        self.count.update((n,))
        yield pd.DataFrame({"user": [str(key[0])], "page": [str(key[1])], "n": [n]})


def test_several_grouping_columns_are_one_key_as_in_spark(
    spark: SparkSession,
    inprocess_cluster: Callable[..., InProcessCluster],
    tmp_path: Path,
    reference: tuple[list[pd.DataFrame], list[Path], dict[int, Rows]],
) -> None:
    _, paths, _ = reference
    out_ddl = "user string, page string, n long"
    session = spark.newSession()
    session.conf.set(
        "spark.sql.streaming.stateStore.providerClass",
        "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
    )
    expected: dict[int, list[tuple[Any, ...]]] = {}
    (
        session.readStream.schema(INPUT_DDL)
        .option("maxFilesPerTrigger", 1)
        .parquet(str(paths[0].parent))
        .groupBy("user", "page")
        .transformWithStateInPandas(CountPerPage(), out_ddl, "Append", "None")
        .writeStream.foreachBatch(lambda df, b: expected.__setitem__(b, sorted(tuple(r) for r in df.collect())))
        .option("checkpointLocation", str(tmp_path / "spark-checkpoint"))
        .trigger(availableNow=True)
        .start()
        .awaitTermination()
    )
    cluster = inprocess_cluster(taskmanagers=2, slots=1, backend="rocksdb")
    runtime = KeyedStateRuntime(cluster.address, "tws-pairs", [processor_operator(CountPerPage(), "pairs", 2)])
    received: dict[int, list[tuple[Any, ...]]] = {}
    stream = spark.readStream.schema(INPUT_DDL).option("maxFilesPerTrigger", 1).parquet(str(paths[0].parent))
    (
        runtime.transform_with_state_in_pandas(
            stream,
            CountPerPage(),
            key_col=["user", "page"],
            output_schema=out_ddl,
            sink=lambda df, b: received.__setitem__(b, sorted(tuple(r) for r in df.collect())),
        )
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
        .awaitTermination()
    )
    assert received == expected
    assert max(r[2] for rows in expected.values() for r in rows) > 3  # counts carried across batches
