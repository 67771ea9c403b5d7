"""The shuffle-free foreach_batch mode and the output channel, exactly once through real PySpark.

The keyed mode's exactly-once tests are in ``test_spark_epochs.py`` and ``tests/integration/exactly_once``
(which runs its failure tests in both modes). Here: what only the shuffle-free mode does (one key's
rows reach several tasks, more tasks than subtasks, ``reduce_batch``), and the output sink in both modes.
"""

from __future__ import annotations

import random
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession

from keyedstate.common.client import ListState, ReducingState
from keyedstate.common.descriptors import OperatorSpec, ReduceField, ReduceFunction, StateDescriptor, StateKind
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.spark import KeyedStateRuntime
from tests.fixtures.cluster import InProcessCluster
from tests.fixtures.tiers import exhaustive

pytestmark = pytest.mark.spark

from pyspark import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

PARALLELISM = 2
INPUT_PARTITIONS = 5
OPS = [
    OperatorSpec(
        "agg",
        PARALLELISM,
        (
            StateDescriptor("amounts", StateKind.LIST),
            StateDescriptor("seen_by", StateKind.LIST),
            StateDescriptor(
                "total",
                StateKind.REDUCING,
                reduce_fields=(ReduceField("n"), ReduceField("sum"), ReduceField("top", ReduceFunction.MAX)),
            ),
        ),
    )
]


def _events(seed: int, n: int, users: int = 200) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    return [{"user": f"u{rnd.randrange(users)}", "amount": rnd.randint(1, 1000)} for _ in range(n)]


def commutative_process_failing_first_attempts(batches: Any, state: Any) -> None:
    """Appends and reduces only (they commute across tasks); the first attempt of every even task dies after writing."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    assert ctx is not None
    per_user: dict[str, list[int]] = defaultdict(list)
    for batch in batches:
        for row in batch.to_pylist():
            per_user[row["user"]].append(row["amount"])
    if per_user:
        users = sorted(per_user)
        pairs = [(u, a) for u in users for a in per_user[u]]
        state.list("amounts", value_serializer="int").append_many([u for u, _ in pairs], [a for _, a in pairs])
        state.list("seen_by", value_serializer="int").append_many(users, [ctx.partitionId()] * len(users))
        state.reducing("total").add_many(users, [(len(per_user[u]), sum(per_user[u]), max(per_user[u])) for u in users])
    if ctx.attemptNumber() == 0 and ctx.partitionId() % 2 == 0:
        raise RuntimeError("injected task failure after writing state")


def _expected(events: list[dict[str, Any]]) -> dict[str, list[int]]:
    expected: dict[str, list[int]] = defaultdict(list)
    for e in events:
        expected[e["user"]].append(e["amount"])
    return expected


def _verify_totals(runtime: KeyedStateRuntime, events: list[dict[str, Any]]) -> None:
    expected = _expected(events)
    users = sorted(expected)
    totals = ReducingState[str](runtime.client, runtime.job_id, "agg", "total").get_many(users)
    assert totals == [(len(expected[u]), sum(expected[u]), max(expected[u])) for u in users]


def _frames(spark: SparkSession, batches: list[list[dict[str, Any]]]) -> list[Any]:
    # Round-robin partitions: every key's rows spread over the input partitions, as an unkeyed source gives them.
    return [spark.createDataFrame(b, "user string, amount int").repartition(INPUT_PARTITIONS) for b in batches]


@pytest.mark.parametrize(
    "backend",
    [
        "rocksdb",
        # The same failed attempts on the other backend: the epoch staging and apply are the slots', run on
        # each backend by tests/integration/epochs and tests/contract; test_spark_epochs keeps hashmap retries.
        exhaustive(
            "hashmap", covered_by="test_shuffle_free_failed_attempts_and_a_rerun_batch_apply_exactly_once[rocksdb]"
        ),
    ],
)
def test_shuffle_free_failed_attempts_and_a_rerun_batch_apply_exactly_once(
    spark: SparkSession, inprocess_cluster: Callable[..., InProcessCluster], backend: str
) -> None:
    cluster = inprocess_cluster(taskmanagers=2, slots=1, backend=backend)
    runtime = KeyedStateRuntime(cluster.address, f"free-{backend}", OPS)
    on_batch = runtime.foreach_batch(commutative_process_failing_first_attempts, operator="agg", mode="shuffle_free")
    batches = [_events(seed, 2000) for seed in range(3)]
    frames = _frames(spark, batches)
    for batch_id, df in enumerate(frames):
        on_batch(df, batch_id)
    assert runtime.committed_epoch() == 2
    on_batch(frames[1], 1)  # a replayed batch: the state holds it already
    assert runtime.batches_skipped == 1
    events = [e for b in batches for e in b]
    expected = _expected(events)
    users = sorted(expected)
    lists = ListState[str, int](runtime.client, runtime.job_id, "agg", "amounts", value_serializer="int").get_many(
        users
    )
    assert [sorted(x) for x in lists] == [sorted(expected[u]) for u in users]
    _verify_totals(runtime, events)
    # No shuffle happened: tasks numbered past the parallelism wrote, and one key's rows reached several tasks.
    seen = ListState[str, int](runtime.client, runtime.job_id, "agg", "seen_by", value_serializer="int").get_many(users)
    tasks = {p for s in seen for p in s}
    assert tasks == set(range(INPUT_PARTITIONS))
    assert max(len(set(s)) for s in seen) > 1
    # A winning task appends a key's partition once per batch: at most once per batch and partition.
    assert max(Counter(s).most_common(1)[0][1] for s in seen) <= len(batches)


def test_reduce_batch_folds_partial_aggregates_exactly_once(
    spark: SparkSession, inprocess_cluster: Callable[..., InProcessCluster]
) -> None:
    cluster = inprocess_cluster(taskmanagers=2, slots=1, backend="rocksdb")
    runtime = KeyedStateRuntime(cluster.address, "reduce-batch", OPS)
    on_batch = runtime.reduce_batch(
        "total", key_col="user", fields={"n": "*", "sum": "amount", "top": "amount"}, operator="agg"
    )
    batches = [_events(50 + seed, 3000) for seed in range(3)]
    for batch_id, df in enumerate(_frames(spark, batches)):
        on_batch(df, batch_id)
    on_batch(_frames(spark, batches[2:])[0], 2)  # replayed: not applied again
    assert runtime.batches_run == 3 and runtime.batches_skipped == 1
    _verify_totals(runtime, [e for b in batches for e in b])
    assert runtime.last_checkpoint is not None and runtime.last_checkpoint.epoch == 2


OUTPUT = pa.schema([("batch", pa.int64()), ("user", pa.string()), ("events", pa.int64())])


def counting_process(batches: Iterator[Any], state: Any) -> Iterator[pa.RecordBatch]:
    """Emits (batch, user, events in this task) per user, then fails the first attempt of even tasks."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    assert ctx is not None
    counts: dict[str, int] = defaultdict(int)
    for batch in batches:
        for user in batch.column("user").to_pylist():
            counts[user] += 1
    users = sorted(counts)
    if users:
        state.reducing("total").add_many(users, [(counts[u], 0, 0) for u in users])
    yield pa.RecordBatch.from_pydict(
        {"batch": [state.batch_id] * len(users), "user": users, "events": [counts[u] for u in users]}, schema=OUTPUT
    )
    if ctx.attemptNumber() == 0 and ctx.partitionId() % 2 == 0:
        raise RuntimeError("injected task failure after emitting")


@pytest.mark.parametrize("mode", ["keyed", "shuffle_free"])
def test_the_sink_gets_exactly_the_winning_attempts_output(
    spark: SparkSession, inprocess_cluster: Callable[..., InProcessCluster], mode: str
) -> None:
    cluster = inprocess_cluster(taskmanagers=2, slots=1, backend="rocksdb")
    runtime = KeyedStateRuntime(cluster.address, f"sink-{mode}", OPS)
    received: list[tuple[int, pa.Table]] = []
    on_batch = runtime.foreach_batch(
        counting_process,
        key_col="user",
        operator="agg",
        mode=mode,
        output_schema=OUTPUT,
        sink=lambda table, batch_id: received.append((batch_id, table)),
    )
    batches = [_events(80 + seed, 1500) for seed in range(2)]
    frames = _frames(spark, batches)
    for batch_id, df in enumerate(frames):
        on_batch(df, batch_id)
    on_batch(frames[1], 1)  # already committed: no run, so no second output
    assert [b for b, _ in received] == [0, 1]
    for batch_id, table in received:
        assert table.schema.equals(OUTPUT)
        per_user: dict[str, int] = defaultdict(int)
        for row in table.to_pylist():
            assert row["batch"] == batch_id
            per_user[row["user"]] += row["events"]
        # Failed attempts emitted too, but only the winners' rows arrive: every event counted once.
        assert dict(per_user) == {u: len(a) for u, a in _expected(batches[batch_id]).items()}
    if mode == "keyed":  # one task per key: one row per user
        assert all(len(set(t.column("user").to_pylist())) == t.num_rows for _, t in received)
    _verify_totals_counts(runtime, [e for b in batches for e in b])
    assert runtime.timings[-1].sink_s >= 0.0


def _verify_totals_counts(runtime: KeyedStateRuntime, events: list[dict[str, Any]]) -> None:
    expected = _expected(events)
    users = sorted(expected)
    totals = ReducingState[str](runtime.client, runtime.job_id, "agg", "total").get_many(users)
    assert [t[0] if t is not None else None for t in totals] == [len(expected[u]) for u in users]


def wrong_output(batches: Iterator[Any], state: Any) -> Iterator[pa.Table]:
    for _ in batches:
        pass
    yield pa.table({"user": ["x"], "events": ["not a number"]})


def test_output_that_does_not_fit_the_schema_fails_the_batch_and_commits_nothing(
    spark: SparkSession, inprocess_cluster: Callable[..., InProcessCluster]
) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=2, backend="hashmap")
    runtime = KeyedStateRuntime(cluster.address, "bad-output", OPS)
    received: list[int] = []
    on_batch = runtime.foreach_batch(
        wrong_output, key_col="user", operator="agg", output_schema=OUTPUT, sink=lambda t, b: received.append(b)
    )
    with pytest.raises(Exception, match="do not fit output_schema"):
        on_batch(_frames(spark, [_events(1, 100)])[0], 0)
    assert received == []
    assert runtime.committed_epoch() == -1


def test_bad_mode_arguments_are_refused_on_the_driver(inprocess_cluster: Callable[..., InProcessCluster]) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=2, backend="hashmap")
    runtime = KeyedStateRuntime(cluster.address, "bad-args", OPS)
    with pytest.raises(InvalidArgumentError, match="needs key_col"):
        runtime.foreach_batch(commutative_process_failing_first_attempts, operator="agg")
    with pytest.raises(InvalidArgumentError, match="not one of"):
        runtime.foreach_batch(commutative_process_failing_first_attempts, key_col="user", mode="partial")
    with pytest.raises(InvalidArgumentError, match="go together"):
        runtime.foreach_batch(counting_process, key_col="user", output_schema=OUTPUT)
    with pytest.raises(InvalidArgumentError, match="pyarrow.Schema"):
        runtime.foreach_batch(counting_process, key_col="user", output_schema="user string", sink=print)
    with pytest.raises(InvalidArgumentError, match="every reduce field"):
        runtime.reduce_batch("total", key_col="user", fields={"n": "*"}, operator="agg")
