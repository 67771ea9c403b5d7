"""The shuffle-free mode's partial aggregation and the output channel's encoding, without Spark."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

from keyedstate.common.descriptors import (
    NumberType,
    OperatorSpec,
    ReduceField,
    ReduceFunction,
    StateDescriptor,
    StateKind,
)
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.spark import ROW_COUNT, BatchMode, ReduceInto
from keyedstate.common.spark._epochs import _decode_output, _encode_output

OPS = [
    OperatorSpec(
        "agg",
        2,
        (
            StateDescriptor(
                "stats",
                StateKind.REDUCING,
                reduce_fields=(
                    ReduceField("n"),
                    ReduceField("sum"),
                    ReduceField("lo", ReduceFunction.MIN),
                    ReduceField("hi", ReduceFunction.MAX, NumberType.FLOAT64),
                ),
            ),
            StateDescriptor("names", StateKind.LIST),
        ),
    )
]
FIELDS = {"n": ROW_COUNT, "sum": "amount", "lo": "amount", "hi": "score"}


def _batches(rows: list[dict[str, Any]], size: int) -> Iterator[pa.RecordBatch]:
    schema = pa.schema([("user", pa.string()), ("amount", pa.int64()), ("score", pa.float64())])
    for i in range(0, len(rows), size):
        yield pa.RecordBatch.from_pylist(rows[i : i + size], schema=schema)


def test_the_partial_aggregate_matches_a_plain_python_fold() -> None:
    rnd = random.Random(7)
    rows: list[dict[str, Any]] = [
        {"user": f"u{rnd.randrange(40)}", "amount": rnd.randint(-50, 50), "score": rnd.random()} for _ in range(3000)
    ]
    reduce = ReduceInto.checked(OPS, "agg", "stats", "user", FIELDS, "str")
    table = reduce.partial(_batches(rows, 257))
    assert table is not None
    got = {r["user"]: (r["n"], r["sum"], r["lo"], r["hi"]) for r in table.to_pylist()}
    expected: dict[str, tuple[int, int, int, float]] = {}
    for r in rows:
        n, s, lo, hi = expected.get(r["user"], (0, 0, 10**9, float("-inf")))
        expected[r["user"]] = (n + 1, s + r["amount"], min(lo, r["amount"]), max(hi, r["score"]))
    assert got == expected
    # The columns come out in the state's field order, after the key.
    assert table.column_names == ["user", "n", "sum", "lo", "hi"]


def test_an_empty_partition_aggregates_to_nothing() -> None:
    reduce = ReduceInto.checked(OPS, "agg", "stats", "user", FIELDS, "str")
    assert reduce.partial(iter([])) is None
    assert reduce.partial(_batches([], 10)) is None


def test_a_null_key_is_refused_by_name() -> None:
    reduce = ReduceInto.checked(OPS, "agg", "stats", "user", FIELDS, "str")
    rows = [{"user": None, "amount": 1, "score": 1.0}]
    with pytest.raises(InvalidArgumentError, match="'user' holds nulls"):
        reduce.partial(_batches(rows, 10))


@pytest.mark.parametrize(
    ("operator", "state", "fields", "message"),
    [
        ("nope", "stats", FIELDS, "no operator 'nope'"),
        ("agg", "names", FIELDS, "no reducing state 'names'"),
        ("agg", "stats", {"n": ROW_COUNT}, "every reduce field"),
        ("agg", "stats", {**FIELDS, "extra": "amount"}, "every reduce field"),
        ("agg", "stats", {**FIELDS, "lo": ROW_COUNT}, "only a SUM field can count rows"),
    ],
)
def test_reduce_fields_that_do_not_fit_the_state_are_refused(
    operator: str, state: str, fields: dict[str, str], message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        ReduceInto.checked(OPS, operator, state, "user", fields, "str")


def test_batch_modes_parse_by_name_and_refuse_others() -> None:
    assert BatchMode.parse("shuffle_free") is BatchMode.SHUFFLE_FREE
    assert BatchMode.parse(BatchMode.KEYED) is BatchMode.KEYED
    with pytest.raises(InvalidArgumentError, match="'keyed', 'shuffle_free'"):
        BatchMode.parse("shuffled")


SCHEMA = pa.schema([("user", pa.string()), ("sessions", pa.int64())])


def test_output_round_trips_in_partition_order_and_casts_to_the_schema() -> None:
    first = _encode_output(iter([pa.RecordBatch.from_pylist([{"user": "a", "sessions": 1}], schema=SCHEMA)]), SCHEMA)
    # A table with the columns in another order and a narrower type is cast to the schema.
    other = pa.table({"sessions": pa.array([2, 3], pa.int32()), "user": ["b", "c"]})
    second = _encode_output([other], SCHEMA)
    empty = _encode_output(None, SCHEMA)
    table = _decode_output([first, empty, second], SCHEMA)
    assert table.schema.equals(SCHEMA)
    assert table.to_pylist() == [
        {"user": "a", "sessions": 1},
        {"user": "b", "sessions": 2},
        {"user": "c", "sessions": 3},
    ]
    assert _decode_output([empty], SCHEMA).num_rows == 0


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (42, "must return an iterable"),
        (["not a batch"], "yielded a str"),
        ([pa.table({"user": ["a"]})], "do not fit output_schema"),
        ([pa.table({"user": ["a"], "sessions": ["many"]})], "do not fit output_schema"),
    ],
)
def test_output_that_does_not_fit_is_refused_with_the_reason(result: Any, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        _encode_output(result, SCHEMA)


def test_without_an_output_schema_a_generator_is_drained_and_must_yield_nothing() -> None:
    ran: list[int] = []

    def writes_then_returns() -> Iterator[Any]:
        ran.append(1)  # stands for state writes a generator process makes
        yield from ()

    assert _encode_output(writes_then_returns(), None) == b""
    assert ran == [1]
    with pytest.raises(InvalidArgumentError, match="no output_schema"):
        _encode_output(iter([pa.table({"x": [1]})]), None)
