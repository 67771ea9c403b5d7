"""The exactly-once pipeline the tests of this package (and a chaos suite) drive, as a user builds it.

One JobManager and RocksDB TaskManagers run as real processes (:class:`MiniCluster`), with
incremental ``file://`` checkpoints under the test's directory. A Structured Streaming query
reads N Parquet files, one file per micro-batch (``maxFilesPerTrigger=1``, files ordered by
modification time, so file ``k`` is batch ``k`` of a checkpointLocation), through
``KeyedStateRuntime.foreach_batch``: every event adds ``(1, amount)`` to the key's
ReducingState ``totals`` and appends its event id to the key's ListState ``ids``.

:meth:`ExactlyOncePipeline.diff` compares every key's count, sum and exact multiset of event ids
with a plain-Python reference and says how many events were lost, doubled or applied without
being expected, per file (= per batch).

Queries use ``Trigger.AvailableNow``: a query processes the files present when it starts, one
per batch, and then finishes by itself, so "the stream finished" is a terminated query without
an exception. Driver-side hooks (``before_batch``/``after_batch``) run inside ``foreachBatch``
around the runtime's function, so a test can act at an exact batch boundary.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

# Executors cannot import the test tree: the process function travels by value.
from pyspark import cloudpickle

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common.client import ClientSettings, ListState, ReducingState, StateClient, ValueState
from keyedstate.common.descriptors import OperatorSpec, ReduceField, StateDescriptor, StateKind
from keyedstate.common.errors import JobStateError, StaleRoutingError, UnavailableError
from keyedstate.common.minicluster import DaemonProcess, MiniCluster, PlacementFn
from keyedstate.common.spark import KeyedStateRuntime

cloudpickle.register_pickle_by_value(sys.modules[__name__])

JOB = "exo"
OPERATOR = "events"
SCHEMA = "key string, amount long, event_id string"
STATES = (
    StateDescriptor("totals", StateKind.REDUCING, reduce_fields=(ReduceField("count"), ReduceField("sum"))),
    StateDescriptor("ids", StateKind.LIST),
    StateDescriptor("ballast", StateKind.VALUE),
)
"""``ballast`` is not written by the pipeline: a test fills it directly (:meth:`ExactlyOncePipeline.write_ballast`)
when it needs state big enough that snapshot uploads take a moment."""

FAST_HEARTBEATS = {"heartbeat.interval": "200 ms", "heartbeat.timeout": "10 s"}
FAST_RESTARTS = {
    "restart-strategy.type": "fixed-delay",
    "restart-strategy.fixed-delay.attempts": "100",
    "restart-strategy.fixed-delay.delay": "200 ms",
}
"""A restart budget that outlasts a TaskManager restart (tests that are not about the budget)."""


def operators(parallelism: int) -> list[OperatorSpec]:
    return [OperatorSpec(OPERATOR, parallelism, STATES)]


def file_of(event_id: str) -> int:
    """Event ids are ``f<file>-<n>``."""
    return int(event_id[1 : event_id.index("-")])


def make_process(report_dir: str | None = None) -> Callable[[Iterator[Any], Any], None]:
    """The per-partition function. With ``report_dir``, each task also writes what it saw there
    (epoch, Spark partition, attempt, key groups of its keys) as one JSON file."""

    def process(batches: Iterator[Any], state: Any) -> None:
        keys: list[str] = []
        ids: list[str] = []
        totals: dict[str, list[int]] = {}
        for batch in batches:
            cols = batch.to_pydict()
            for key, amount, event_id in zip(cols["key"], cols["amount"], cols["event_id"]):
                keys.append(key)
                ids.append(event_id)
                t = totals.setdefault(key, [0, 0])
                t[0] += 1
                t[1] += amount
        if keys:
            names = sorted(totals)
            state.reducing("totals").add_many(names, [tuple(totals[k]) for k in names])
            state.list("ids", value_serializer="str").append_many(keys, ids)
        if report_dir is not None:
            from pyspark import TaskContext

            from keyedstate.common.keygroups import key_group

            ctx = cast("TaskContext", TaskContext.get())  # set inside a task
            routing = state.client.routing(state.job_id)
            report = {
                "epoch": state.batch_id,  # the Spark batch id (state.epoch is the job epoch)
                "partition": ctx.partitionId(),
                "attempt": ctx.attemptNumber(),
                "max_parallelism": routing.max_parallelism,
                "key_groups": sorted({key_group(k.encode(), routing.max_parallelism) for k in totals}),
                "finished": time.time(),
            }
            name = f"e{report['epoch']}-p{report['partition']}-t{ctx.taskAttemptId()}.json"
            tmp = os.path.join(report_dir, f".{name}.tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(report, f)
            os.replace(tmp, os.path.join(report_dir, name))

    return process


def unkeyed_input(df: Any, mode: str, parallelism: int) -> Any:
    """The batch as the shuffle-free mode meets it: every key's rows spread over ``parallelism + 1``
    partitions (one Parquet file is one partition); the keyed mode's batch unchanged."""
    return df.repartition(parallelism + 1) if mode == "shuffle_free" else df


def read_reports(report_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted(report_dir.glob("e*.json"))]


@dataclass
class Outcome:
    """How a query run ended."""

    finished: bool
    """The query terminated (by itself: AvailableNow processed every file, or with an error)."""
    error: str | None
    """The exception's text (the runtime's error, a Spark StreamingQueryException, ...), if any."""
    recorded: list[int]
    """Batch ids whose foreachBatch returned normally, i.e. Spark recorded them as done."""

    def describe(self) -> str:
        if not self.finished:
            return f"still running (batches recorded: {self.recorded})"
        if self.error is None:
            return f"finished normally (batches recorded: {self.recorded})"
        return f"stopped with an error (batches recorded: {self.recorded}): {essence(self.error)}"


@dataclass
class QueryRun:
    """One driver: a KeyedStateRuntime and its streaming query."""

    runtime: KeyedStateRuntime | None
    query: Any
    recorded: list[int] = field(default_factory=list)
    started_batches: list[int] = field(default_factory=list)
    start_error: str | None = None

    def wait(self, timeout_s: float) -> Outcome:
        """Wait for the query to end (AvailableNow ends it after the last file)."""
        if self.query is None:
            return Outcome(True, self.start_error, list(self.recorded))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.query.awaitTermination(0.5):
                    break
            except Exception as exc:  # StreamingQueryException: the query died
                return Outcome(True, _text(exc), list(self.recorded))
        else:
            return Outcome(False, None, list(self.recorded))
        failure = self.query.exception()
        return Outcome(True, _text(failure) if failure is not None else None, list(self.recorded))

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the query (a driver going away) and close its runtime."""
        if self.query is not None and self.query.isActive:
            stopper = threading.Thread(target=self._stop_quietly, daemon=True)
            stopper.start()
            stopper.join(timeout_s)
        if self.runtime is not None:
            self.runtime.close()

    def abandon(self) -> None:
        """Teardown: close the runtime first, so a foreachBatch waiting on the job fails at once, then stop."""
        if self.runtime is not None:
            self.runtime.close()
        if self.query is not None and self.query.isActive:
            stopper = threading.Thread(target=self._stop_quietly, daemon=True)
            stopper.start()
            stopper.join(60)

    def _stop_quietly(self) -> None:
        try:
            self.query.stop()
        except Exception:
            pass


_ERROR_LINE = re.compile(r"^\s*((?:[\w.]+\.)?\w+(?:Error|Exception)): (.+)$", re.M)


def essence(text: str) -> str:
    """What an error text says happened, without the Python and Java stack traces: Spark's error
    class, then the runtime's own exception (class and message) if the text holds one."""
    lines = []
    spark = re.search(r"\[(\w+)\] An error occurred in the user provided function", text) or re.search(
        r"\[(STREAM_FAILED)\]", text
    )
    if spark:
        lines.append(spark.group(1))
    matches = _ERROR_LINE.findall(text)
    ours = [m for m in matches if m[0].startswith("keyedstate.")] or [m for m in matches if "." not in m[0]] or matches
    if ours:
        lines.append(f"{ours[-1][0]}: {ours[-1][1]}"[:600])
    elif text.strip():
        lines.append(text.strip().splitlines()[0][:600])
    return " / ".join(lines)


def _text(exc: BaseException) -> str:
    # A StreamingQueryException's text holds foreachBatch's Python traceback, class names included.
    return f"{type(exc).__name__}: {exc}"


class _CrashableMiniCluster(MiniCluster):
    """A MiniCluster whose daemons can each be started with their own environment (crash points)."""

    def __init__(self, *args: Any, tm_env: dict[int, dict[str, str]] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tm_env = tm_env or {}

    def start(
        self, jm_env: Mapping[str, str] | None = None, tm_env: Mapping[int, Mapping[str, str]] | None = None
    ) -> MiniCluster:
        return super().start(jm_env, self.tm_env if tm_env is None else tm_env)

    def restart_taskmanager(self, i: int, env: dict[str, str] | None = None) -> None:
        tm: DaemonProcess = self._taskmanager(i)
        tm.start({**self._env(), **(env or {})})
        self.taskmanagers[i] = tm


class ExactlyOncePipeline:
    """The cluster, the input files, the queries (drivers) and the reference of one test."""

    def __init__(
        self,
        spark: Any,
        base_dir: Path,
        *,
        job_id: str = JOB,
        files: int = 5,
        events_per_file: int = 1000,
        keys: int = 300,
        parallelism: int = 4,
        taskmanagers: int = 2,
        slots: int = 2,
        config: dict[str, Any] | None = None,
        ha: bool = True,
        seed: int = 0,
        tm_env: dict[int, dict[str, str]] | None = None,
        jm_env: dict[str, str] | None = None,
        placement: PlacementFn | None = None,
        mode: str = "keyed",
    ) -> None:
        """``placement`` puts the daemons elsewhere than 127.0.0.1 (network-namespace hosts of the
        netns fixture: ``lambda daemon: net.placement(host_of[daemon])``).

        ``mode``: the foreach_batch mode (``keyed`` or ``shuffle_free``). The shuffle-free mode reads
        each file as :func:`unkeyed_input` spreads it, over more tasks than the job has subtasks."""
        self.spark = spark
        self.mode = mode
        self.base = Path(base_dir)
        self.job_id = job_id
        self.num_files = files
        self.parallelism = parallelism
        self.source = self.base / "events"
        self.spark_checkpoint = str(self.base / "spark-checkpoint")
        self.checkpoints_dir = (self.base / "checkpoints").as_uri()
        self.savepoints_dir = (self.base / "savepoints").as_uri()
        conf: dict[str, Any] = {
            "state.checkpoints.dir": self.checkpoints_dir,
            "state.savepoints.dir": self.savepoints_dir,
            "execution.checkpointing.incremental": "true",
            **FAST_HEARTBEATS,
        }
        if ha:
            conf.update(
                {
                    "high-availability.type": "filesystem",
                    "high-availability.storageDir": (self.base / "ha").as_uri(),
                }
            )
        conf.update(config or {})
        rnd = random.Random(seed)
        self.events: list[list[dict[str, Any]]] = [
            [
                {"key": f"k{rnd.randrange(keys):04d}", "amount": rnd.randint(1, 1000), "event_id": f"f{f}-{i}"}
                for i in range(events_per_file)
            ]
            for f in range(files)
        ]
        self.cluster = _CrashableMiniCluster(
            self.base / "cluster", taskmanagers, slots, "rocksdb", conf, tm_env=tm_env, placement=placement
        )
        self._jm_env = jm_env
        self.runs: list[QueryRun] = []
        self._client: StateClient | None = None

    # -- cluster -----------------------------------------------------------------------------
    def start(self) -> ExactlyOncePipeline:
        self.cluster.start(self._jm_env)
        self.source.mkdir(parents=True, exist_ok=True)
        return self

    @property
    def address(self) -> str:
        return self.cluster.jobmanager_address

    @property
    def client(self) -> StateClient:
        if self._client is None:
            self._client = StateClient(self.address, ClientSettings(timeout_s=30, max_attempts=4, backoff_s=0.1))
        return self._client

    def kill_taskmanager(self, i: int) -> None:
        """SIGKILL TaskManager ``i``."""
        self.cluster.taskmanagers[i].kill()

    def restart_taskmanager(self, i: int, env: dict[str, str] | None = None) -> None:
        """Start TaskManager ``i`` again (same resource id and local directory), without crash points unless given."""
        self.cluster.restart_taskmanager(i, env)

    def wait_for_dead(self, i: int, timeout_s: float = 60.0) -> None:
        """Wait until TaskManager ``i``'s process has exited (a crash point fired)."""
        tm = self.cluster.taskmanagers[i]
        deadline = time.monotonic() + timeout_s
        while tm.alive:
            if time.monotonic() > deadline:
                raise AssertionError(f"taskmanager-{i} did not die within {timeout_s:.0f} s")
            time.sleep(0.02)
        tm.kill()  # reap it and close its log

    def job_info(self, job_id: str | None = None) -> Any:
        return self.client.job_info(job_id or self.job_id)

    def wait_for_job(
        self, predicate: Callable[[Any], bool], what: str, timeout_s: float = 60.0, job_id: str | None = None
    ) -> Any:
        deadline = time.monotonic() + timeout_s
        info = None
        while True:
            try:
                info = self.job_info(job_id)
                if predicate(info):
                    return info
            except Exception:
                pass
            if time.monotonic() > deadline:
                now = (
                    (info.status, info.restarts, info.committed_epoch, info.failure_cause)
                    if info is not None
                    else "no answer"
                )
                raise AssertionError(
                    f"job {job_id or self.job_id}: {what} did not happen within {timeout_s:.0f} s; now {now}"
                )
            time.sleep(0.05)

    def statectl(self, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run the ``statectl`` console script against this cluster."""
        script = Path(sys.executable).parent / "statectl"
        command = [str(script)] if script.exists() else [sys.executable, "-m", "keyedstate.cli.statectl"]
        return subprocess.run(
            [*command, *args, "--jobmanager", self.address],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=dict(os.environ),
        )

    # -- input -------------------------------------------------------------------------------
    def write_files(self, indices: Iterable[int] | None = None) -> None:
        """Write the Parquet files ``indices`` (default all), with ascending modification times."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.source.mkdir(parents=True, exist_ok=True)
        base = time.time() - 3600
        for f in range(self.num_files) if indices is None else indices:
            path = self.source / f"part-{f:03d}.parquet"
            tmp = self.source / f".part-{f:03d}.parquet.tmp"
            pq.write_table(
                pa.Table.from_pylist(
                    self.events[f],
                    schema=pa.schema([("key", pa.string()), ("amount", pa.int64()), ("event_id", pa.string())]),
                ),
                tmp,
            )
            os.utime(tmp, (base + f, base + f))
            os.replace(tmp, path)

    # -- drivers -----------------------------------------------------------------------------
    def runtime(self, parallelism: int | None = None, **kwargs: Any) -> KeyedStateRuntime:
        """A driver's runtime: submits the job (or re-attaches to it), as the README's recipe does."""
        return KeyedStateRuntime(self.address, self.job_id, operators(parallelism or self.parallelism), **kwargs)

    def start_query(
        self,
        *,
        parallelism: int | None = None,
        before_batch: Callable[[int, QueryRun], None] | None = None,
        after_batch: Callable[[int, QueryRun], None] | None = None,
        report_dir: Path | None = None,
        runtime: KeyedStateRuntime | None = None,
    ) -> QueryRun:
        """Start a driver on the pipeline's checkpointLocation. An error building the runtime
        (the job submission) is kept in the returned run, as a driver would report it."""
        try:
            rt = runtime or self.runtime(parallelism)
        except Exception as exc:
            run = QueryRun(None, None, start_error=_text(exc))
            self.runs.append(run)
            return run
        run = QueryRun(rt, None)
        self.runs.append(run)
        inner = rt.foreach_batch(
            make_process(str(report_dir) if report_dir else None), key_col="key", operator=OPERATOR, mode=self.mode
        )
        mode, parallelism = self.mode, parallelism or self.parallelism

        def on_batch(df: Any, batch_id: int) -> None:
            run.started_batches.append(batch_id)
            if before_batch is not None:
                before_batch(batch_id, run)
            inner(unkeyed_input(df, mode, parallelism), batch_id)
            run.recorded.append(batch_id)
            if after_batch is not None:
                after_batch(batch_id, run)

        stream = self.spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(self.source))
        run.query = (
            stream.writeStream.foreachBatch(on_batch)
            .trigger(availableNow=True)
            .option("checkpointLocation", self.spark_checkpoint)
            .start()
        )
        return run

    def run(self, timeout_s: float = 120.0, **kwargs: Any) -> Outcome:
        """Start a driver and wait for its query to end."""
        run = self.start_query(**kwargs)
        outcome = run.wait(timeout_s)
        if run.runtime is not None:
            run.stop()
        return outcome

    # -- state and the reference ---------------------------------------------------------------
    def write_ballast(self, megabytes: int, value_kib: int = 128, job_id: str | None = None) -> None:
        """Fill the ``ballast`` state directly (outside any epoch) with incompressible bytes."""
        handle: ValueState[str, bytes] = ValueState(
            self.client, job_id or self.job_id, OPERATOR, "ballast", value_serializer="bytes"
        )
        count = megabytes * 1024 // value_kib
        rnd = random.Random(12345)
        for start in range(0, count, 64):
            keys = [f"ballast-{i:06d}" for i in range(start, min(count, start + 64))]
            handle.put_many(keys, [rnd.randbytes(value_kib * 1024) for _ in keys])

    def read_state(
        self, job_id: str | None = None, attempts: int = 5
    ) -> dict[str, tuple[tuple[int, int] | None, list[str]]]:
        """Every key the job serves: (count, sum) and its event ids.

        Read while the job is RUNNING under one routing version; a read that a redeployment
        (failover, periodic-checkpoint failure) overlapped is done again.
        """
        job_id = job_id or self.job_id
        for attempt in range(1, attempts + 1):
            # Overlapped commits apply behind the driver: read once every slot applied the last decided epoch.
            self.wait_for_job(
                lambda i: i.status == pb.JOB_STATUS_RUNNING and i.applied_epoch == i.committed_epoch,
                "RUNNING with its last epoch applied (to read its state)",
                60,
                job_id=job_id,
            )
            try:
                before = self.client.routing(job_id, refresh=True).version
                state = self._read_state_once(job_id)
                if self.client.routing(job_id, refresh=True).version == before:
                    return state
            except (StaleRoutingError, UnavailableError, JobStateError):
                if attempt == attempts:
                    raise
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} was redeployed during each of {attempts} reads of its state")

    def _read_state_once(self, job_id: str) -> dict[str, tuple[tuple[int, int] | None, list[str]]]:
        client = self.client
        totals: ReducingState[str] = ReducingState(client, job_id, OPERATOR, "totals")
        ids: ListState[str, str] = ListState(client, job_id, OPERATOR, "ids", value_serializer="str")
        keys = sorted(set(totals.keys()) | set(ids.keys()) | {e["key"] for f in self.events for e in f})
        got_totals = totals.get_many(keys)
        got_ids = ids.get_many(keys)
        return {
            k: (tuple(t) if t is not None else None, list(i or []))
            for k, t, i in zip(keys, got_totals, got_ids)
            if t is not None or i
        }

    def reference(self, files: Iterable[int]) -> dict[str, tuple[tuple[int, int], list[str]]]:
        ref: dict[str, tuple[list[int], list[str]]] = {}
        for f in files:
            for e in self.events[f]:
                t, ids = ref.setdefault(e["key"], ([0, 0], []))
                t[0] += 1
                t[1] += e["amount"]
                ids.append(e["event_id"])
        return {k: ((t[0], t[1]), ids) for k, (t, ids) in ref.items()}

    def diff(self, files: Iterable[int] | None = None, job_id: str | None = None) -> str | None:
        """None if the state equals the reference of exactly ``files`` (default: all); else what differs."""
        files = sorted(range(self.num_files) if files is None else files)
        expected = self.reference(files)
        actual = self.read_state(job_id)
        want = Counter((k, i) for k, (_, ids) in expected.items() for i in ids)
        got = Counter((k, i) for k, (_, ids) in actual.items() for i in ids)
        lost = want - got
        extra = got - want
        per_file: dict[int, Counter[str]] = {}
        for (_, i), n in lost.items():
            per_file.setdefault(file_of(i), Counter())["lost"] += n
        for (k, i), n in extra.items():
            kind = "doubled" if (k, i) in want else "unexpected"
            per_file.setdefault(file_of(i), Counter())[kind] += n
        wrong = sorted(
            k
            for k in set(expected) | set(actual)
            if (actual.get(k, (None, []))[0], sorted(actual.get(k, (None, []))[1]))
            != (expected.get(k, (None, []))[0], sorted(expected.get(k, (None, []))[1]))
        )
        if not wrong and not lost and not extra:
            return None
        events = sum(want.values())
        doubled = sum(n for (k, i), n in extra.items() if (k, i) in want)
        unexpected = sum(extra.values()) - doubled
        batches = "; ".join(
            f"file {f} (batch {f}): " + ", ".join(f"{n} {kind}" for kind, n in sorted(c.items()))
            for f, c in sorted(per_file.items())
        )
        examples = [(k, actual.get(k, (None, []))[0], expected.get(k, (None, []))[0]) for k in wrong[:3]]
        return (
            f"state differs from the reference of files {files}: {sum(lost.values())} of {events} events lost, "
            f"{doubled} doubled, {unexpected} applied that the reference does not hold; per file: {batches or '-'}; "
            f"{len(wrong)} of {len(set(expected) | set(actual))} keys wrong, e.g. (key, served (count, sum), "
            f"expected) {examples}"
        )

    def describe_state(self, files: Iterable[int] | None = None) -> str:
        """For failure messages: the diff against the reference of ``files``, or why the state cannot be read."""
        try:
            info = self.job_info()
            if info.status in (pb.JOB_STATUS_CANCELED, pb.JOB_STATUS_FAILED):
                return f"not served: job {info.status} ({info.failure_cause or '-'})"
            return self.diff(files) or "exactly the reference"
        except Exception as exc:  # only ever part of a message about another failure
            return f"unreadable: {type(exc).__name__}: {exc}"

    # -- teardown ----------------------------------------------------------------------------
    def close(self) -> None:
        for run in self.runs:
            try:
                run.abandon()
            except Exception:
                pass
        if self._client is not None:
            self._client.close()
        self.cluster.kill_all()
