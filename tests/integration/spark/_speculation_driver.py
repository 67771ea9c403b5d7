"""A Spark application with speculative execution, run as its own process by test_speculation.py.

It runs on a standalone Spark cluster whose workers are different hosts (Spark never starts a
speculative copy on the host of the original). In the first batch, partition 0's first attempt
writes its events and then stalls until its speculative copy has written the same events (or
``STALL_S`` passed): the two race to finish. Partition 1 holds back until partition 0's first
attempt has written, so that the copy cannot win before the original wrote a row (see
``_hold_back``). Every attempt that ran the process function appends a line to
``<out>/attempts.jsonl`` (the workers share this machine's disk), with its error if it failed.

It runs the batches once per foreach_batch mode and commit mode
(``execution.checkpointing.commit-mode``), as jobs ``<JOB_ID>-<mode>-<commit mode>`` (in the
shuffle-free mode each batch is first spread round-robin over four partitions, as an unkeyed source
delivers it); attempts and the summary are recorded per job.

Usage: python _speculation_driver.py JOBMANAGER JOB_ID OUT_DIR SPARK_MASTER
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BATCHES = 2
EVENTS_PER_BATCH = 400
USERS = 40
STALL_S = 20.0
"""The longest a straggler waits for its speculative copy (the test fails if none came)."""
MODES = ("keyed", "shuffle_free")
COMMIT_MODES = ("sync", "overlapped")


def jobs() -> list[tuple[str, str]]:
    """Every (foreach_batch mode, commit mode) the application runs, one job each."""
    return [(mode, commit) for commit in COMMIT_MODES for mode in MODES]


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
    # Warm both executors' Python workers (later tasks reuse them): under load a cold worker boots for
    # seconds, long enough for Spark to speculate on a task and finish the copy before the original ran
    # a line of it, so the straggler below would never race its copy.
    spark.sparkContext.parallelize(range(8), 8).map(_warm).collect()
    log = str(Path(out) / "attempts.jsonl")
    summary: dict[str, Any] = {}
    for mode, commit in jobs():  # one Spark application for all: its standalone cluster is the slow part
        runtime = KeyedStateRuntime(
            jobmanager,
            f"{job_id}-{mode}-{commit}",
            operators,
            job_config={"execution.checkpointing.commit-mode": commit},
        )
        on_batch = runtime.foreach_batch(_process(log, mode, commit), key_col="user", operator="agg", mode=mode)
        started = time.monotonic()
        for batch in range(BATCHES):
            df = spark.createDataFrame(events(batch), "user string, amount long, event string")
            if mode == "shuffle_free":
                df = df.repartition(4)  # as an unkeyed source delivers it: every user over several tasks
            on_batch(df, batch)
        summary[f"{mode}-{commit}"] = {
            "seconds": time.monotonic() - started,
            "batches_run": runtime.batches_run,
            "batch_attempts": runtime.batch_attempts,
            "durable_epoch": runtime.durable_epoch(),
        }
        runtime.close()
    (Path(out) / "summary.json").write_text(json.dumps(summary))
    spark.stop()
    return 0


def _warm(x: int) -> int:
    time.sleep(0.3)  # long enough that both one-core executors get some of the eight tasks
    return x


def _process(log: str, mode: str, commit: str) -> Any:
    def process(batches: Any, state: Any) -> None:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        assert ctx is not None  # this runs in a Spark task
        attempt = {
            "mode": mode,
            "commit": commit,
            "batch": state.batch_id,
            "partition": ctx.partitionId(),
            "attempt": ctx.attemptNumber(),
            "task_attempt_id": ctx.taskAttemptId(),
            "pid": os.getpid(),
            "host": os.environ.get("SPARK_LOCAL_IP", ""),
        }
        try:
            rows = [r for b in batches for r in b.to_pylist()]
            if rows:
                users = [r["user"] for r in rows]
                state.reducing("totals").add_many(users, [(1, r["amount"]) for r in rows])
                state.list("events", value_serializer="str").append_many(users, [r["event"] for r in rows])
        except BaseException as e:
            # Recorded so that the test can tell an attempt that failed from one Spark never ran.
            _record(log, {**attempt, "failed": f"{type(e).__name__}: {e}"})
            raise
        _record(log, {**attempt, "rows": len(rows)})
        if state.batch_id == 0 and ctx.partitionId() == 0 and ctx.attemptNumber() == 0:
            _straggle(log, mode, commit)
        elif state.batch_id == 0 and ctx.partitionId() == 1:
            _hold_back(log, mode, commit)

    return process


def _record(log: str, attempt: dict[str, Any]) -> None:
    with open(log, "a") as f:
        f.write(json.dumps(attempt) + "\n")


def _straggle(log: str, mode: str, commit: str) -> None:
    """Stall like a straggler until Spark's speculative copy of this task (launched on the other
    executor) has written the same events, then race it to finish; at most ``STALL_S``."""
    _wait_for_first_partition(log, mode, commit, lambda attempt: attempt > 0)


def _hold_back(log: str, mode: str, commit: str) -> None:
    """Partition 1 of the first batch finishes only once partition 0's first attempt has written
    its events (at most ``STALL_S``).

    Spark speculates on a task once half the stage's tasks finished. A first attempt that starts
    slowly (its executor's Python worker is new and imports for seconds under load, as after a
    losing attempt of the job before was killed with its worker) could otherwise be speculated on,
    and the copy finish and the original be killed, before the original wrote a row: there would be
    nothing to race. While partition 1 holds back, at most partitions 2 and 3 can finish, and the
    copy of partition 0 could only run on partition 1's executor, which is busy holding back.
    """
    _wait_for_first_partition(log, mode, commit, lambda attempt: attempt == 0)


def _wait_for_first_partition(log: str, mode: str, commit: str, attempt_wanted: Callable[[int], bool]) -> None:
    """Until an attempt of partition 0 of this job's first batch, with a number ``attempt_wanted``
    accepts, has written its events; at most ``STALL_S``."""
    job = (mode, commit, 0, 0)
    deadline = time.monotonic() + STALL_S
    while time.monotonic() < deadline:
        with open(log) as f:
            if any(
                "rows" in a
                and (a["mode"], a["commit"], a["batch"], a["partition"]) == job
                and attempt_wanted(a["attempt"])
                for a in map(json.loads, f)
            ):
                return
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
