"""``spark.read.format("keyedstate")``: a checkpoint's state as a PySpark DataFrame, on a real local Spark.

The checkpoint comes from a real cluster (the checkpoint tests' Workload over every state kind); the
DataFrame must equal the reference exactly, and read one partition per key-group range.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.state_processor.spark import register
from tests.integration.checkpoints.conftest import (
    JOB,
    MAX_P,
    OPERATOR,
    CheckpointCluster,
    Workload,
    key_names,
    operators,
)

pytestmark = pytest.mark.spark


@pytest.mark.parametrize("storage", ["file", pytest.param("s3", marks=pytest.mark.s3)])
def test_spark_reads_every_state_kind_of_a_checkpoint(
    checkpoint_cluster: Callable[..., CheckpointCluster], spark: Any, storage: str
) -> None:
    cc = checkpoint_cluster(storage, "rocksdb")
    client = cc.client()
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P, config={"execution.checkpointing.incremental": "true"})
    work = Workload(client, seed=11)
    work.write(key_names(400), "a")
    info = client.trigger_checkpoint(JOB, timeout_s=60)
    assert info.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, info.failure_reason
    client.cancel_job(JOB)
    ref = work.reference
    register(spark)

    def load(state: str, **options: str) -> Any:
        reader = spark.read.format("keyedstate").option("operator", OPERATOR).option("state", state)
        for k, v in {**cc.config, **options}.items():
            reader = reader.option(k, str(v))
        return reader.load(info.path)

    last = load("last", keySerializer="str", valueSerializer="int")
    assert last.schema.simpleString() == "struct<key_group:int,key:string,namespace:binary,value:bigint>"
    assert last.rdd.getNumPartitions() == 2, "one partition per subtask's key-group range"
    assert {r["key"]: r["value"] for r in last.collect()} == ref.last
    assert load("last", keyGroupsPerPartition="16").rdd.getNumPartitions() == MAX_P // 16

    events = load("events", keySerializer="str", valueSerializer="str").orderBy("key", "index").collect()
    got: dict[str, list[str]] = {}
    for r in events:
        got.setdefault(r["key"], []).append(r["value"])
    assert got == ref.events

    attrs = load("attrs", keySerializer="str", userKeySerializer="str", valueSerializer="json").collect()
    assert {(r["key"], r["user_key"]): json.loads(r["value"]) for r in attrs} == {
        (k, uk): v for k, m in ref.attrs.items() for uk, v in m.items()
    }
    totals = load("totals", keySerializer="str")
    assert {r["key"]: (r["count"], r["peak"]) for r in totals.collect()} == ref.totals
    assert totals.groupBy().sum("count").collect()[0][0] == sum(n for n, _ in ref.totals.values())


def test_spark_options_are_checked(spark: Any, tmp_path: Any) -> None:
    register(spark)
    with pytest.raises(Exception, match=r'needs .option\("state", ...\)'):
        spark.read.format("keyedstate").option("operator", "x").load(tmp_path.as_uri()).schema  # noqa: B018


def test_bootstrap_from_a_spark_dataframe(spark: Any, tmp_path: Any) -> None:
    from keyedstate.common.descriptors import StateDescriptor, StateKind
    from keyedstate.state_processor import (
        BootstrapOperator,
        BootstrapState,
        Savepoint,
        StateSerializers,
        bootstrap_savepoint,
        read_columns,
    )

    rows = [(f"user-{i}", i * 3) for i in range(200)]
    df = spark.createDataFrame(rows, "key string, value bigint").repartition(3)
    state = BootstrapState(StateDescriptor("total", StateKind.VALUE), df, StateSerializers("str", "int"))
    target = (tmp_path / "from-spark").as_uri()
    bootstrap_savepoint(target, [BootstrapOperator("counts", 2, (state,))], max_parallelism=MAX_P)
    with Savepoint.open(target) as sp:
        cols = read_columns(sp, "counts", "total", StateSerializers("str", "int"))
    assert dict(zip(cols["key"], cols["value"])) == dict(rows)
