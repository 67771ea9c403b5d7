"""The streaming variants of W2, each a Structured Streaming query over the same Parquet directory.

The session and the query plumbing are W1's (:mod:`bench.w1.sparkjobs`: the session settings,
``availableNow`` runs with their progress); what differs is the logic and how each variant's
emitted sessions and final state are collected. The closed sessions a variant emits are
collected on the driver per micro-batch (inside the timed run, for every variant alike); the
open sessions are read from each variant's state afterwards, untimed.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.w1.sparkjobs import BatchProgress, QueryRun, run_query_with_progress
from bench.w2 import executor
from bench.w2.data import SCHEMA_DDL, Session, Sessions, W2Data

logger = logging.getLogger(__name__)


def ship_executor_code() -> None:
    """Executors cannot import the bench package: ship :mod:`bench.w2.executor` by value (as W1 does its own)."""
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(executor)


def _stream(spark: Any, data: W2Data, event_time: bool = False) -> Any:
    """The events; ``event_time``: with an ``event_time`` column (from ``ts``) under a zero-delay watermark."""
    stream = (
        spark.readStream.schema(SCHEMA_DDL)
        .option("maxFilesPerTrigger", data.files_per_batch)
        .parquet(str(data.directory))
    )
    if event_time:
        from pyspark.sql import functions as F

        stream = stream.withColumn("event_time", F.timestamp_seconds("ts")).withWatermark("event_time", "0 seconds")
    return stream


class ClosedSessions:
    """The closed sessions a variant emitted, gathered per micro-batch (a re-delivered batch replaces its rows)."""

    def __init__(self) -> None:
        self.by_batch: dict[int, list[Session]] = {}

    def add_rows(self, rows: Iterable[Any], batch_id: int) -> None:
        self.by_batch[batch_id] = [(int(r[0]), int(r[1]), int(r[2]), int(r[3])) for r in rows]

    def add_table(self, table: Any, batch_id: int) -> None:
        cols = [table.column(c).to_pylist() for c in ("user", "start", "count", "duration")]
        self.by_batch[batch_id] = list(zip(*cols))

    def sessions(self, who: str, still_open: dict[int, tuple[int, tuple[int, ...]]]) -> Sessions:
        """The emitted set and ``still_open``; RuntimeError if any session was emitted twice."""
        every = [s for rows in self.by_batch.values() for s in rows]
        twice = [s for s, n in Counter(every).items() if n > 1]
        if twice:
            raise RuntimeError(f"{who}: {len(twice)} sessions emitted more than once, e.g. {twice[0]}")
        return Sessions(frozenset(every), still_open)


@dataclass
class W2Run:
    seconds: float
    result: Sessions
    progress: list[BatchProgress] = field(default_factory=list)
    timings: list[Any] = field(default_factory=list)  # ours: keyedstate.common.spark.BatchTiming per micro-batch
    open_read: bool = True  # False when the variant's final state could not be read back


# -- ours --------------------------------------------------------------------------------------
def operators(parallelism: int) -> list[Any]:
    from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind

    return [
        OperatorSpec(
            executor.OPERATOR,
            parallelism,
            (StateDescriptor(executor.SESSION, StateKind.VALUE), StateDescriptor(executor.TIMES, StateKind.LIST)),
        )
    ]


def run_ours(spark: Any, data: W2Data, jobmanager: str, job_id: str, parallelism: int, workdir: Path) -> W2Run:
    """foreachBatch in the keyed mode through KeyedStateRuntime: epoch commit and a checkpoint per micro-batch."""
    from keyedstate.common.spark import KeyedStateRuntime

    closed = ClosedSessions()
    runtime = KeyedStateRuntime(jobmanager, job_id, operators(parallelism))
    try:
        on_batch = runtime.foreach_batch(
            executor.ours_process,
            key_col="user",
            operator=executor.OPERATOR,
            key_serializer="int",
            mode="keyed",  # all of a user's events in one task, sorted there: sessions need them in order
            output_schema=executor.closed_schema(),
            sink=closed.add_table,
        )
        writer = (
            _stream(spark, data)
            .writeStream.foreachBatch(on_batch)
            .option("checkpointLocation", str(workdir / "spark-checkpoint-ours"))
        )
        query = run_query_with_progress(writer)
        result = closed.sessions("W2 ours", read_state(runtime, data.users))
        return W2Run(query.seconds, result, query.progress, list(runtime.timings))
    finally:
        try:
            runtime.client.cancel_job(job_id)  # frees the slots for the next run
        finally:
            runtime.close()


def open_session(who: str, user: int, session: Any, times: list[int]) -> tuple[int, tuple[int, ...]]:
    """(start, times) of a user's open session; RuntimeError when its value and its list disagree."""
    value = tuple(int(x) for x in session) if session is not None else None
    if not times or value != (times[0], times[-1], len(times)):
        raise RuntimeError(
            f"{who}: user {user}'s session value (start, last, count) = {value} does not match "
            f"its list of {len(times)} times {times[:3]}...{times[-1:]}"
        )
    return times[0], tuple(times)


def read_state(runtime: Any, users: int) -> dict[int, tuple[int, tuple[int, ...]]]:
    """Every user's open session (start, times), read back through the client (untimed)."""
    # With overlapped commits the last batch may still be applying when the query returns.
    runtime.client.wait_for_applied(runtime.job_id)
    from keyedstate.common.client import ListState, ValueState

    sessions: ValueState[int, Any] = ValueState(
        runtime.client, runtime.job_id, executor.OPERATOR, executor.SESSION, key_serializer="int"
    )
    times: ListState[int, int] = ListState(
        runtime.client, runtime.job_id, executor.OPERATOR, executor.TIMES, key_serializer="int", value_serializer="int"
    )
    out: dict[int, tuple[int, tuple[int, ...]]] = {}
    step = 10_000
    for first in range(0, users, step):
        keys = list(range(first, min(users, first + step)))
        for u, s, t in zip(keys, sessions.get_many(keys), times.get_many(keys)):
            if s is not None or t:
                out[u] = open_session("W2 ours", u, s, [int(x) for x in t])
    return out


# -- ours, running Spark's StatefulProcessor unchanged ------------------------------------------
def run_ours_tws(
    spark: Any, data: W2Data, jobmanager: str, job_id: str, parallelism: int, workdir: Path, timers: bool = False
) -> W2Run:
    """tWSiP's StatefulProcessor class, unchanged, on this runtime (``processor_batch``): epochs and checkpoints as ours.

    ``timers``: the EventTime processor that also closes sessions by timer (:func:`executor.twsip_timer_processor`).
    """
    from keyedstate.common.spark import KeyedStateRuntime, processor_operator

    closed = ClosedSessions()
    mode = "EventTime" if timers else "None"
    make = executor.twsip_timer_processor if timers else executor.twsip_processor
    operator = processor_operator(make(), executor.OPERATOR, parallelism, time_mode=mode)
    runtime = KeyedStateRuntime(jobmanager, job_id, [operator])
    try:
        stream = _stream(spark, data, event_time=timers)
        writer = runtime.transform_with_state_in_pandas(
            stream,
            make(),
            key_col="user",
            output_schema=executor.CLOSED_DDL,
            sink=closed.add_table,
            sink_format="arrow",  # as ours: the emitted rows are gathered on the driver without a Spark job
            operator=executor.OPERATOR,
            time_mode=mode,
        ).option("checkpointLocation", str(workdir / "spark-checkpoint-ours-tws"))
        query = run_query_with_progress(writer)
        result = closed.sessions("W2 ours-tWS", read_tws_state(runtime, data.users))
        return W2Run(query.seconds, result, query.progress, list(runtime.timings))
    finally:
        try:
            runtime.client.cancel_job(job_id)  # frees the slots for the next run
        finally:
            runtime.close()


def read_tws_state(runtime: Any, users: int) -> dict[int, tuple[int, tuple[int, ...]]]:
    """Every user's open session as the StatefulProcessor left it: a (start, last, count) value and a list of (ts,) rows."""
    # With overlapped commits the last batch may still be applying when the query returns.
    runtime.client.wait_for_applied(runtime.job_id)
    from keyedstate.common.client import ListState, ValueState

    sessions: ValueState[int, Any] = ValueState(
        runtime.client, runtime.job_id, executor.OPERATOR, executor.SESSION, key_serializer="int"
    )
    times: ListState[int, Any] = ListState(
        runtime.client, runtime.job_id, executor.OPERATOR, executor.TIMES, key_serializer="int"
    )
    out: dict[int, tuple[int, tuple[int, ...]]] = {}
    step = 10_000
    for first in range(0, users, step):
        keys = list(range(first, min(users, first + step)))
        for u, s, t in zip(keys, sessions.get_many(keys), times.get_many(keys)):
            if s is not None or t:
                out[u] = open_session("W2 ours-tWS", u, s, [int(row[0]) for row in t])
    return out


# -- applyInPandasWithState --------------------------------------------------------------------
def run_aipws(spark: Any, data: W2Data, workdir: Path) -> W2Run:
    """``applyInPandasWithState`` (append mode, no timeout): a GroupState (start, times) per user."""
    from pyspark.sql.streaming.state import GroupStateTimeout

    closed = ClosedSessions()
    checkpoint = workdir / "spark-checkpoint-aipws"
    out = (
        _stream(spark, data)
        .groupBy("user")
        .applyInPandasWithState(
            executor.aipws_sessionize,
            executor.CLOSED_DDL,
            executor.AIPWS_STATE_DDL,
            "append",
            GroupStateTimeout.NoTimeout,
        )
    )
    query = _collected(out, closed, checkpoint)
    still_open, read = _read_spark_state(spark, checkpoint, "W2 applyInPandasWithState", _aipws_open)
    return W2Run(
        query.seconds, closed.sessions("W2 applyInPandasWithState", still_open), query.progress, open_read=read
    )


def _aipws_open(spark: Any, checkpoint: Path) -> dict[int, tuple[int, tuple[int, ...]]]:
    rows = spark.read.format("statestore").load(str(checkpoint)).collect()
    out: dict[int, tuple[int, tuple[int, ...]]] = {}
    for row in rows:
        value = row["value"].asDict(recursive=True)
        state = value.get("groupState", value)  # the state struct, wrapped or not depending on the format version
        user = int(row["key"]["user"])
        session = (state["start"], state["last"], state["count"])
        out[user] = open_session(
            "W2 applyInPandasWithState", user, session, executor.unpack_times(bytes(state["times"]))
        )
    return out


# -- transformWithStateInPandas ----------------------------------------------------------------
def run_twsip(spark: Any, data: W2Data, workdir: Path, timers: bool = False) -> W2Run:
    """``transformWithStateInPandas`` with a ListState of times and a ValueState with the start (append mode).

    ``timers``: the EventTime processor that also closes sessions by timer.
    """
    closed = ClosedSessions()
    checkpoint = workdir / "spark-checkpoint-twsip"
    out = (
        _stream(spark, data, event_time=timers)
        .groupBy("user")
        .transformWithStateInPandas(
            statefulProcessor=executor.twsip_timer_processor() if timers else executor.twsip_processor(),
            outputStructType=executor.CLOSED_DDL,
            outputMode="Append",
            timeMode="EventTime" if timers else "None",
        )
    )
    query = _collected(out, closed, checkpoint)
    still_open, read = _read_spark_state(spark, checkpoint, "W2 transformWithStateInPandas", _twsip_open)
    return W2Run(
        query.seconds, closed.sessions("W2 transformWithStateInPandas", still_open), query.progress, open_read=read
    )


def _twsip_open(spark: Any, checkpoint: Path) -> dict[int, tuple[int, tuple[int, ...]]]:
    def load(name: str) -> list[Any]:
        return list(spark.read.format("statestore").option("stateVarName", name).load(str(checkpoint)).collect())

    sessions = {int(r["key"]["user"]): r["value"] for r in load(executor.SESSION)}
    times: dict[int, list[int]] = {}
    for r in load(executor.TIMES):
        times.setdefault(int(r["key"]["user"]), []).append(int(r["list_element"]["ts"]))
    users = set(sessions) | set(times)
    # The reader gives a list's elements in no promised order: sorted, they are the session's times.
    return {
        u: open_session("W2 transformWithStateInPandas", u, sessions.get(u), sorted(times.get(u, []))) for u in users
    }


# -- shared -----------------------------------------------------------------------------------
def _collected(out: Any, closed: ClosedSessions, checkpoint: Path) -> QueryRun:
    def collect(df: Any, batch_id: int) -> None:
        closed.add_rows(df.collect(), batch_id)

    writer = out.writeStream.foreachBatch(collect).outputMode("append").option("checkpointLocation", str(checkpoint))
    return run_query_with_progress(writer)


def _read_spark_state(
    spark: Any, checkpoint: Path, who: str, read: Any
) -> tuple[dict[int, tuple[int, tuple[int, ...]]], bool]:
    """The variant's open sessions from its state store (untimed); ({}, False) when this Spark cannot read them."""
    try:
        return read(spark, checkpoint), True
    except Exception as exc:  # the state reader's support differs per Spark version and operator
        logger.warning("%s: the state reader could not read the final state: %s", who, str(exc).splitlines()[0])
        return {}, False
