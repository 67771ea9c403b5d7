"""The streaming variants of W1, each a Structured Streaming query over the same Parquet directory.

Every query reads ``maxFilesPerTrigger`` files per micro-batch and runs with
``trigger(availableNow=True)``, so it processes every file in the same micro-batches and stops
by itself; the timed span is ``start()`` to ``awaitTermination()``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from bench.w1.data import SCHEMA_DDL, W1Data

logger = logging.getLogger(__name__)

ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"


@dataclass(frozen=True)
class SparkSettings:
    """The session settings every Spark variant shares (recorded in the scenario's params)."""

    master: str = "local[2]"
    shuffle_partitions: int = 2
    driver_memory: str = "2g"

    def as_params(self) -> dict[str, Any]:
        return {
            "spark.master": self.master,
            "spark.sql.shuffle.partitions": self.shuffle_partitions,
            "spark.default.parallelism": self.shuffle_partitions,
            "spark.sql.execution.arrow.pyspark.enabled": True,
            "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
            "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": True,
            "spark.driver.memory": self.driver_memory,
            "trigger": "availableNow (maxFilesPerTrigger files per micro-batch)",
        }


COMMIT_MODE_ENV = "KEYEDSTATE_BENCH_COMMIT_MODE"


@contextlib.contextmanager
def cluster_and_spark(work: Path, parallelism: int, settings: SparkSettings) -> Iterator[tuple[Any, Any]]:
    """The Spark scenarios' cluster and session: 1 JobManager + ``parallelism`` TaskManager processes x 1
    slot (RocksDB, incremental file:// checkpoints under ``work``) and a Spark session, started side by side
    (both take seconds, and neither is timed); both stopped on exit."""
    from keyedstate.common.minicluster import MiniCluster

    with contextlib.ExitStack() as stack:
        cluster = MiniCluster(
            work / "cluster",
            num_taskmanagers=parallelism,
            slots_per_taskmanager=1,
            backend="rocksdb",
            config={
                "state.checkpoints.dir": (work / "checkpoints").resolve().as_uri(),
                "execution.checkpointing.incremental": "true",
                # `python -m bench --commit-mode` (the scenario runs in a child process: the environment carries it).
                "execution.checkpointing.commit-mode": os.environ.get(COMMIT_MODE_ENV, "sync"),
            },
        )
        stack.callback(cluster.stop)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            started = pool.submit(cluster.start)
            spark = start_session(work, settings)
            stack.callback(spark.stop)
            started.result()
        yield cluster, spark


def start_session(workdir: Path, settings: SparkSettings) -> Any:
    """A local SparkSession whose JVM and Python workers run in a scratch directory.

    The workers put their working directory first on ``sys.path``; in the repository root that
    would make its top-level folders importable under the wrong names.
    """
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark import cloudpickle
    from pyspark.sql import SparkSession

    import bench.w1.executor as executor_fns

    # Executors cannot import the bench package (it is not installed): ship its functions by value.
    cloudpickle.register_pickle_by_value(executor_fns)
    scratch = workdir / "spark-cwd"
    scratch.mkdir(parents=True, exist_ok=True)
    previous = os.getcwd()
    os.chdir(scratch)
    try:
        spark = (
            SparkSession.builder.master(settings.master)
            .appName("keyedstate-bench-w1")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.driver.memory", settings.driver_memory)
            .config("spark.sql.shuffle.partitions", str(settings.shuffle_partitions))
            .config("spark.default.parallelism", str(settings.shuffle_partitions))
            .config("spark.sql.execution.arrow.pyspark.enabled", "true")
            .config("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
            .config("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true")
            .config("spark.sql.warehouse.dir", str(workdir / "warehouse"))
            .config("spark.local.dir", str(workdir / "spark-local"))
            .config("spark.driver.extraJavaOptions", f"-Dderby.system.home={workdir}")
            .getOrCreate()
        )
    finally:
        os.chdir(previous)
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _stream(spark: Any, data: W1Data, files_per_trigger: int) -> Any:
    return (
        spark.readStream.schema(SCHEMA_DDL).option("maxFilesPerTrigger", files_per_trigger).parquet(str(data.directory))
    )


QUERY_TIMEOUT_S = 1800


@dataclass(frozen=True)
class BatchProgress:
    """One micro-batch as Spark's streaming query progress reports it."""

    batch_id: int
    input_rows: int
    duration_ms: dict[str, int]
    """Spark's ``durationMs``: ``triggerExecution`` (the whole trigger), ``addBatch`` (the sink, i.e. the
    foreachBatch call or the stateful plan), ``queryPlanning``, ``walCommit``, ``commitOffsets``, ..."""

    @property
    def trigger_ms(self) -> int:
        """The whole trigger: offsets, planning, the batch itself and the offset and commit logs."""
        return self.duration_ms["triggerExecution"]


@dataclass(frozen=True)
class QueryRun:
    seconds: float
    progress: list[BatchProgress]  # the query's micro-batches that read input, in order


def _batch_progress(progress: Any) -> BatchProgress:
    return BatchProgress(
        int(progress["batchId"]),
        int(progress["numInputRows"] or 0),
        {str(k): int(v) for k, v in dict(progress["durationMs"]).items()},
    )


def _run_query(writer: Any, timeout_s: float = QUERY_TIMEOUT_S) -> float:
    """Start the query, wait until availableNow has drained the input; returns the seconds taken."""
    return run_query_with_progress(writer, timeout_s).seconds


def run_query_with_progress(writer: Any, timeout_s: float = QUERY_TIMEOUT_S) -> QueryRun:
    """:func:`_run_query`, also returning the progress of every micro-batch that read input.

    Spark keeps the last ``spark.sql.streaming.numRecentProgressUpdates`` (100) progress updates.
    """
    start = time.perf_counter()
    query = writer.trigger(availableNow=True).start()
    if not query.awaitTermination(timeout_s):
        query.stop()
        raise RuntimeError(
            f"streaming query {query.name or query.id} did not finish within {timeout_s:.0f} s; "
            "its Spark and cluster logs are in the scenario's work directory (run with --keep)"
        )
    elapsed = time.perf_counter() - start
    if query.exception() is not None:
        raise RuntimeError(f"streaming query failed: {query.exception()}")
    progress = [_batch_progress(p) for p in query.recentProgress]
    return QueryRun(elapsed, [p for p in progress if p.input_rows > 0])


# -- ours --------------------------------------------------------------------------------------
OPERATOR = "w1"
STATE = "totals"


def operators(parallelism: int) -> list[Any]:
    from keyedstate.common.descriptors import OperatorSpec, ReduceField, StateDescriptor, StateKind

    return [
        OperatorSpec(
            OPERATOR,
            parallelism,
            (StateDescriptor(STATE, StateKind.REDUCING, reduce_fields=(ReduceField("count"), ReduceField("sum"))),),
        )
    ]


@dataclass
class OursRun:
    seconds: float
    batches: int
    timings: list[Any]  # keyedstate.common.spark.BatchTiming per micro-batch
    final: dict[int, tuple[int, int]]
    progress: list[BatchProgress] = field(default_factory=list)


def run_ours(
    spark: Any,
    data: W1Data,
    files_per_trigger: int,
    jobmanager: str,
    job_id: str,
    parallelism: int,
    workdir: Path,
    process: Callable[..., None] | None = None,
    mode: str = "keyed",
    job_config: dict[str, str] | None = None,
) -> OursRun:
    """foreachBatch through KeyedStateRuntime: epoch commit and a checkpoint per micro-batch.

    ``mode`` ``keyed``: ``process`` (default: pre-aggregate, then reduce) after the key-group
    shuffle; ``shuffle_free``: ``runtime.reduce_batch`` on the input partitions as they come.
    ``job_config``: per-job keys the job is submitted with (``state.changelog.enabled``, ...).
    """
    from bench.w1 import executor
    from keyedstate.common.spark import KeyedStateRuntime

    runtime = KeyedStateRuntime(jobmanager, job_id, operators(parallelism), job_config=job_config)
    try:
        if mode == "shuffle_free":
            on_batch = runtime.reduce_batch(
                STATE, key_col="user", fields={"count": "*", "sum": "amount"}, operator=OPERATOR, key_serializer="int"
            )
        else:
            on_batch = runtime.foreach_batch(
                process or executor.ours_process, key_col="user", operator=OPERATOR, key_serializer="int"
            )
        writer = (
            _stream(spark, data, files_per_trigger)
            .writeStream.foreachBatch(on_batch)
            .option("checkpointLocation", str(workdir / "spark-checkpoint-ours"))
        )
        query = run_query_with_progress(writer)
        final = read_state(runtime, data.users)
        return OursRun(query.seconds, runtime.batches_run, list(runtime.timings), final, query.progress)
    finally:
        try:
            runtime.client.cancel_job(job_id)  # frees the slots for the next run
        finally:
            runtime.close()


def read_state(runtime: Any, users: int) -> dict[int, tuple[int, int]]:
    """Every user's committed (count, sum), read back through the client (untimed)."""
    # With overlapped commits the last batch may still be applying when the query returns.
    runtime.client.wait_for_applied(runtime.job_id)
    from keyedstate.common.client import ReducingState

    state: ReducingState[int] = ReducingState(runtime.client, runtime.job_id, OPERATOR, STATE, key_serializer="int")
    out: dict[int, tuple[int, int]] = {}
    step = 50_000
    for start in range(0, users, step):
        keys = list(range(start, min(users, start + step)))
        for u, v in zip(keys, state.get_many(keys)):
            if v is not None:
                out[u] = (int(v[0]), int(v[1]))
    return out


# -- the alternatives --------------------------------------------------------------------------
def run_native(
    spark: Any, data: W1Data, files_per_trigger: int, workdir: Path
) -> tuple[float, dict[int, tuple[int, int]]]:
    """Spark's own streaming ``groupBy(user).agg(count, sum)`` on the RocksDB state store (update mode, noop sink).

    The final state is read afterwards, untimed, with the state data source reader.
    """
    native = run_native_with_progress(spark, data, files_per_trigger, workdir)
    return native.seconds, native.final


@dataclass(frozen=True)
class NativeRun:
    seconds: float
    final: dict[int, tuple[int, int]]
    progress: list[BatchProgress]


def run_native_with_progress(spark: Any, data: W1Data, files_per_trigger: int, workdir: Path) -> NativeRun:
    """:func:`run_native`, also returning the progress of every micro-batch."""
    from pyspark.sql import functions as F

    checkpoint = workdir / "spark-checkpoint-native"
    agg = (
        _stream(spark, data, files_per_trigger)
        .groupBy("user")
        .agg(F.count(F.lit(1)).alias("count"), F.sum("amount").alias("sum"))
    )
    writer = agg.writeStream.format("noop").outputMode("update").option("checkpointLocation", str(checkpoint))
    query = run_query_with_progress(writer)
    final = read_native_state(spark, checkpoint)
    return NativeRun(query.seconds, final, query.progress)


def read_native_state(spark: Any, checkpoint: Path) -> dict[int, tuple[int, int]]:
    rows = spark.read.format("statestore").load(str(checkpoint)).collect()
    out: dict[int, tuple[int, int]] = {}
    for row in rows:
        value = row["value"].asDict()
        out[int(row["key"]["user"])] = (int(value["count"]), int(value["sum"]))
    return out


def run_no_state(spark: Any, data: W1Data, files_per_trigger: int, workdir: Path) -> QueryRun:
    """The floor of a foreachBatch pipeline of W1's shape: a Spark job per micro-batch and no state.

    The job is the Redis variant's without Redis (repartition by user, mapInArrow with the Arrow
    pre-aggregation, collect), so it pays what any such pipeline pays before its first state call.
    """
    from bench.w1 import executor

    parts = int(spark.conf.get("spark.sql.shuffle.partitions"))

    def on_batch(df: Any, batch_id: int) -> None:
        df.repartition(parts, "user").mapInArrow(executor.preaggregate_only, "keys long").collect()

    writer = (
        _stream(spark, data, files_per_trigger)
        .writeStream.foreachBatch(on_batch)
        .option("checkpointLocation", str(workdir / "spark-checkpoint-no-state"))
    )
    return run_query_with_progress(writer)


def run_twsip(
    spark: Any, data: W1Data, files_per_trigger: int, workdir: Path
) -> tuple[float, dict[int, tuple[int, int]]]:
    """``transformWithStateInPandas`` with a ValueState per user; the output (one row per updated user) is collected."""
    from bench.w1 import executor

    final: dict[int, tuple[int, int]] = {}

    def collect(df: Any, batch_id: int) -> None:
        for row in df.collect():
            final[int(row["user"])] = (int(row["count"]), int(row["sum"]))

    out = (
        _stream(spark, data, files_per_trigger)
        .groupBy("user")
        .transformWithStateInPandas(
            statefulProcessor=executor.twsip_processor(),
            outputStructType="user long, count long, sum long",
            outputMode="Update",
            timeMode="None",
        )
    )
    writer = (
        out.writeStream.foreachBatch(collect)
        .outputMode("update")
        .option("checkpointLocation", str(workdir / "spark-checkpoint-twsip"))
    )
    return _run_query(writer), final


def run_redis(
    spark: Any, data: W1Data, files_per_trigger: int, port: int, workdir: Path
) -> tuple[float, dict[int, tuple[int, int]]]:
    """The same foreachBatch + mapInArrow pipeline doing MGET/MSET against redis-server.

    Rows are repartitioned by user first: two tasks updating one key would lose an update.
    """
    import numpy as np
    import redis

    from bench.w1 import executor

    parts = spark.conf.get("spark.sql.shuffle.partitions")
    update = executor.redis_update(port)

    def on_batch(df: Any, batch_id: int) -> None:
        df.repartition(int(parts), "user").mapInArrow(update, "keys long").collect()

    writer = (
        _stream(spark, data, files_per_trigger)
        .writeStream.foreachBatch(on_batch)
        .option("checkpointLocation", str(workdir / "spark-checkpoint-redis"))
    )
    seconds = _run_query(writer)
    client = redis.Redis(host="127.0.0.1", port=port)
    final: dict[int, tuple[int, int]] = {}
    for key in client.scan_iter(count=10_000):
        c, s = np.frombuffer(cast(bytes, client.get(key)), dtype=">i8").tolist()  # bytes: no decode_responses
        final[int.from_bytes(key, "big", signed=True)] = (c, s)
    client.close()
    return seconds, final
