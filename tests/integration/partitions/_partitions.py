"""Helpers of the partition tests: writers that record every acknowledged write, a job monitor
that times the failover, the event workload with its plain-Python reference, and verification
that reports lost and doubled items with numbers.

Everything here goes through the public client API (``StateClient``, the state handles,
``job_info``, ``routing``) and ``KeyedStateRuntime.foreach_batch``; nothing reads daemon internals.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keyedstate.common.client import ClientSettings, ListState, ReducingState, Routing, StateClient, status_name
from keyedstate.common.descriptors import OperatorSpec, ReduceField, StateDescriptor, StateKind
from keyedstate.common.errors import KeyedStateError
from keyedstate.common.keygroups import key_group

logger = logging.getLogger(__name__)

OPERATOR = "agg"
EVENTS = "events"
TOTALS = "totals"

# Heartbeats fast enough that a cut is noticed within seconds (the brief's 300 ms / 3 s);
# checkpoints often, so that a failover restores recent state.
PARTITION_CONFIG = {
    "heartbeat.interval": "300 ms",
    "heartbeat.timeout": "3 s",
    "execution.checkpointing.interval": "1 s",
    "restart-strategy.type": "fixed-delay",
    "restart-strategy.fixed-delay.attempts": "10",
    "restart-strategy.fixed-delay.delay": "100 ms",
}


def operators(parallelism: int = 2) -> list[OperatorSpec]:
    """One operator with a ListState of event ids and a ReducingState of (count, sum)."""
    return [
        OperatorSpec(
            OPERATOR,
            parallelism,
            (
                StateDescriptor(EVENTS, StateKind.LIST),
                StateDescriptor(TOTALS, StateKind.REDUCING, reduce_fields=(ReduceField("count"), ReduceField("sum"))),
            ),
        )
    ]


def subtask_of(routing: Routing, key: str) -> int:
    """The subtask owning ``key`` (a ``str`` key: its UTF-8 bytes are hashed, as the client does)."""
    return routing.operator(OPERATOR).subtask_of[key_group(key.encode(), routing.max_parallelism)]


def keys_by_subtask(routing: Routing, keys: list[str]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for k in keys:
        out.setdefault(subtask_of(routing, k), []).append(k)
    return out


def taskmanager_of(client: StateClient, job_id: str, subtask: int) -> tuple[str, str]:
    """(TaskManager id, address) hosting ``subtask`` of the job, as the JobManager reports its slots."""
    for tm in client.cluster().taskmanagers:
        if any(s.job_id == job_id and s.subtask_index == subtask for s in tm.slots):
            return tm.taskmanager_id, tm.address
    raise AssertionError(f"no TaskManager hosts subtask {subtask} of {job_id}")


def fast_client(address: str) -> StateClient:
    """A client that gives up within a few seconds (the writers carry on with the next batch)."""
    return StateClient(address, ClientSettings(timeout_s=5.0, max_attempts=5, backoff_s=0.05))


# -- the job's failover, as a client sees it --------------------------------------------------------


@dataclass(frozen=True)
class Observation:
    at: float
    status: str
    restarts: int
    routing_version: int
    addresses: tuple[str, ...]


class JobMonitor:
    """Polls ``job_info`` and the routing table (refreshed) every ``interval_s`` on a thread of its own."""

    def __init__(self, address: str, job_id: str, interval_s: float = 0.02) -> None:
        self.client = fast_client(address)
        self.job_id = job_id
        self.interval_s = interval_s
        self.observations: list[Observation] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="job-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                info = self.client.job_info(self.job_id)
                routing = self.client.routing(self.job_id, refresh=True)
                # The status comes with the table it belongs to: job_info and the routing are two
                # calls, and a failover can start between them.
                ob = Observation(
                    time.monotonic(),
                    routing.job_status,
                    info.restarts,
                    routing.version,
                    routing.operator(OPERATOR).addresses,
                )
                last = self.observations[-1] if self.observations else None
                # Only changes are kept: the first sighting of each state is the moment that matters.
                if last is None or (ob.status, ob.restarts, ob.routing_version, ob.addresses) != (
                    last.status,
                    last.restarts,
                    last.routing_version,
                    last.addresses,
                ):
                    logger.info(
                        "monitor: %s restarts=%d routing v%d %s",
                        ob.status,
                        ob.restarts,
                        ob.routing_version,
                        ob.addresses,
                    )
                    self.observations.append(ob)
            except KeyedStateError:
                pass  # the JobManager is reachable from here throughout; a slow answer is retried
            self._stop.wait(self.interval_s)

    def latest(self) -> Observation | None:
        return self.observations[-1] if self.observations else None

    def wait_running_after(self, version: int, timeout_s: float) -> Observation:
        """The first observation of the job RUNNING under a routing version above ``version``.

        Its ``at`` is when this test first saw the new deployment serving: every call started
        after it goes to a deployment that already restored its checkpoint.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for ob in list(self.observations):
                if ob.status == "RUNNING" and ob.routing_version > version:
                    return ob
            time.sleep(self.interval_s)
        raise AssertionError(
            f"job {self.job_id} did not run again above routing v{version} within {timeout_s:.0f} s; "
            f"last seen {self.latest()}"
        )

    def changes_after(self, t: float) -> list[Observation]:
        return [ob for ob in self.observations if ob.at > t]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.client.close()


# -- direct mode: writers that record what was acknowledged ---------------------------------------


@dataclass(frozen=True)
class Append:
    """One acknowledged ``append_many`` call, as its writer saw it."""

    events: tuple[str, ...]
    subtasks: tuple[int, ...]
    sent: float
    acked: float
    routing_version: int
    """The version of the writer's cached routing table the call was (last) sent under."""
    served_by: tuple[str, ...]
    """The TaskManager address of each subtask the call went to, from that routing table."""


class AppendWriter:
    """Appends unique event ids to ``keys`` through its own StateClient (its own cached routing),
    like one Spark executor whose partition holds those keys; records every acknowledged call."""

    def __init__(
        self, name: str, address: str, job_id: str, keys: list[str], *, batch: int = 10, pause_s: float = 0.02
    ) -> None:
        self.name = name
        self.job_id = job_id
        self.keys = keys
        self.batch = batch
        self.pause_s = pause_s
        self.client = fast_client(address)
        self.events: ListState[str, str] = ListState(
            self.client, job_id, OPERATOR, EVENTS, key_serializer="str", value_serializer="str"
        )
        self.acked: list[Append] = []
        self.failed: list[tuple[float, str]] = []
        self.attempted: dict[str, str] = {}  # event id -> key, for every event sent (acknowledged or not)
        self._seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"writer-{name}", daemon=True)

    def start(self) -> AppendWriter:
        self.client.routing(self.job_id)  # the cache every later call uses until an error refreshes it
        self._thread.start()
        return self

    def _run(self) -> None:
        cursor = 0
        while not self._stop.is_set():
            keys = [self.keys[(cursor + i) % len(self.keys)] for i in range(min(self.batch, len(self.keys)))]
            cursor += len(keys)
            ids = [f"{self.name}-{self._seq + i}" for i in range(len(keys))]
            self._seq += len(keys)
            self.attempted.update(zip(ids, keys))
            sent = time.monotonic()
            try:
                self.events.append_many(keys, ids)
            except KeyedStateError as exc:
                self.failed.append((sent, f"{type(exc).__name__}: {exc.message[:160]}"))
                self._stop.wait(0.1)
                continue
            acked = time.monotonic()
            # This writer alone uses its client, so the cached table is the one the last try used.
            routing = self.client.routing(self.job_id)
            subtasks = tuple(sorted({subtask_of(routing, k) for k in keys}))
            addresses = routing.operator(OPERATOR).addresses
            self.acked.append(
                Append(tuple(ids), subtasks, sent, acked, routing.version, tuple(addresses[s] for s in subtasks))
            )
            self._stop.wait(self.pause_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), f"writer {self.name} did not stop"
        self.client.close()


def read_lists(address: str, job_id: str, keys: list[str]) -> dict[str, list[str]]:
    """Every key's event list, through a fresh client (fresh routing)."""
    with fast_client(address) as client:
        client.routing(job_id, refresh=True)
        events: ListState[str, str] = ListState(
            client, job_id, OPERATOR, EVENTS, key_serializer="str", value_serializer="str"
        )
        values = events.get_many(keys)
    return dict(zip(keys, values))


def direct_mode_report(
    writers: list[AppendWriter],
    final: dict[str, list[str]],
    running: Observation,
    cut_at: float,
    healed_at: float,
    victim: tuple[str, str],
    restarts: int,
    expected_restarts: int | None = 1,
) -> str:
    """What went wrong, with numbers; "" when every append acknowledged after the failover survived
    exactly once and no TaskManager but the new owner acknowledged a write after it.

    ``running`` is the deployment that must keep every append acknowledged after it (with several
    failovers, the last one); ``expected_restarts=None`` skips the check of the restart count."""
    served = Counter(e for values in final.values() for e in values)
    acked_after = [a for w in writers for a in w.acked if a.sent > running.at]
    events_after = [e for a in acked_after for e in a.events]
    lost = [e for e in events_after if served[e] == 0]
    doubled = sorted(e for e, n in served.items() if n > 1)
    sent = {e for w in writers for e in w.attempted}
    unexpected = sorted(e for e in served if e not in sent)
    # Two owners: after the new deployment ran, a call acknowledged by an address that the new
    # routing table does not give for that subtask.
    deposed = [a for a in acked_after if any(addr != running.addresses[s] for s, addr in zip(a.subtasks, a.served_by))]
    deposed_events = sum(len(a.events) for a in deposed)
    lost_deposed = sum(1 for a in deposed for e in a.events if served[e] == 0)
    problems = []
    if lost:
        by_writer = Counter(e.rsplit("-", 1)[0] for e in lost)
        problems.append(
            f"{len(lost)} of {len(events_after)} list appends acknowledged after the failover completed are missing "
            f"after the heal (by writer: {dict(sorted(by_writer.items()))}; e.g. {lost[:3]})"
        )
    if doubled:
        problems.append(f"{len(doubled)} events are stored twice or more (e.g. {doubled[:3]})")
    if unexpected:
        problems.append(f"{len(unexpected)} stored events were never written (e.g. {unexpected[:3]})")
    if deposed:
        first = min(a.acked for a in deposed) - running.at
        last = max(a.acked for a in deposed) - running.at
        versions = sorted({a.routing_version for a in deposed})
        problems.append(
            f"two owners: the deposed TaskManager {victim[0]} ({victim[1]}) acknowledged {len(deposed)} calls "
            f"({deposed_events} appends, {lost_deposed} of them lost) under routing v{versions} from {first:+.1f} s to "
            f"{last:+.1f} s after routing v{running.routing_version} was RUNNING "
            f"(the partition healed at {healed_at - running.at:+.1f} s)"
        )
    if expected_restarts is not None and restarts != expected_restarts:
        problems.append(f"the job restarted {restarts} times (expected {expected_restarts})")
    if not problems:
        return ""
    calls = [a for w in writers for a in w.acked]
    return (
        "; ".join(problems) + f". Timeline: cut at 0.0 s, new deployment (routing v{running.routing_version}) "
        f"RUNNING at {running.at - cut_at:.1f} s, healed at {healed_at - cut_at:.1f} s; "
        f"{len(calls)} calls ({sum(len(a.events) for a in calls)} appends) acknowledged in all, "
        f"{sum(len(w.failed) for w in writers)} failed"
    )


# -- epoch mode: the event workload and its reference ----------------------------------------------


@dataclass(frozen=True)
class Event:
    user: str
    amount: int
    event_id: str
    batch: int


def make_events(files: int, per_file: int, users: int, seed: int = 11) -> list[list[Event]]:
    """``files`` batches of events; ids ``b<batch>-<i>`` are unique, so a doubled or lost one shows."""
    rnd = random.Random(seed)
    return [
        [Event(f"u{rnd.randrange(users):03d}", rnd.randint(1, 1000), f"b{b:02d}-{i:04d}", b) for i in range(per_file)]
        for b in range(files)
    ]


def write_parquet_files(directory: Path, batches: list[list[Event]]) -> None:
    """One Parquet file per batch; modification times one second apart, so the file source reads
    them in order and batch ``b`` of the query is file ``b`` (``maxFilesPerTrigger=1``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    base = time.time() - len(batches) - 10
    for b, events in enumerate(batches):
        path = directory / f"part-{b:03d}.parquet"
        pq.write_table(
            pa.Table.from_pylist([{"user": e.user, "amount": e.amount, "event_id": e.event_id} for e in events]), path
        )
        os.utime(path, (base + b, base + b))


@dataclass
class KeyState:
    count: int = 0
    total: int = 0
    events: Counter[str] = field(default_factory=Counter)


def reference(batches: list[list[Event]]) -> dict[str, KeyState]:
    """Every event applied exactly once: per user (count, sum of amounts, multiset of event ids)."""
    ref: dict[str, KeyState] = {}
    for events in batches:
        for e in events:
            s = ref.setdefault(e.user, KeyState())
            s.count += 1
            s.total += e.amount
            s.events[e.event_id] += 1
    return ref


def process_events(batches: Iterator[Any], state: Any) -> None:
    """The ``foreach_batch`` body (runs on executors): per event, (1, amount) into the ReducingState
    and the event id appended to the ListState."""
    users: list[str] = []
    amounts: list[int] = []
    ids: list[str] = []
    for batch in batches:
        cols = batch.to_pydict()
        users += cols["user"]
        amounts += cols["amount"]
        ids += cols["event_id"]
    if not users:
        return
    state.reducing(TOTALS).add_many(users, [(1, a) for a in amounts])
    state.list(EVENTS, value_serializer="str").append_many(users, ids)


def read_state(address: str, job_id: str, users: list[str]) -> dict[str, KeyState]:
    """What the runtime serves for ``users``, through a fresh client."""
    with fast_client(address) as client:
        client.routing(job_id, refresh=True)
        totals_state: ReducingState[str] = ReducingState(client, job_id, OPERATOR, TOTALS, key_serializer="str")
        totals = totals_state.get_many(users)
        events: ListState[str, str] = ListState(
            client, job_id, OPERATOR, EVENTS, key_serializer="str", value_serializer="str"
        )
        lists = events.get_many(users)
    out = {}
    for u, t, ids in zip(users, totals, lists):
        count, total = (int(t[0]), int(t[1])) if t is not None else (0, 0)
        out[u] = KeyState(count, total, Counter(ids))
    return out


@dataclass(frozen=True)
class BatchRecord:
    """One ``foreachBatch`` call as the driver saw it return."""

    batch_id: int
    started: float
    finished: float
    checkpoint_status: str
    checkpoint_id: int
    routing_version: int


def epoch_mode_report(
    expected: dict[str, KeyState],
    actual: dict[str, KeyState],
    batches: list[list[Event]],
    records: list[BatchRecord],
    running: Observation | None,
    cut_at: float,
    query_restarts: Sequence[str] = (),
    owner_before: dict[str, str] | None = None,
) -> str:
    """Exact comparison with the reference: "" when every key's count, sum and event multiset match.

    ``owner_before`` (user -> TaskManager id before the cut) splits the lost events by their
    key's owner at the start."""
    lost: list[str] = []
    doubled: list[str] = []
    wrong_keys: list[str] = []
    lost_by_owner: Counter[str] = Counter()
    for user, want in expected.items():
        got = actual.get(user, KeyState())
        if (got.count, got.total, got.events) != (want.count, want.total, want.events):
            wrong_keys.append(user)
        missing = list((want.events - got.events).elements())
        lost += missing
        lost_by_owner[(owner_before or {}).get(user, "?")] += len(missing)
        doubled += list((got.events - want.events).elements())
    if not wrong_keys and not lost and not doubled:
        if query_restarts:
            logger.warning("the query was restarted %d times: %s", len(query_restarts), query_restarts)
        return ""
    batch_of = {e.event_id: e.batch for events in batches for e in events}
    lost_batches = Counter(batch_of.get(e, -1) for e in lost)
    completed = {r.batch_id for r in records if r.checkpoint_status == "COMPLETED"}
    acked_lossy = sorted(b for b in lost_batches if b in completed)
    count_diff = sum(actual.get(u, KeyState()).count for u in expected) - sum(s.count for s in expected.values())
    timeline = ""
    if running is not None:
        after = [r.batch_id for r in records if r.started > running.at]
        timeline = (
            f"; cut before batch {min((r.batch_id for r in records if r.finished > cut_at), default='?')}, "
            f"job RUNNING again (routing v{running.routing_version}) {running.at - cut_at:.1f} s after the cut, "
            f"{len(after)} batches started after that"
        )
    if query_restarts:
        timeline += f"; the query was restarted from its checkpoint location after: {query_restarts}"
    owners = f" (by the key's owner before the cut: {dict(sorted(lost_by_owner.items()))})" if owner_before else ""
    return (
        f"{len(wrong_keys)} of {len(expected)} keys differ from the reference; {len(lost)} of "
        f"{sum(len(b) for b in batches)} events lost{owners}, {len(doubled)} doubled (counts off by {count_diff:+d}); "
        f"{len(acked_lossy)} epochs acknowledged with a COMPLETED checkpoint miss events: "
        f"{ {b: lost_batches[b] for b in acked_lossy} } (lost events per epoch){timeline}; "
        f"e.g. key {wrong_keys[0] if wrong_keys else '?'}: served "
        f"{_short(actual.get(wrong_keys[0], KeyState())) if wrong_keys else ''}, expected "
        f"{_short(expected[wrong_keys[0]]) if wrong_keys else ''}"
    )


def _short(s: KeyState) -> str:
    return f"count={s.count} sum={s.total} events={sum(s.events.values())}"


class StreamingRun:
    """A Structured Streaming query over the Parquet files, through ``KeyedStateRuntime.foreach_batch``,
    run until every file is processed (``availableNow``).

    When the query stops with an error it is started again from its checkpoint location on a
    new runtime attached to the same job: the restart recipe of the README. Each restart's cause
    is kept in :attr:`restarts`; every returned ``foreachBatch`` call in :attr:`records`.
    """

    def __init__(
        self, spark: Any, address: str, job_id: str, source: Path, checkpoint_dir: Path, parallelism: int = 2
    ) -> None:
        self.spark = spark
        self.address = address
        self.job_id = job_id
        self.source = source
        self.checkpoint_dir = checkpoint_dir
        self.parallelism = parallelism
        self.records: list[BatchRecord] = []
        self.restarts: list[str] = []
        self.runtime: Any = None
        self.query: Any = None

    def attach(self) -> Any:
        """A runtime for the job (submitting it the first time); closes the previous one."""
        from keyedstate.common.spark import KeyedStateRuntime

        if self.runtime is not None:
            self.runtime.close()
        self.runtime = KeyedStateRuntime(self.address, self.job_id, operators(self.parallelism))
        return self.runtime

    def _start(self) -> Any:
        runtime = self.runtime if self.runtime is not None else self.attach()
        on_batch = runtime.foreach_batch(process_events, key_col="user", operator=OPERATOR)

        def recorded(df: Any, batch_id: int) -> None:
            started = time.monotonic()
            on_batch(df, batch_id)
            cp = runtime.last_checkpoint
            version = runtime.client.routing(self.job_id).version
            self.records.append(
                BatchRecord(
                    batch_id,
                    started,
                    time.monotonic(),
                    status_name(cp.status) if cp is not None else "",
                    cp.checkpoint_id if cp is not None else 0,
                    version,
                )
            )

        stream = (
            self.spark.readStream.schema("user string, amount long, event_id string")
            .option("maxFilesPerTrigger", 1)
            .parquet(str(self.source))
        )
        return (
            stream.writeStream.foreachBatch(recorded)
            .option("checkpointLocation", str(self.checkpoint_dir))
            .trigger(availableNow=True)
            .start()
        )

    @property
    def active(self) -> bool:
        return self.query is not None and self.query.isActive

    def run(self, timeout_s: float, max_restarts: int = 3) -> None:
        """Run to the end of the files; AssertionError after ``timeout_s`` or ``max_restarts`` restarts."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.query = self._start()
            try:
                finished = self.query.awaitTermination(max(1.0, deadline - time.monotonic()))
                error = self.query.exception()
            except Exception as exc:  # a failed query raises from awaitTermination
                finished, error = True, exc
            if not finished:
                self.query.stop()
                raise AssertionError(
                    f"the query did not finish within {timeout_s:.0f} s "
                    f"({len(self.records)} batches returned; restarts: {self.restarts})"
                )
            if error is None:
                return
            cause = str(error).strip().splitlines()
            self.restarts.append(
                next((line for line in reversed(cause) if "Error" in line), cause[0] if cause else "")[:300]
            )
            logger.warning("query failed (%s); starting it again from its checkpoint location", self.restarts[-1])
            if len(self.restarts) > max_restarts:
                raise AssertionError(f"the query failed {len(self.restarts)} times: {self.restarts}")
            self.attach()

    def stop(self) -> None:
        if self.active:
            self.query.stop()
        if self.runtime is not None:
            self.runtime.close()
