"""Spark-side helpers: native key-group partitioning and shipping keyedstate to executors.

pyspark is imported on first use only, so this package imports without it (the executor
client, ``keyedstate.common.client``, never imports this package).

Typical use on the driver::

    from keyedstate.common.spark import repartition_by_key_group, ship_package

    ship_package(spark)   # executors without keyedstate installed can now import it
    df = repartition_by_key_group(df, "user_id", max_parallelism=128, parallelism=4)
    # partition i of df now holds exactly the keys of subtask i
"""

from __future__ import annotations

from keyedstate.common.spark._credentials import TOKEN_FILE_CONF, ship_token_file
from keyedstate.common.spark._epochs import BatchTiming, KeyedStateRuntime, PartitionState, worker_client
from keyedstate.common.spark._keygroups import (
    key_bytes_column,
    key_group_column,
    key_group_udf,
    partition_witnesses,
    repartition_by_key_group,
    spark_hash_int,
    subtask_column,
)
from keyedstate.common.spark._modes import ROW_COUNT, BatchMode, ReduceInto
from keyedstate.common.spark._processor import ProcessorHandle, ProcessorState, processor_operator, processor_states
from keyedstate.common.spark._shipping import package_zip, ship_package
from keyedstate.common.spark._timers import BatchTimes, TimerFn

__all__ = [
    "ROW_COUNT",
    "TOKEN_FILE_CONF",
    "BatchMode",
    "BatchTimes",
    "BatchTiming",
    "KeyedStateRuntime",
    "PartitionState",
    "ProcessorHandle",
    "ProcessorState",
    "ReduceInto",
    "TimerFn",
    "key_bytes_column",
    "key_group_column",
    "key_group_udf",
    "package_zip",
    "partition_witnesses",
    "processor_operator",
    "processor_states",
    "repartition_by_key_group",
    "ship_package",
    "ship_token_file",
    "spark_hash_int",
    "subtask_column",
    "worker_client",
]
