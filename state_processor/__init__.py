"""The State Processor API: read, bootstrap and transform checkpoints and savepoints offline, in Python.

Flink's State Processor API runs on the JVM and Spark's state reader is read-only; this package
reads any completed checkpoint or savepoint of either backend from any storage URL with no
cluster running, writes new savepoints from tables (a backfill), and rewrites existing ones. A
job restores what it writes like any savepoint (``statectl job restore JOB --from PATH``).

* :class:`Savepoint` opens a checkpoint; :func:`read_arrow` / :func:`read_pandas` give a state as a
  table (columns in :mod:`.records`); :mod:`.spark` reads it as a PySpark DataFrame
  (``spark.read.format("keyedstate")``); :func:`summarize` counts keys and bytes per key group.
* :func:`bootstrap_savepoint` writes a savepoint from tables; :func:`transform_savepoint` writes a
  changed copy (:class:`DropState`, :class:`DropOperator`, :class:`RenameOperator`, :class:`MapValues`).
"""

from __future__ import annotations

from keyedstate.state_processor.bootstrap import BootstrapOperator, BootstrapState, bootstrap_savepoint
from keyedstate.state_processor.reader import read_arrow, read_columns, read_pandas
from keyedstate.state_processor.records import StateSerializers
from keyedstate.state_processor.savepoint import RawEntry, Savepoint
from keyedstate.state_processor.summary import KeyGroupStats, KeyStats, Summary, summarize
from keyedstate.state_processor.transform import (
    DropOperator,
    DropState,
    MapValues,
    RenameOperator,
    Transformation,
    transform_savepoint,
)

__all__ = [
    "BootstrapOperator",
    "BootstrapState",
    "DropOperator",
    "DropState",
    "KeyGroupStats",
    "KeyStats",
    "MapValues",
    "RawEntry",
    "RenameOperator",
    "Savepoint",
    "StateSerializers",
    "Summary",
    "Transformation",
    "bootstrap_savepoint",
    "read_arrow",
    "read_columns",
    "read_pandas",
    "summarize",
    "transform_savepoint",
]
