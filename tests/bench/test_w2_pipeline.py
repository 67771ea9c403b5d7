"""The W2 benchmark's four variants on real PySpark (and, for ours, a real cluster): each equals the reference.

Small sizes: three micro-batches of two files, sessions spanning batches, disorder inside each.
The emitted (closed) sessions and the open sessions read back from each variant's state must
equal the plain-Python reference exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.w1.sparkjobs import ROCKSDB_PROVIDER
from bench.w2 import data as w2data
from bench.w2 import sparkjobs

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> w2data.W2Data:
    return w2data.generate(
        tmp_path_factory.mktemp("w2") / "in", events=3_000, users=120, batches=3, files_per_batch=2, seed=5
    )


@pytest.fixture
def w2_spark(spark: Any) -> Iterator[Any]:
    """The shared session's context with its own SQL conf: the RocksDB state store transformWithState needs,
    two shuffle partitions as the scenario runs (the shared session's configuration stays untouched)."""
    session = spark.newSession()
    session.conf.set("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
    session.conf.set("spark.sql.shuffle.partitions", "2")
    session.conf.set("spark.sql.execution.arrow.pyspark.enabled", "true")
    sparkjobs.ship_executor_code()
    yield session


def test_the_data_has_what_the_check_needs(small: w2data.W2Data) -> None:
    expected = small.expected
    assert small.batches == 3 and expected.closed and expected.open
    assert any(s[2] > 1 for s in expected.closed)


def test_ours_emits_and_keeps_exactly_the_reference_sessions(
    w2_spark: Any, inprocess_cluster: Any, tmp_path: Path, small: w2data.W2Data
) -> None:
    cluster = inprocess_cluster(taskmanagers=2, slots=1, backend="rocksdb")
    run = sparkjobs.run_ours(w2_spark, small, cluster.address, "w2-test", 2, tmp_path / "ours")
    assert run.open_read and [t.batch_id for t in run.timings] == [0, 1, 2]
    assert w2data.mismatches(small.expected, run.result) == (0, 0)


def test_sparks_stateful_processor_on_ours_emits_and_keeps_exactly_the_reference_sessions(
    w2_spark: Any, inprocess_cluster: Any, tmp_path: Path, small: w2data.W2Data
) -> None:
    cluster = inprocess_cluster(taskmanagers=2, slots=1, backend="rocksdb")
    run = sparkjobs.run_ours_tws(w2_spark, small, cluster.address, "w2-tws-test", 2, tmp_path / "ours-tws")
    assert run.open_read and [t.batch_id for t in run.timings] == [0, 1, 2]
    assert w2data.mismatches(small.expected, run.result) == (0, 0)


def test_apply_in_pandas_with_state_equals_the_reference(w2_spark: Any, tmp_path: Path, small: w2data.W2Data) -> None:
    run = sparkjobs.run_aipws(w2_spark, small, tmp_path / "aipws")
    assert run.open_read, "the state reader could not read applyInPandasWithState's state"
    assert w2data.mismatches(small.expected, run.result) == (0, 0)


def test_transform_with_state_in_pandas_equals_the_reference(
    w2_spark: Any, tmp_path: Path, small: w2data.W2Data
) -> None:
    run = sparkjobs.run_twsip(w2_spark, small, tmp_path / "twsip")
    assert run.open_read, "the state reader could not read transformWithStateInPandas's state"
    assert w2data.mismatches(small.expected, run.result) == (0, 0)


def test_a_session_emitted_twice_is_an_error() -> None:
    closed = sparkjobs.ClosedSessions()
    closed.add_rows([(1, 0, 2, 60)], batch_id=0)
    closed.add_rows([(1, 0, 2, 60)], batch_id=0)  # a re-delivered batch replaces its rows
    assert closed.sessions("x", {}).closed == {(1, 0, 2, 60)}
    closed.add_rows([(1, 0, 2, 60)], batch_id=1)
    with pytest.raises(RuntimeError, match="x: 1 sessions emitted more than once"):
        closed.sessions("x", {})
