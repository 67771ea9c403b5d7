"""The chaos suite's Spark driver: its own process, so that the harness can kill it with SIGKILL.

It starts its own ``local[2,4]`` SparkSession, attaches a :class:`KeyedStateRuntime` to the job
(submitting it if the JobManager does not run it: the README's restart recipe) and runs the
exactly-once pipeline of ``tests/integration/exactly_once/_pipeline.py`` as a Structured
Streaming query with ``trigger(availableNow=True)`` over the Parquet files, one file per batch,
on a fixed ``checkpointLocation``. A driver started again on that location carries on where
Spark's commit log says.

The harness reads what happened from files, written as it happens:

* the progress file (``progress`` in the config, shared by every driver of a run, lines
  appended whole): one JSON object per line: ``{"ev": "start", "batch": b, ...}`` when a
  ``foreachBatch`` call begins, ``{"ev": "return", "batch": b, "runs": n, "skipped": bool}`` when
  it returned (Spark records the batch next), ``{"ev": "raise", "batch": b, "error": ...}`` when
  it raised, and ``{"ev": "query", ...}`` when a query starts or ends;
* ``OUT/outcome.json`` (written last, atomically): ``{"status": "finished"}`` or
  ``{"status": "error", "error": <essence>, "text": <full text>}``. A killed driver writes none.

Faults that only the driver can inject come in the config file (``tests/chaos/_schedule.py``):

* ``task_failures``: ``[batch, partition, mode]``: that task's first attempt fails (``raise``
  before writing, ``raise-after-write`` after staging its writes, ``exit`` kills the Python
  worker after staging); Spark retries it. Each injection first appends a line to
  ``task_failure_log``;
* ``query_stops``: ``[batch, delay_s]``: ``query.stop()`` from another thread ``delay_s`` into the
  batch, then a new query (and runtime) on the same checkpointLocation;
* ``self_kills``: ``[batch, point]``: SIGKILL the driver's whole process group at ``point``:
  ``before-batch`` (foreachBatch entered, nothing sent) or ``after-return`` (foreachBatch's work
  done, before Spark writes its commit log entry).

``java_options`` are added to the driver JVM's options.

Usage: python _driver.py CONFIG_JSON OUT_DIR
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, cast

_REPO = Path(__file__).resolve().parents[2]


class _Progress:
    """Appends one JSON line per event to ``progress.jsonl`` (flushed and fsynced: the harness tails it)."""

    def __init__(self, path: Path, incarnation: int) -> None:
        # Held open for the driver process's life, which ends by exit or SIGKILL; each line is fsynced.
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115
        self._lock = threading.Lock()
        self.incarnation = incarnation

    def write(self, ev: str, **fields: Any) -> None:
        line = json.dumps({"ev": ev, "t": time.time(), "driver": self.incarnation, **fields})
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()
            os.fsync(self._f.fileno())


def _kill_self(progress: _Progress, point: str, batch: int) -> None:
    progress.write("self-kill", batch=batch, point=point)
    # The whole driver application dies as a host crash kills it: Python, its JVM and the workers.
    os.killpg(os.getpgid(0), signal.SIGKILL)


def make_faulty_process(failures: list[list[Any]], marker: str) -> Any:
    """The pipeline's process function, with the first attempt of the listed tasks failing; each
    injected failure first appends a line to ``marker``."""
    from tests.integration.exactly_once._pipeline import make_process

    inner = make_process()
    plan = {(int(b), int(p)): str(mode) for b, p, mode in failures}

    def process(batches: Any, state: Any) -> None:
        from pyspark import TaskContext

        ctx = cast("TaskContext", TaskContext.get())  # set inside a task
        mode = plan.get((state.batch_id, ctx.partitionId())) if ctx.attemptNumber() == 0 else None
        if mode is not None:
            with open(marker, "a", encoding="utf-8") as f:
                f.write(
                    json.dumps(
                        {"batch": state.batch_id, "partition": ctx.partitionId(), "mode": mode, "t": time.time()}
                    )
                    + "\n"
                )
        if mode == "raise":
            raise RuntimeError(
                f"chaos: task failure injected before writing (batch {state.batch_id}, "
                f"partition {ctx.partitionId()}, attempt 0)"
            )
        inner(batches, state)
        if mode == "raise-after-write":
            raise RuntimeError(
                f"chaos: task failure injected after staging (batch {state.batch_id}, "
                f"partition {ctx.partitionId()}, attempt 0)"
            )
        if mode == "exit":
            os._exit(13)  # the Python worker dies with the task's writes staged

    return process


def main(config_path: str, out_dir: str) -> int:
    conf = json.loads(Path(config_path).read_text(encoding="utf-8"))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    progress = _Progress(Path(conf["progress"]), int(conf["incarnation"]))
    progress.write("driver", pid=os.getpid())
    sys.path.insert(0, str(_REPO))  # the driver imports the pipeline; executors get functions by value
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    work = out / "spark-work"
    work.mkdir(exist_ok=True)
    os.chdir(work)  # the JVM and its Python workers must not run in the repository root

    from pyspark import cloudpickle
    from pyspark.sql import SparkSession

    from tests.integration.exactly_once._pipeline import OPERATOR, SCHEMA, essence, operators, unkeyed_input

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    spark = (
        SparkSession.builder.master("local[2,4]")
        .appName(f"keyedstate-chaos-{conf['incarnation']}")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.default.parallelism", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.warehouse.dir", str(work / "warehouse"))
        .config("spark.local.dir", str(work / "local"))
        .config("spark.driver.extraJavaOptions", f"-Dderby.system.home={work} {conf.get('java_options', '')}".strip())
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    progress.write("spark", app=spark.sparkContext.applicationId)

    from keyedstate.common.spark import KeyedStateRuntime

    process = make_faulty_process(conf.get("task_failures", []), str(conf["task_failure_log"]))
    kills = {int(b): str(point) for b, point in conf.get("self_kills", [])}
    stops = {int(b): float(delay) for b, delay in conf.get("query_stops", [])}
    stopped_at: set[int] = set()
    batch_mode, parallelism = str(conf.get("batch_mode", "keyed")), int(conf["parallelism"])
    stop_requested: set[int] = set()  # queries (by number) this driver stopped on purpose

    def start_query(n: int) -> tuple[Any, Any]:
        runtime = KeyedStateRuntime(conf["jobmanager"], conf["job_id"], operators(int(conf["parallelism"])))
        inner = runtime.foreach_batch(
            process,
            key_col="key",
            operator=OPERATOR,
            batch_timeout_s=float(conf["batch_timeout_s"]),
            max_batch_attempts=int(conf["max_batch_attempts"]),
            mode=batch_mode,
        )
        holder: dict[str, Any] = {}

        def on_batch(df: Any, batch_id: int) -> None:
            progress.write("start", batch=batch_id, query=n)
            if kills.get(batch_id) == "before-batch":
                _kill_self(progress, "before-batch", batch_id)
            if batch_id in stops and batch_id not in stopped_at:
                stopped_at.add(batch_id)
                threading.Thread(target=stop_later, args=(holder, stops[batch_id], batch_id, n), daemon=True).start()
            runs, skipped = runtime.batch_attempts, runtime.batches_skipped
            try:
                inner(unkeyed_input(df, batch_mode, parallelism), batch_id)
            except BaseException as exc:
                progress.write(
                    "raise",
                    batch=batch_id,
                    query=n,
                    runs=runtime.batch_attempts - runs,
                    error=essence(f"{type(exc).__name__}: {exc}"),
                )
                raise
            progress.write(
                "return",
                batch=batch_id,
                query=n,
                runs=runtime.batch_attempts - runs,
                skipped=runtime.batches_skipped > skipped,
            )
            if kills.get(batch_id) == "after-return":
                _kill_self(progress, "after-return", batch_id)

        stream = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(conf["source"])
        query = (
            stream.writeStream.foreachBatch(on_batch)
            .trigger(availableNow=True)
            .option("checkpointLocation", conf["checkpoint_location"])
            .start()
        )
        holder["query"] = query
        progress.write("query", query=n, state="started", id=str(query.id))
        return runtime, query

    def stop_later(holder: dict[str, Any], delay_s: float, batch_id: int, n: int) -> None:
        time.sleep(delay_s)
        progress.write("query-stop", batch=batch_id, query=n)
        stop_requested.add(n)
        try:
            holder["query"].stop()
        except Exception as exc:  # the query may have failed meanwhile; the main loop reports that
            progress.write("query-stop-error", batch=batch_id, query=n, error=str(exc)[:300])

    n = 0
    outcome: dict[str, Any]
    while True:
        try:
            runtime, query = start_query(n)
        except Exception as exc:  # the job submission failed (e.g. the JobManager is unreachable)
            text = f"{type(exc).__name__}: {exc}"
            outcome = {"status": "error", "error": essence(text), "text": text[-8000:], "phase": "submit"}
            break
        error: str | None = None
        try:
            query.awaitTermination()
            failure = query.exception()
            error = f"{type(failure).__name__}: {failure}" if failure is not None else None
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        progress.write("query", query=n, state="ended", error=essence(error) if error else None)
        runtime.close()
        if n in stop_requested and error is None:
            n += 1  # stopped mid-batch on purpose: a new query on the same checkpointLocation
            continue
        outcome = (
            {"status": "finished"}
            if error is None
            else {"status": "error", "error": essence(error), "text": error[-8000:]}
        )
        break
    tmp = out / ".outcome.json.tmp"
    tmp.write_text(json.dumps(outcome), encoding="utf-8")
    os.replace(tmp, out / "outcome.json")
    progress.write("exit", status=outcome["status"])
    try:
        spark.stop()
    except Exception:
        traceback.print_exc()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
