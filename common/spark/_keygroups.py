"""Key groups as Spark SQL expressions, bit-for-bit equal to :mod:`keyedstate.common.keygroups`.

A DataFrame can then be partitioned natively (no Python UDF, no Row conversion) so that Spark
partition ``i`` holds exactly the keys of subtask ``i``.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from keyedstate.common.errors import ConfigError, InvalidArgumentError
from keyedstate.common.keygroups import check_parallelism, key_group
from keyedstate.common.serializers import (
    BytesSerializer,
    IntSerializer,
    Serializer,
    StrSerializer,
    get_serializer,
)

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

logger = logging.getLogger(__name__)

# Serializer name -> (SQL types it accepts, as typeof() prints them, and what the user should cast to).
_SQL_TYPES: dict[str, tuple[tuple[str, ...], str]] = {
    StrSerializer.name: (("string",), "string"),
    IntSerializer.name: (("tinyint", "smallint", "int", "bigint"), "bigint"),
    BytesSerializer.name: (("binary",), "binary"),
}


def _functions() -> Any:
    # Imported on first use: the executor client and the TaskManager never need pyspark.
    try:
        from pyspark.sql import functions
    except ImportError:
        raise ConfigError(
            "keyedstate.common.spark needs pyspark: pip install 'keyedstate[spark]' (or pyspark>=4.0)"
        ) from None
    return functions


def _column(col: Column | str) -> Column:
    return _functions().col(col) if isinstance(col, str) else col


_NATIVE: tuple[type[Serializer[Any]], ...] = (StrSerializer, IntSerializer, BytesSerializer)


def _native(key_serializer: str | Serializer[Any]) -> Serializer[Any]:
    serializer = get_serializer(key_serializer)
    if type(serializer) not in _NATIVE:
        raise InvalidArgumentError(
            f"Spark SQL cannot reproduce the bytes of the {serializer.name!r} serializer; only str, int "
            "and bytes keys can be partitioned natively. Use key_group_udf(max_parallelism, serializer), "
            "a Python UDF (slower; ship_package() makes keyedstate importable on executors), or key by a "
            "str/int/bytes column"
        )
    return serializer


def key_bytes_column(col: Column | str, key_serializer: str | Serializer[Any]) -> Column:
    """An expression (named ``key_bytes``) producing exactly ``key_serializer.dumps(key)`` for each key.

    Supported: ``str`` (UTF-8, string columns), ``int`` (8-byte big-endian, integral columns)
    and ``bytes`` (binary columns). A column of another SQL type fails when the query runs, with a
    message naming the cast to add (types Spark cannot cast at all fail at analysis with
    Spark's own message); null keys give null.
    """
    F = _functions()
    serializer = _native(key_serializer)
    c = _column(col)
    # Every branch below must also pass analysis for a column of the wrong type (ANSI mode rejects
    # e.g. CAST(bigint AS BINARY) before the guard can run), hence the extra casts; for the right
    # type they are no-ops.
    if isinstance(serializer, StrSerializer):
        key_bytes = c.cast("string").cast("binary")
        accepted = F.typeof(c).startswith("string")  # also collated strings
    else:
        types, _ = _SQL_TYPES[serializer.name]
        if isinstance(serializer, IntSerializer):
            # hex() of a negative bigint is its 16-digit two's complement; positives get zero-padded.
            key_bytes = F.unhex(F.lpad(F.hex(c.cast("bigint")), 16, "0"))
        else:
            key_bytes = c
        accepted = F.typeof(c).isin(*types)
    _, cast_to = _SQL_TYPES[serializer.name]
    message = F.concat(
        F.lit(f"keyedstate: the {serializer.name} key serializer needs a {cast_to} key column, but it is "),
        F.typeof(c),
        F.lit(f": cast the key column to {cast_to} or choose the key serializer that matches its type"),
    )
    # typeof() is constant per column, so the optimizer reduces this to key_bytes (or to the error).
    checked: Column = F.when(accepted, key_bytes).otherwise(F.raise_error(message)).alias("key_bytes")
    return checked


def key_group_column(col: Column | str, max_parallelism: int, key_serializer: str | Serializer[Any] = "str") -> Column:
    """``pmod(xxhash64(key_bytes) & 0xFFFFFFFF, max_parallelism)`` named ``key_group`` (int; null for a null key).

    Equal to ``keyedstate.common.keygroups.key_group(serializer.dumps(key), max_parallelism)``.
    """
    F = _functions()
    check_parallelism(1, max_parallelism)
    key_bytes = key_bytes_column(col, key_serializer)
    # bitwiseAND, not `&`, which is boolean AND on PySpark columns. xxhash64 uses seed 42, as keygroups does.
    hash32 = F.xxhash64(key_bytes).bitwiseAND(F.lit(0xFFFFFFFF))
    group = F.pmod(hash32, F.lit(max_parallelism)).cast("int")
    # xxhash64 skips nulls (it would return the seed), so a null key is mapped to null explicitly.
    named: Column = F.when(key_bytes.isNull(), F.lit(None).cast("int")).otherwise(group).alias("key_group")
    return named


def _subtask_of_group(group: Column, max_parallelism: int, parallelism: int) -> Column:
    F = _functions()
    # group * parallelism < 2**30 and the quotient is exact enough in a double that floor() equals
    # integer division for every group (the fractional part is at least 1/max_parallelism).
    subtask: Column = F.floor(group * F.lit(parallelism) / F.lit(max_parallelism)).cast("int")
    return subtask


def subtask_column(
    col: Column | str, max_parallelism: int, parallelism: int, key_serializer: str | Serializer[Any] = "str"
) -> Column:
    """``floor(key_group * parallelism / max_parallelism)`` named ``subtask``: the key's subtask.

    Null for a null key.
    """
    check_parallelism(parallelism, max_parallelism)
    group = key_group_column(col, max_parallelism, key_serializer)
    return _subtask_of_group(group, max_parallelism, parallelism).alias("subtask")


class _KeyGroupOf:
    """The Python key-group function a UDF runs; a module-level class so it pickles by reference."""

    def __init__(self, max_parallelism: int, serializer: Serializer[Any]) -> None:
        self.max_parallelism = max_parallelism
        self.serializer = serializer

    def __call__(self, key: Any) -> int | None:
        if key is None:
            return None
        return key_group(self.serializer.dumps(key), self.max_parallelism)


def key_group_udf(max_parallelism: int, key_serializer: str | Serializer[Any]) -> Any:
    """A Python UDF computing the key group with any serializer (``udf(col)`` gives an int column).

    The fallback for serializers Spark SQL cannot reproduce (json, pickle, custom ones). It sees
    the values PySpark hands to UDFs (structs arrive as ``Row``), so the client must serialize
    the same Python values. Executors need keyedstate importable: see :func:`ship_package`.
    """
    F = _functions()
    check_parallelism(1, max_parallelism)
    # useArrow fixed: PySpark would otherwise guess a pandas/Arrow UDF kind from type hints.
    return F.udf(_KeyGroupOf(max_parallelism, get_serializer(key_serializer)), "int", useArrow=False)


def spark_hash_int(value: int, seed: int = 42) -> int:
    """Spark's ``hash()`` of an int: Murmur3_x86_32 ``hashInt``, what ``HashPartitioning`` uses."""
    mask = 0xFFFFFFFF

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & mask

    k1 = (value & mask) * 0xCC9E2D51 & mask
    k1 = rotl(k1, 15) * 0x1B873593 & mask
    h1 = seed & mask ^ k1
    h1 = (rotl(h1, 13) * 5 + 0xE6546B64) & mask
    h1 ^= 4
    h1 ^= h1 >> 16
    h1 = h1 * 0x85EBCA6B & mask
    h1 ^= h1 >> 13
    h1 = h1 * 0xC2B2AE35 & mask
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 & 0x80000000 else h1


@functools.lru_cache(maxsize=64)
def partition_witnesses(num_partitions: int) -> tuple[int, ...]:
    """``w[i]`` is the smallest int that Spark's hash partitioning into ``num_partitions`` sends to partition ``i``."""
    witnesses: list[int | None] = [None] * num_partitions
    missing = num_partitions
    candidate = 0
    while missing:
        slot = spark_hash_int(candidate) % num_partitions  # Python's % is pmod for a positive divisor
        if witnesses[slot] is None:
            witnesses[slot] = candidate
            missing -= 1
        candidate += 1
    return tuple(w for w in witnesses if w is not None)


def repartition_by_key_group(
    df: DataFrame,
    key_col: Column | str,
    max_parallelism: int,
    parallelism: int,
    key_serializer: str | Serializer[Any] = "str",
    *,
    allow_udf: bool = False,
) -> DataFrame:
    """Repartition ``df`` into ``parallelism`` partitions where partition ``i`` holds exactly the keys of subtask ``i``.

    Spark's ``repartition(n, col)`` places a row by ``pmod(murmur3(col), n)``, not by the value
    of ``col``, so the subtask index is first mapped to a "witness" int that Spark's hash sends
    to partition ``subtask`` (:func:`partition_witnesses`). The shuffle stays in the JVM. With
    ``allow_udf=True`` keys of serializers Spark SQL cannot reproduce go through
    :func:`key_group_udf`. A null key fails the query: keyed state needs a key.
    """
    F = _functions()
    check_parallelism(parallelism, max_parallelism)
    serializer = get_serializer(key_serializer)
    key = _column(key_col)
    if allow_udf and type(serializer) not in _NATIVE:
        group = key_group_udf(max_parallelism, serializer)(key)
    else:
        serializer = _native(serializer)  # raises for serializers Spark SQL cannot reproduce
        _check_key_type(df, key, serializer)
        group = key_group_column(key, max_parallelism, serializer)
    subtask = _subtask_of_group(group, max_parallelism, parallelism)
    subtask = F.when(subtask.isNull(), F.raise_error(F.lit(_null_key_message(key_col)))).otherwise(subtask)
    witness = F.element_at(F.lit(list(partition_witnesses(parallelism))), subtask + 1)
    return df.repartition(parallelism, witness)


def _check_key_type(df: DataFrame, key: Column, serializer: Serializer[Any]) -> None:
    # The DataFrame is at hand, so the mismatch is reported now rather than when the query runs.
    field = df.select(key).schema.fields[0]
    sql_type = field.dataType.simpleString()
    types, cast_to = _SQL_TYPES[serializer.name]
    if sql_type not in types and not (serializer.name == "str" and sql_type.startswith("string")):
        raise InvalidArgumentError(
            f"key column {field.name!r} is {sql_type}, but the {serializer.name} key serializer needs "
            f"{cast_to}: cast the column (col.cast('{cast_to}')) or pass the key serializer matching its type"
        )


def _null_key_message(key_col: Any) -> str:
    name = key_col if isinstance(key_col, str) else "the key column"
    return (
        f"keyedstate: {name} has a null key; keyed state needs a key for every row: filter nulls out "
        "(df.where(col.isNotNull())) or fill them before repartition_by_key_group"
    )
