"""Spark SQL's key groups, subtasks and partitioning agree with the Python implementation, key by key."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.keygroups import key_group, subtask_for_key_group
from keyedstate.common.serializers import get_serializer
from keyedstate.common.spark import (
    key_bytes_column,
    key_group_column,
    key_group_udf,
    partition_witnesses,
    repartition_by_key_group,
    spark_hash_int,
    subtask_column,
)
from keyedstate.common.spark._keygroups import _subtask_of_group

pytestmark = pytest.mark.spark

N_KEYS = 10_000
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

# ASCII, Latin-1, combining marks, CJK, astral-plane emoji, and NUL.
_ALPHABET = "aZ09 -_\x00\x7féßñ\u0301\u4e2d\u6587\U0001f600\U0001f9ea\u200d"


def _str_keys(rng: random.Random) -> list[str]:
    keys = ["", "\x00", "a", "é✓", "\U0001f600" * 3]
    while len(keys) < N_KEYS:
        keys.append("".join(rng.choice(_ALPHABET) for _ in range(rng.randint(0, 24))))
    return keys


def _int_keys(rng: random.Random) -> list[int]:
    keys = [INT64_MIN, INT64_MIN + 1, INT64_MAX, INT64_MAX - 1, 0, -1, 1, 255, -256, 1 << 32, -(1 << 32)]
    while len(keys) < N_KEYS:
        keys.append(rng.choice((rng.randint(INT64_MIN, INT64_MAX), rng.randint(-1000, 1000))))
    return keys


def _bytes_keys(rng: random.Random) -> list[bytes]:
    keys = [b"", b"\x00", b"\xff" * 9]
    while len(keys) < N_KEYS:
        keys.append(rng.randbytes(rng.randint(0, 32)))
    return keys


CASES = [
    pytest.param("str", "string", _str_keys, 128, 3, id="str"),
    pytest.param("int", "bigint", _int_keys, 4096, 7, id="int"),
    pytest.param("bytes", "binary", _bytes_keys, 37, 5, id="bytes"),
]


@pytest.mark.parametrize(("serializer_name", "sql_type", "make_keys", "max_parallelism", "parallelism"), CASES)
def test_spark_agrees_with_python_for_every_key(
    spark: SparkSession,
    serializer_name: str,
    sql_type: str,
    make_keys: Callable[[random.Random], list[Any]],
    max_parallelism: int,
    parallelism: int,
) -> None:
    serializer = get_serializer(serializer_name)
    keys = make_keys(random.Random(serializer_name))
    df = spark.createDataFrame(list(enumerate(keys)), f"id int, k {sql_type}").cache()

    rows = df.select(
        "id",
        key_bytes_column("k", serializer).alias("b"),
        key_group_column("k", max_parallelism, serializer).alias("g"),
        subtask_column("k", max_parallelism, parallelism, serializer).alias("s"),
    ).collect()

    def expected(key: Any) -> tuple[bytes, int, int]:
        key_bytes = serializer.dumps(key)
        group = key_group(key_bytes, max_parallelism)
        return key_bytes, group, subtask_for_key_group(max_parallelism, parallelism, group)

    assert len(rows) == len(keys)
    wrong = [(keys[r.id], r) for r in rows if (bytes(r.b), r.g, r.s) != expected(keys[r.id])]
    assert not wrong, f"{len(wrong)} keys disagree, e.g. {wrong[:3]}"

    partitioned = repartition_by_key_group(df, "k", max_parallelism, parallelism, serializer)
    assert partitioned.rdd.getNumPartitions() == parallelism
    placed = partitioned.select("id", F.spark_partition_id().alias("p")).collect()
    assert sorted(r.id for r in placed) == list(range(len(keys))), "rows were lost or duplicated"
    misplaced = [(keys[r.id], r.p) for r in placed if r.p != expected(keys[r.id])[2]]
    assert not misplaced, f"{len(misplaced)} rows in the wrong partition, e.g. {misplaced[:3]}"
    df.unpersist()


def test_subtask_formula_is_exact_for_every_key_group_at_the_largest_max_parallelism(spark: SparkSession) -> None:
    max_parallelism = 32768
    parallelisms = (1, 3, 7, 1000, 32767, 32768)
    groups = spark.range(max_parallelism).select(F.col("id").cast("int").alias("g"))
    rows = groups.select(
        "g", *[_subtask_of_group(F.col("g"), max_parallelism, p).alias(f"s{p}") for p in parallelisms]
    ).collect()
    wrong = [
        (row.g, p, row[f"s{p}"])
        for row in rows
        for p in parallelisms
        if row[f"s{p}"] != subtask_for_key_group(max_parallelism, p, row.g)
    ]
    assert len(rows) == max_parallelism and not wrong, wrong[:5]


def test_python_murmur3_equals_spark_hash(spark: SparkSession) -> None:
    rng = random.Random(7)
    values = [0, 1, -1, 2**31 - 1, -(2**31)] + [rng.randint(-(2**31), 2**31 - 1) for _ in range(2000)]
    rows = spark.createDataFrame([(v,) for v in values], "v int").select("v", F.hash("v").alias("h")).collect()
    assert [(r.v, r.h) for r in rows] == [(v, spark_hash_int(v)) for v in values]


def test_partition_witnesses_cover_every_partition_once() -> None:
    for n in (1, 2, 5, 64, 1000):
        witnesses = partition_witnesses(n)
        assert len(witnesses) == n
        assert [spark_hash_int(w) % n for w in witnesses] == list(range(n))


def test_repartition_with_more_subtasks_than_distinct_keys_leaves_partitions_empty(spark: SparkSession) -> None:
    df = spark.createDataFrame([("only",)] * 50, "k string")
    out = repartition_by_key_group(df, "k", 128, 4).select(F.spark_partition_id().alias("p")).collect()
    expected = subtask_for_key_group(128, 4, key_group(b"only", 128))
    assert [r.p for r in out] == [expected] * 50


def test_null_key_has_no_key_group(spark: SparkSession) -> None:
    df = spark.createDataFrame([("a",), (None,)], "k string")
    rows = df.select("k", key_group_column("k", 128).alias("g"), subtask_column("k", 128, 2).alias("s")).collect()
    assert {r.k: (r.g, r.s) for r in rows} == {
        "a": (key_group(b"a", 128), subtask_for_key_group(128, 2, key_group(b"a", 128))),
        None: (None, None),
    }


def test_repartition_fails_on_null_key_with_a_clear_error(spark: SparkSession) -> None:
    df = spark.createDataFrame([("a",), (None,)], "k string")
    with pytest.raises(PySparkException, match="null key.*filter nulls out"):
        repartition_by_key_group(df, "k", 128, 2).collect()


def test_column_of_the_wrong_type_fails_the_query_naming_the_cast(spark: SparkSession) -> None:
    df = spark.createDataFrame([(1,)], "k bigint")
    with pytest.raises(PySparkException, match="str key serializer needs a string key column, but it is bigint"):
        df.select(key_group_column("k", 128, "str")).collect()
    with pytest.raises(PySparkException, match="bytes key serializer needs a binary key column"):
        df.select(key_group_column("k", 128, "bytes")).collect()
    strings = spark.createDataFrame([("1",)], "k string")
    with pytest.raises(PySparkException, match="int key serializer needs a bigint key column, but it is string"):
        strings.select(key_group_column("k", 128, "int")).collect()


def test_narrow_integral_columns_serialize_like_python_ints(spark: SparkSession) -> None:
    df = spark.createDataFrame([(-128, -32768, -(2**31)), (127, 32767, 2**31 - 1)], "a tinyint, b smallint, c int")
    rows = df.select(*[key_group_column(c, 1000, "int").alias(c) for c in "abc"]).collect()
    int_ser = get_serializer("int")
    assert [tuple(r) for r in rows] == [
        tuple(key_group(int_ser.dumps(v), 1000) for v in (-128, -32768, -(2**31))),
        tuple(key_group(int_ser.dumps(v), 1000) for v in (127, 32767, 2**31 - 1)),
    ]


def test_repartition_rejects_a_mismatched_key_column_before_running(spark: SparkSession) -> None:
    df = spark.createDataFrame([(1,)], "k bigint")
    with pytest.raises(InvalidArgumentError, match=r"key column 'k' is bigint.*needs string.*cast"):
        repartition_by_key_group(df, "k", 128, 2, "str")


def test_serializers_spark_cannot_reproduce_point_to_the_udf(spark: SparkSession) -> None:
    for name in ("json", "pickle", "float"):
        with pytest.raises(InvalidArgumentError, match="key_group_udf"):
            key_group_column("k", 128, name)
    df = spark.createDataFrame([("a",)], "k string")
    with pytest.raises(InvalidArgumentError, match="key_group_udf"):
        repartition_by_key_group(df, "k", 128, 2, "json")


@pytest.mark.parametrize(("max_parallelism", "parallelism"), [(0, 1), (32769, 1), (128, 0), (128, 129)])
def test_invalid_parallelism_is_rejected(spark: SparkSession, max_parallelism: int, parallelism: int) -> None:
    df = spark.createDataFrame([("a",)], "k string")
    with pytest.raises(InvalidArgumentError, match="parallelism"):
        repartition_by_key_group(df, "k", max_parallelism, parallelism)
    with pytest.raises(InvalidArgumentError, match="parallelism"):
        subtask_column("k", max_parallelism, parallelism)


def test_udf_fallback_agrees_with_python_and_partitions(spark: SparkSession) -> None:
    json_ser = get_serializer("json")
    keys = [f"user-{i}" for i in range(500)] + [None]
    df = spark.createDataFrame([(i, k) for i, k in enumerate(keys)], "id int, k string")
    rows = df.select("id", key_group_udf(128, "json")("k").alias("g")).collect()
    assert {r.id: r.g for r in rows} == {
        i: (None if k is None else key_group(json_ser.dumps(k), 128)) for i, k in enumerate(keys)
    }
    placed = (
        repartition_by_key_group(df.where("k IS NOT NULL"), "k", 128, 3, "json", allow_udf=True)
        .select("id", F.spark_partition_id().alias("p"))
        .collect()
    )
    assert len(placed) == 500
    assert all(r.p == subtask_for_key_group(128, 3, key_group(json_ser.dumps(keys[r.id]), 128)) for r in placed)


def test_udf_reports_keys_the_serializer_rejects(spark: SparkSession) -> None:
    df = spark.createDataFrame([("not an int",)], "k string")
    with pytest.raises(PySparkException, match="int serializer needs an int"):
        df.select(key_group_udf(128, "int")("k")).collect()


def test_columns_have_default_names_and_accept_column_objects(spark: SparkSession) -> None:
    df = spark.createDataFrame([("a", -5)], "k string, i bigint")
    out = df.select(
        key_bytes_column(F.col("k"), "str"), key_group_column(df.k, 128), subtask_column(F.col("i"), 128, 2, "int")
    )
    assert out.columns == ["key_bytes", "key_group", "subtask"]
    int_group = key_group(get_serializer("int").dumps(-5), 128)
    first = out.first()
    assert first is not None
    assert tuple(first) == (bytearray(b"a"), key_group(b"a", 128), subtask_for_key_group(128, 2, int_group))
    placed = repartition_by_key_group(df, df.i, 128, 1, "int").select(F.spark_partition_id()).collect()
    assert [tuple(r) for r in placed] == [(0,)]


def test_package_imports_without_pyspark_and_says_how_to_get_it() -> None:
    # A fresh interpreter where `import pyspark` fails, as on an executor-side install without the extra.
    code = (
        "import sys\n"
        "sys.modules['pyspark'] = None\n"
        "import keyedstate.common.spark as ks\n"
        "try:\n"
        "    ks.key_group_column('k', 128)\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ConfigError") and "pip install 'keyedstate[spark]'" in out.stdout, out.stdout
