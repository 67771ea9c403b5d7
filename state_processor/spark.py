"""A state of a checkpoint or savepoint as a PySpark DataFrame, through PySpark's Python data source API.

    from keyedstate.state_processor.spark import register

    register(spark)
    df = (spark.read.format("keyedstate")
          .option("operator", "counts").option("state", "total")
          .option("keySerializer", "str").option("valueSerializer", "int")
          .option("s3.endpoint", "http://...")         # any storage key (s3.*) the checkpoint's URL needs
          .load("s3://bucket/checkpoints/orders/chk-42"))

One partition per subtask snapshot (its key-group range; ``keyGroupsPerPartition`` splits them
further); each task downloads and reads only its own snapshot. The columns are those of
:mod:`.records`; a value whose serializer has no fixed Spark type comes as its stored form:
``json`` as the JSON text (``from_json`` parses it), ``pickle``, ``msgpack`` and custom ones as binary.
Options: ``operator`` and ``state`` (required), ``keySerializer``, ``valueSerializer``,
``userKeySerializer`` (default ``bytes``), ``includeExpired`` (default false), ``keyGroupsPerPartition``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.ids import KeyGroupRange
from keyedstate.common.serializers import get_serializer
from keyedstate.state_processor import records
from keyedstate.state_processor.reader import read_arrow
from keyedstate.state_processor.records import StateSerializers
from keyedstate.state_processor.savepoint import Savepoint

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.types import StructType

logger = logging.getLogger(__name__)

FORMAT = "keyedstate"
_READER_OPTIONS = {
    "path",
    "operator",
    "state",
    "keyserializer",
    "valueserializer",
    "userkeyserializer",
    "includeexpired",
    "keygroupsperpartition",
}
_SPARK_TYPES = {
    pa.int32(): "int",
    pa.int64(): "bigint",
    pa.float64(): "double",
    pa.string(): "string",
    pa.binary(): "binary",
}


@dataclass(frozen=True)
class ReadOptions:
    """The data source's options, checked once on the driver."""

    path: str
    operator: str
    state: str
    serializers: StateSerializers
    include_expired: bool
    key_groups_per_partition: int
    storage: Mapping[str, str]
    """Every other option with a dot in its name: configuration keys for the storage (``s3.*``)."""

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> ReadOptions:
        """From Spark's (case-insensitive) options; InvalidArgumentError naming a missing or bad one."""
        opts = {k.lower(): v for k, v in options.items()}
        for required in ("path", "operator", "state"):
            if not opts.get(required):
                what = "load(PATH)" if required == "path" else f'.option("{required}", ...)'
                raise InvalidArgumentError(f"the keyedstate data source needs {what}: the {required} to read")
        try:
            per_partition = int(opts.get("keygroupsperpartition", "0"))
        except ValueError:
            raise InvalidArgumentError(
                f"option keyGroupsPerPartition must be an integer, got {opts['keygroupsperpartition']!r}"
            ) from None
        return cls(
            path=opts["path"],
            operator=opts["operator"],
            state=opts["state"],
            serializers=StateSerializers(
                _spark_serializer(opts.get("keyserializer", "bytes")),
                _spark_serializer(opts.get("valueserializer", "bytes")),
                _spark_serializer(opts.get("userkeyserializer", "bytes")),
            ),
            include_expired=opts.get("includeexpired", "false").strip().lower() == "true",
            key_groups_per_partition=per_partition,
            storage={k: v for k, v in opts.items() if k not in _READER_OPTIONS and "." in k},
        )


def _spark_serializer(name: str) -> str:
    """The serializer the data source decodes with: the same when Spark has its type, else the stored form."""
    resolved = get_serializer(name).name
    if records.arrow_type(resolved) is not None:
        return resolved
    return "str" if resolved == "json" else "bytes"


def spark_schema(sp: Savepoint, options: ReadOptions) -> str:
    """The DDL schema of the state's DataFrame."""
    descriptor = sp.state(options.operator, options.state)
    fields = []
    for name, typ in records.schema(descriptor, options.serializers):
        spark_type = _SPARK_TYPES.get(typ) if typ is not None else None
        if spark_type is None:
            raise InvalidArgumentError(f"column {name!r} has no Spark type; read it with the bytes serializer")
        fields.append(f"`{name}` {spark_type}")
    return ", ".join(fields)


def partitions(sp: Savepoint, options: ReadOptions) -> list[KeyGroupRange]:
    """Key-group ranges to read in parallel: each subtask's, split into ``key_groups_per_partition``."""
    out = []
    for sub in sorted(sp.operator(options.operator).subtasks, key=lambda s: s.key_groups.start):
        step = options.key_groups_per_partition or len(sub.key_groups)
        for start in range(sub.key_groups.start, sub.key_groups.end + 1, max(step, 1)):
            out.append(KeyGroupRange(start, min(start + step - 1, sub.key_groups.end)))
    return out


def read_partition(options: ReadOptions, key_groups: KeyGroupRange) -> list[pa.RecordBatch]:
    """The rows of ``key_groups``, as Arrow batches in the schema's column order."""
    with Savepoint.open(options.path, dict(options.storage)) as sp:
        table = read_arrow(
            sp,
            options.operator,
            options.state,
            options.serializers,
            key_groups=key_groups,
            include_expired=options.include_expired,
        )
    batches: list[pa.RecordBatch] = table.to_batches()
    return batches


def _data_source_class() -> type[Any]:
    """The DataSource subclass, built on first use so that importing this module does not need PySpark."""
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    class _Reader(DataSourceReader):
        def __init__(self, options: ReadOptions) -> None:
            self.read_options = options

        def partitions(self) -> list[InputPartition]:
            with Savepoint.open(self.read_options.path, dict(self.read_options.storage)) as sp:
                return [InputPartition((r.start, r.end)) for r in partitions(sp, self.read_options)]

        def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
            start, end = partition.value
            yield from read_partition(self.read_options, KeyGroupRange(start, end))

    class KeyedStateDataSource(DataSource):
        """``spark.read.format("keyedstate")``: one state of a checkpoint or savepoint (module docstring)."""

        @classmethod
        def name(cls) -> str:
            return FORMAT

        def schema(self) -> str:
            options = ReadOptions.parse(self.options)
            with Savepoint.open(options.path, dict(options.storage)) as sp:
                return spark_schema(sp, options)

        def reader(self, schema: StructType) -> _Reader:
            return _Reader(ReadOptions.parse(self.options))

    return KeyedStateDataSource


def register(spark: SparkSession) -> None:
    """Make ``spark.read.format("keyedstate")`` available in this session."""
    spark.dataSource.register(_data_source_class())
