"""The main job: a local cluster, a PySpark streaming pipeline with keyed state, a TaskManager
killed midway, and the result checked against a plain-Python reference.

Run with ``make run`` (or ``python -m keyedstate.examples.main_job``). Everything it writes
goes under ``var/main-job/`` (logs, checkpoints, Spark's checkpoint location, input data).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common.minicluster import MiniCluster

logger = logging.getLogger("keyedstate.main_job")


def _say(msg: str) -> None:
    print(f"[main-job {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _spark(base: Path) -> Any:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    # Python workers put their working directory on sys.path; start Spark from a scratch
    # directory so the repository's top-level folders are never imported by accident.
    scratch = base / "spark-cwd"
    scratch.mkdir(parents=True, exist_ok=True)
    previous = os.getcwd()
    os.chdir(scratch)
    try:
        spark = (
            SparkSession.builder.master("local[2,4]")
            .appName("keyedstate-main-job")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "4")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.sql.execution.arrow.pyspark.enabled", "true")
            .getOrCreate()
        )
    finally:
        os.chdir(previous)
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def run(base: Path, files: int, events_per_file: int, users: int, kill_at: int) -> int:
    from pyspark.sql import functions as F

    from keyedstate.common.spark import KeyedStateRuntime
    from keyedstate.examples.sessions import (
        OPERATORS,
        WATERMARK_DELAY_MS,
        generate_events,
        on_timer,
        process_partition,
        reference,
    )

    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    checkpoints = (base / "checkpoints").resolve().as_uri()
    _say(f"generating {files * events_per_file} events for {users} users in {files} Parquet files")
    events = generate_events(base / "input", files, events_per_file, users)

    cluster = MiniCluster(
        base / "cluster",
        num_taskmanagers=2,
        slots_per_taskmanager=4,
        backend="rocksdb",
        config={
            "state.checkpoints.dir": checkpoints,
            "execution.checkpointing.num-retained": 2,
            "execution.checkpointing.incremental": "true",
            "heartbeat.interval": "500 ms",
            "heartbeat.timeout": "3 s",
            "restart-strategy.type": "fixed-delay",
            "restart-strategy.fixed-delay.attempts": 3,
            "restart-strategy.fixed-delay.delay": "500 ms",
            "metrics.reporter.prom.port": "9249-9299",
        },
    )
    _say("starting a local cluster: 1 JobManager, 2 TaskManagers (RocksDB, file:// checkpoints)")
    cluster.start()
    spark = None
    try:
        _say(
            f"JobManager at {cluster.jobmanager_address}; TaskManagers at "
            + ", ".join(t.address for t in cluster.taskmanagers)
        )
        runtime = KeyedStateRuntime(cluster.jobmanager_address, "sessions-demo", OPERATORS)
        spark = _spark(base)
        # Sessions close on an event-time timer once the watermark passes their end (see sessions.py).
        process = runtime.foreach_batch(process_partition, key_col="user", operator="sessions", on_timer=on_timer)
        recovery: dict[str, float] = {}

        def on_batch(df: Any, batch_id: int) -> None:
            if batch_id == kill_at and "killed_at" not in recovery:
                victim = cluster.taskmanagers[1]
                _say(f"batch {batch_id}: killing TaskManager {victim.name} (SIGKILL) to show recovery")
                victim.kill()
                recovery["killed_at"] = time.monotonic()
                threading.Thread(target=_watch_recovery, args=(runtime, recovery), daemon=True).start()
            t0 = time.monotonic()
            process(df, batch_id)
            cp = runtime.last_checkpoint
            _say(
                f"batch {batch_id}: committed in {time.monotonic() - t0:.1f} s; checkpoint "
                f"{cp.checkpoint_id if cp else '-'} ({cp.incremental_size if cp else 0} bytes uploaded)"
            )
            if "recovered_at" in recovery and "restarted" not in recovery:
                recovery["restarted"] = 1
                cluster.restart_taskmanager(1)
                _say("restarted the killed TaskManager; it registered again")

        stream = (
            spark.readStream.schema("user string, ts long, kind string, amount long")
            .option("maxFilesPerTrigger", 1)
            .parquet(str(base / "input"))
            .withColumn("event_time", F.timestamp_millis("ts"))
            .withWatermark("event_time", f"{WATERMARK_DELAY_MS // 1000} seconds")
        )
        query = (
            stream.writeStream.foreachBatch(on_batch)
            .option("checkpointLocation", str(base / "spark-checkpoint"))
            .trigger(processingTime="0 seconds")
            .start()
        )
        while query.isActive and runtime.batches_run + runtime.batches_skipped < files:
            time.sleep(0.5)
            if query.exception() is not None:
                raise RuntimeError(f"streaming query failed: {query.exception()}")
        query.stop()

        _say("verifying the state against a plain-Python reference")
        # The last batch fired timers at the watermark of the batches before it (Spark's rule).
        before_last = events[: (files - 1) * events_per_file]
        watermark = max(0, max(e["ts"] for e in before_last) - WATERMARK_DELAY_MS) if before_last else 0
        expected = reference(events, watermark)
        mismatches = _verify(runtime, expected)
        closed_by_timer = sum(1 for exp in expected.values() if exp["session"] is None)
        info = runtime.client.job_info("sessions-demo")
        checkpoints_taken = len(runtime.client.list_checkpoints("sessions-demo").checkpoints)
        recovery_s = recovery.get("recovered_at", 0) - recovery.get("killed_at", 0)
        print()
        print("=" * 72)
        print(f" events processed     {len(events):>10}")
        print(f" users (keys)         {len({e['user'] for e in events}):>10}")
        print(f" micro-batches        {files:>10}   (runs incl. retries: {runtime.batch_attempts})")
        print(f" checkpoints          {checkpoints_taken:>10}   latest: {info.latest_checkpoint_path}")
        print(f" TaskManager killed   {'batch ' + str(kill_at):>10}   job restarts: {info.restarts}")
        print(f" recovery time        {recovery_s:>9.1f}s   (kill -> job RUNNING again)")
        print(f" closed by timers     {closed_by_timer:>10}   users whose last session the watermark closed")
        print(f" mismatches           {mismatches:>10}")
        print(" metrics              JobManager and TaskManagers serve Prometheus on ports 9249-9299 (/metrics)")
        print(f" logs                 {base / 'cluster' / 'log'}")
        print("=" * 72)
        if mismatches:
            _say("FAILED: the state differs from the reference")
            return 1
        _say("OK: every key equals the reference")
        return 0
    finally:
        if spark is not None:
            spark.stop()
        cluster.stop()


def _watch_recovery(runtime: Any, recovery: dict[str, float]) -> None:
    seen_restart = False
    while True:
        try:
            info = runtime.client.job_info(runtime.job_id)
            if info.status != pb.JOB_STATUS_RUNNING:
                seen_restart = True
            if seen_restart and info.status == pb.JOB_STATUS_RUNNING:
                recovery["recovered_at"] = time.monotonic()
                _say(
                    f"job RUNNING again after {recovery['recovered_at'] - recovery['killed_at']:.1f} s "
                    f"(restored from {info.latest_checkpoint_path})"
                )
                return
        except Exception:
            pass
        time.sleep(0.1)


def _verify(runtime: Any, expected: dict[str, dict[str, Any]]) -> int:
    from keyedstate.common.client import ListState, MapState, ReducingState, TimeDomain, TimerService, ValueState
    from keyedstate.examples.sessions import GAP_MS

    c, job = runtime.client, runtime.job_id
    users = sorted(expected)
    session = ValueState[str, Any](c, job, "sessions", "session", value_serializer="json").get_many(users)
    closed = ListState[str, Any](c, job, "sessions", "closed", value_serializer="json").get_many(users)
    totals = ReducingState[str](c, job, "sessions", "totals").get_many(users)
    kinds_state = MapState[str, str, int](c, job, "sessions", "kinds", value_serializer="int")
    timers: dict[str, list[int]] = {}
    for t in TimerService[str](c, job, "sessions").due(TimeDomain.EVENT_TIME, 1 << 62):
        timers.setdefault(t.key, []).append(t.timestamp_ms)
    bad = 0
    for i, user in enumerate(users):
        exp = expected[user]
        kinds = dict(kinds_state.items(user))
        if (
            session[i] != exp["session"]
            or closed[i] != exp["closed"]
            or tuple(totals[i] or ()) != exp["totals"]
            or kinds != exp["kinds"]
            # An open session has exactly one timer, at its end; a closed one none.
            or timers.get(user, []) != ([exp["session"]["last"] + GAP_MS] if exp["session"] else [])
        ):
            bad += 1
            if bad <= 3:
                _say(
                    f"mismatch for {user}: got {session[i]}, {closed[i]}, {totals[i]}, {kinds}, timers {timers.get(user)}; expected {exp}"
                )
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="main_job", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="var/main-job", help="working directory (deleted first)")
    parser.add_argument("--files", type=int, default=10, help="input files = micro-batches")
    parser.add_argument("--events-per-file", type=int, default=20_000)
    parser.add_argument("--users", type=int, default=5_000)
    parser.add_argument("--kill-at", type=int, default=5, help="batch at which a TaskManager is killed (-1: never)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if args.files < 1 or args.events_per_file < 1 or args.users < 1:
        parser.error("--files, --events-per-file and --users must be positive")
    return run(Path(args.dir).absolute(), args.files, args.events_per_file, args.users, args.kill_at)


if __name__ == "__main__":
    sys.exit(main())
