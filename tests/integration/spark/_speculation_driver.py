"""A Spark application with speculative execution, run as its own process by test_speculation.py.

It runs on a standalone Spark cluster whose workers are different hosts (Spark never starts a
speculative copy on the host of the original). Partition 0's first attempt writes its events and
then stalls; its speculative copy writes the same events and wins. Every attempt that ran the
process function appends a line to ``<out>/attempts.jsonl`` (the workers share this machine's disk).

It runs the batches once per foreach_batch mode, as jobs ``<JOB_ID>-keyed`` and
``<JOB_ID>-shuffle_free`` (there each batch is first spread round-robin over four partitions, as an
unkeyed source delivers it); attempts and the summary are recorded per mode.

Usage: python _speculation_driver.py JOBMANAGER JOB_ID OUT_DIR SPARK_MASTER
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

BATCHES = 2
EVENTS_PER_BATCH = 400
USERS = 40
STALL_S = 20.0
MODES = ("keyed", "shuffle_free")


def events(batch: int) -> list[tuple[str, int, str]]:
    return [
        (f"user-{(batch * 7 + i) % USERS}", 1 + (batch * 31 + i) % 97, f"b{batch}-e{i}")
        for i in range(EVENTS_PER_BATCH)
    ]


def main(jobmanager: str, job_id: str, out: str, master: str) -> int:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark import cloudpickle
    from pyspark.sql import SparkSession

    from keyedstate.common.descriptors import OperatorSpec, ReduceField, StateDescriptor, StateKind
    from keyedstate.common.spark import KeyedStateRuntime

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    spark = (
        SparkSession.builder.master(master)
        .appName("keyedstate-speculation")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", os.environ["SPARK_LOCAL_IP"])
        .config("spark.driver.bindAddress", os.environ["SPARK_LOCAL_IP"])
        .config("spark.executor.memory", "768m")
        .config("spark.cores.max", "2")
        .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
        .config("spark.speculation", "true")
        .config("spark.speculation.interval", "100ms")
        .config("spark.speculation.multiplier", "1.2")
        .config("spark.speculation.quantile", "0.5")
        .config("spark.speculation.minTaskRuntime", "200ms")
        .config("spark.sql.shuffle.partitions", "4")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    operators = [
        OperatorSpec(
            "agg",
            4,
            (
                StateDescriptor("totals", StateKind.REDUCING, reduce_fields=(ReduceField("n"), ReduceField("amount"))),
                StateDescriptor("events", StateKind.LIST),
            ),
        )
    ]
    log = str(Path(out) / "attempts.jsonl")
    summary: dict[str, Any] = {}
    for mode in MODES:  # one Spark application for both: its standalone cluster is the slow part
        runtime = KeyedStateRuntime(jobmanager, f"{job_id}-{mode}", operators)
        on_batch = runtime.foreach_batch(_process(log, mode), key_col="user", operator="agg", mode=mode)
        started = time.monotonic()
        for batch in range(BATCHES):
            df = spark.createDataFrame(events(batch), "user string, amount long, event string")
            if mode == "shuffle_free":
                df = df.repartition(4)  # as an unkeyed source delivers it: every user over several tasks
            on_batch(df, batch)
        summary[mode] = {
            "seconds": time.monotonic() - started,
            "batches_run": runtime.batches_run,
            "batch_attempts": runtime.batch_attempts,
            "durable_epoch": runtime.durable_epoch(),
        }
        runtime.close()
    (Path(out) / "summary.json").write_text(json.dumps(summary))
    spark.stop()
    return 0


def _process(log: str, mode: str) -> Any:
    def process(batches: Any, state: Any) -> None:
        from pyspark import TaskContext

        rows = [r for b in batches for r in b.to_pylist()]
        ctx = TaskContext.get()
        assert ctx is not None  # this runs in a Spark task
        if rows:
            users = [r["user"] for r in rows]
            state.reducing("totals").add_many(users, [(1, r["amount"]) for r in rows])
            state.list("events", value_serializer="str").append_many(users, [r["event"] for r in rows])
        with open(log, "a") as f:
            f.write(
                json.dumps(
                    {
                        "mode": mode,
                        "batch": state.batch_id,
                        "partition": ctx.partitionId(),
                        "attempt": ctx.attemptNumber(),
                        "task_attempt_id": ctx.taskAttemptId(),
                        "rows": len(rows),
                        "pid": os.getpid(),
                        "host": os.environ.get("SPARK_LOCAL_IP", ""),
                    }
                )
                + "\n"
            )
        if ctx.partitionId() == 0 and ctx.attemptNumber() == 0:
            time.sleep(STALL_S)  # a straggler: Spark launches a speculative copy on the other executor

    return process


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
