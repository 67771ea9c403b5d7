"""The example pipeline's logic: sessionized per-user aggregates, and its plain-Python reference.

Per user the pipeline keeps, in the ``sessions`` operator:

* ``session`` (value, TTL 1 day): the open session ``{"start", "last", "events"}``
* ``closed`` (list): every closed session ``{"start", "end", "events"}``
* ``kinds`` (map): events per event kind
* ``totals`` (reducing: count, amount): a server-side sum, one blind call per user and batch
* ``timers``: one event-time timer per open session, at ``last + GAP_MS``

A session closes when a user is idle for more than ``GAP_MS``: when the event-time watermark
passes ``last + GAP_MS`` its timer fires (:func:`on_timer`) and moves it to ``closed``, without
waiting for the user's next event. An event that arrives more than ``GAP_MS`` after the last one
while the watermark still lags behind closes the session on the spot, as before; either way the
closed session is the same.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from keyedstate.common.client import TimeDomain, Timer, timers_state
from keyedstate.common.descriptors import (
    OperatorSpec,
    ReduceField,
    StateDescriptor,
    StateKind,
    TtlConfig,
)

GAP_MS = 30 * 60 * 1000
WATERMARK_DELAY_MS = 60 * 1000
"""How far the watermark trails the largest event time (``withWatermark(..., "1 minute")``)."""
KINDS = ("view", "click", "cart", "buy")

OPERATORS = [
    OperatorSpec(
        "sessions",
        4,
        (
            StateDescriptor("session", StateKind.VALUE, TtlConfig(24 * 3600 * 1000)),
            StateDescriptor("closed", StateKind.LIST),
            StateDescriptor("kinds", StateKind.MAP),
            StateDescriptor("totals", StateKind.REDUCING, reduce_fields=(ReduceField("count"), ReduceField("amount"))),
            timers_state(),
        ),
    ),
]


def generate_events(
    directory: Path, files: int, events_per_file: int, users: int, seed: int = 42
) -> list[dict[str, Any]]:
    """Write ``files`` Parquet files of events in time order; return every event."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rnd = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    ts = 1_700_000_000_000
    everything: list[dict[str, Any]] = []
    for f in range(files):
        rows = []
        for _ in range(events_per_file):
            ts += rnd.randint(0, 2_000)
            rows.append(
                {
                    "user": f"u{rnd.randrange(users):05d}",
                    "ts": ts,
                    "kind": rnd.choice(KINDS),
                    "amount": rnd.randint(1, 10_000),
                }
            )
        pq.write_table(pa.Table.from_pylist(rows), directory / f"events-{f:03d}.parquet")
        everything.extend(rows)
    return everything


def _sessionize(
    state: dict[str, Any] | None, events: list[dict[str, Any]], closed: list[dict[str, Any]]
) -> dict[str, Any]:
    for e in events:
        if state is not None and e["ts"] - state["last"] > GAP_MS:
            closed.append({"start": state["start"], "end": state["last"], "events": state["events"]})
            state = None
        if state is None:
            state = {"start": e["ts"], "last": e["ts"], "events": 0}
        state["last"] = e["ts"]
        state["events"] += 1
    assert state is not None
    return state


def process_partition(batches: Iterator[Any], state: Any) -> None:
    """Runs on an executor for one Spark partition of one micro-batch."""
    by_user: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for batch in batches:
        for row in batch.to_pylist():
            by_user[row["user"]].append(row)
    if not by_user:
        return
    users = sorted(by_user)
    session = state.value("session", value_serializer="json")
    closed_list = state.list("closed", value_serializer="json")
    kinds = state.map("kinds", value_serializer="int")
    totals = state.reducing("totals")

    timers = state.timers()

    current = session.get_many(users)
    # The open sessions' timers move to their new ends below.
    reopened = [(u, s["last"] + GAP_MS) for u, s in zip(users, current) if s is not None]
    timers.delete_many(TimeDomain.EVENT_TIME, [u for u, _ in reopened], [t for _, t in reopened])
    new_sessions, closed_keys, closed_values = [], [], []
    kind_keys, kind_names, kind_deltas = [], [], []
    operands = []
    for user, open_session in zip(users, current):
        events = sorted(by_user[user], key=lambda e: e["ts"])
        closed: list[dict[str, Any]] = []
        new_sessions.append(_sessionize(open_session, events, closed))
        closed_keys += [user] * len(closed)
        closed_values += closed
        counts: dict[str, int] = defaultdict(int)
        for e in events:
            counts[e["kind"]] += 1
        for kind, n in sorted(counts.items()):
            kind_keys.append(user)
            kind_names.append(kind)
            kind_deltas.append(n)
        operands.append((len(events), sum(e["amount"] for e in events)))
    session.put_many(users, new_sessions)
    timers.register_many(TimeDomain.EVENT_TIME, users, [s["last"] + GAP_MS for s in new_sessions])
    if closed_keys:
        closed_list.append_many(closed_keys, closed_values)
    existing = kinds.get_many(kind_keys, kind_names)
    kinds.put_many(kind_keys, kind_names, [(old or 0) + d for old, d in zip(existing, kind_deltas)])
    totals.add_many(users, operands)


def on_timer(fired: Iterator[Timer[str]], state: Any) -> None:
    """The watermark passed ``last + GAP_MS`` of these users' sessions: close them."""
    timers = list(fired)
    users = [t.key for t in timers]
    session = state.value("session", value_serializer="json")
    current = session.get_many(users)
    closed_keys, closed_values = [], []
    for timer, open_session in zip(timers, current):
        # Every session change moves its timer, so a firing timer always belongs to the open session.
        if open_session is None or open_session["last"] + GAP_MS != timer.timestamp_ms:
            raise RuntimeError(f"timer {timer} fired for user {timer.key!r} whose open session is {open_session}")
        closed_keys.append(timer.key)
        closed_values.append(
            {"start": open_session["start"], "end": open_session["last"], "events": open_session["events"]}
        )
    state.list("closed", value_serializer="json").append_many(closed_keys, closed_values)
    session.clear_many(users)


def reference(events: Iterable[dict[str, Any]], watermark_ms: int) -> dict[str, dict[str, Any]]:
    """The same aggregates computed in one pass of plain Python; sessions whose timer the final
    watermark ``watermark_ms`` passed are closed (``session`` None)."""
    by_user: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_user[e["user"]].append(e)
    result = {}
    for user, evs in by_user.items():
        evs.sort(key=lambda e: e["ts"])
        closed: list[dict[str, Any]] = []
        session: dict[str, Any] | None = _sessionize(None, evs, closed)
        assert session is not None
        if session["last"] + GAP_MS <= watermark_ms:
            closed.append({"start": session["start"], "end": session["last"], "events": session["events"]})
            session = None
        kinds: dict[str, int] = defaultdict(int)
        for e in evs:
            kinds[e["kind"]] += 1
        result[user] = {
            "session": session,
            "closed": closed,
            "kinds": dict(kinds),
            "totals": (len(evs), sum(e["amount"] for e in evs)),
        }
    return result
