"""The session logic, and the code Spark's Python workers run (shipped by value: executors cannot import ``bench``).

:func:`advance` is the one per-user step every variant runs: ours on the partition's users in
bulk, ``transformWithStateInPandas`` and ``applyInPandasWithState`` once per user and batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

GAP_S = 1800  # bench.w2.data.GAP_S (this module cannot import bench on an executor)
CLOSED_DDL = "user long, start long, count long, duration long"
OPERATOR = "w2"
SESSION = "session"  # ValueState: (start, last event time, count) of the open session
TIMES = "times"  # ListState: the open session's event times, in time order

Session = tuple[int, int, int]  # the open session of a user: (start, last event time, count)
Closed = tuple[int, int, int]  # (start, count, duration_s) of one closed session of a user


def advance(session: Session | None, new: list[int], gap: int = GAP_S) -> tuple[Session, list[Closed], int | None]:
    """One user's session after its ``new`` events (sorted by time) arrive.

    ``session``: the open session, None when the user has none. Returns the open session
    afterwards, the sessions the new events closed (in order), and how the session's list of
    times changes: None when the open session went on (append all of ``new``), else the index
    in ``new`` where the open session now starts (the list becomes ``new[index:]``).

    The step reads only the ValueState: the list of times is written (appended, or replaced when
    a session closes) and never read back here, as a sessionization keeps its accumulator in a
    value and the events in a list.
    """
    closed: list[Closed] = []
    tail: int | None = None
    if session is None:
        start, last, count, tail = new[0], new[0], 0, 0
    else:
        start, last, count = session
    for i, t in enumerate(new):
        if t - last > gap:
            closed.append((start, count, last - start))
            start, count, tail = t, 0, i
        count += 1
        last = t
    return (start, last, count), closed, tail


def _closed_batch(users: list[int], closed: list[Closed]) -> Any:
    import pyarrow as pa

    starts, counts, durations = zip(*closed) if closed else ((), (), ())
    return pa.RecordBatch.from_pydict(
        {"user": users, "start": list(starts), "count": list(counts), "duration": list(durations)},
        schema=closed_schema(),
    )


def closed_schema() -> Any:
    import pyarrow as pa

    return pa.schema([(c, pa.int64()) for c in ("user", "start", "count", "duration")])


# -- ours --------------------------------------------------------------------------------------
def sessionize_partition(batches: Iterable[Any], state: Any) -> Any:
    """A keyed partition of a micro-batch: every event of its users, sessionized against their state.

    Bulk calls only: one multi-get of the partition's users' sessions, then one clear of the
    lists of the sessions that closed, one append of the events, and one put of the sessions. Returns the closed sessions as one RecordBatch (None
    when the partition is empty).
    """
    import numpy as np
    import pyarrow as pa

    batches = [b for b in batches if b.num_rows]
    if not batches:
        return None
    table = pa.Table.from_batches(batches)
    user = table.column("user").to_numpy()
    ts = table.column("ts").to_numpy()
    order = np.lexsort((ts, user))  # by user, then time: the disorder inside the batch is sorted out here
    user, ts = user[order], ts[order]
    keys_np, first = np.unique(user, return_index=True)
    keys: list[int] = keys_np.tolist()
    bounds: list[int] = [*first.tolist(), len(user)]
    times_list: list[int] = ts.tolist()
    sessions_state = state.value(SESSION, key_serializer="int")  # pickled (start, last, count)
    times_state = state.list(TIMES, key_serializer="int", value_serializer="int")
    sessions = sessions_state.get_many(keys)
    append_keys: list[int] = []
    append_values: list[int] = []
    replaced: list[int] = []
    out_users: list[int] = []
    out: list[Closed] = []
    for i, u in enumerate(keys):
        new = times_list[bounds[i] : bounds[i + 1]]
        old = sessions[i]
        session, closed, tail = advance(old, new)
        sessions[i] = session
        if tail is None:
            append_keys += [u] * len(new)  # the session went on: its new events are appended
            append_values += new
            continue
        if old is not None:
            replaced.append(u)
        append_keys += [u] * (len(new) - tail)
        append_values += new[tail:]
        out_users += [u] * len(closed)
        out += closed
    if replaced:
        times_state.clear_many(replaced)  # staged before the appends: the epoch applies them in order
    times_state.append_many(append_keys, append_values)
    sessions_state.put_many(keys, sessions)
    return _closed_batch(out_users, out)


def ours_process(batches: Iterable[Any], state: Any) -> list[Any] | None:
    """The ``process`` of ours' ``foreach_batch``: the partition's closed sessions as its output."""
    out = sessionize_partition(batches, state)
    return None if out is None else [out]


# -- applyInPandasWithState ---------------------------------------------------------------------
AIPWS_STATE_DDL = "start long, last long, count long, times binary"
"""The times travel packed (big-endian int64s), so a session that goes on appends bytes: PySpark
4.3's worker cannot parse an ``array<long>`` field in a state schema anyway (KeyError
'elementType' in ``StructType.fromJson``)."""


def pack_times(times: list[int]) -> bytes:
    import struct

    return struct.pack(f">{len(times)}q", *times)


def unpack_times(packed: bytes) -> list[int]:
    import struct

    return list(struct.unpack(f">{len(packed) // 8}q", packed))


def _closed_frame(user: int, closed: list[Closed]) -> Any:
    import pandas as pd

    return pd.DataFrame(
        {
            "user": [user] * len(closed),
            "start": [c[0] for c in closed],
            "count": [c[1] for c in closed],
            "duration": [c[2] for c in closed],
        },
        dtype="int64",
    )


def aipws_sessionize(key: Any, pdfs: Iterator[Any], state: Any) -> Iterator[Any]:
    """``applyInPandasWithState``: the session of one user in a GroupState (start, last, count, times)."""
    new: list[int] = sorted(t for pdf in pdfs for t in pdf["ts"].tolist())
    old: Session | None = None
    packed = b""
    if state.exists:
        start, last, count, packed = state.get
        old = (int(start), int(last), int(count))
    session, closed, tail = advance(old, new)
    packed = bytes(packed) + pack_times(new) if tail is None else pack_times(new[tail:])
    state.update((*session, packed))
    yield _closed_frame(int(key[0]), closed)


# -- transformWithStateInPandas -----------------------------------------------------------------
def _times_and_session(rows: Iterator[Any], session_state: Any) -> tuple[list[int], Session | None]:
    """The event times of one user's rows, sorted, and the session its ValueState holds (None: none)."""
    new: list[int] = sorted(t for pdf in rows for t in pdf["ts"].tolist())
    if not session_state.exists():
        return new, None
    start, last, count = session_state.get()
    return new, (int(start), int(last), int(count))


def twsip_processor() -> Any:
    """A StatefulProcessor keeping the session in a ValueState (start, last, count) plus a ListState of its times."""
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class Sessionize(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.session = handle.getValueState(SESSION, "start long, last long, count long")
            self.times = handle.getListState(TIMES, "ts long")

        def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
            new, old = _times_and_session(rows, self.session)
            session, closed, tail = advance(old, new)
            if tail is None:
                self.times.appendList([(t,) for t in new])
            else:
                self.times.put([(t,) for t in new[tail:]])
            self.session.update(session)
            yield _closed_frame(int(key[0]), closed)

        def close(self) -> None:
            pass

    return Sessionize()


def twsip_timer_processor() -> Any:
    """:func:`twsip_processor` in timeMode "EventTime": an event-time timer at the session's last event + GAP_S
    closes it (``handleExpiredTimer``), as well as a later event more than GAP_S after it."""
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class TimerSessionize(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.handle = handle
            self.session = handle.getValueState(SESSION, "start long, last long, count long")
            self.times = handle.getListState(TIMES, "ts long")

        def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
            new, old = _times_and_session(rows, self.session)
            if old is not None:
                self.handle.deleteTimer((old[1] + GAP_S) * 1000)
            session, closed, tail = advance(old, new)
            if tail is None:
                self.times.appendList([(t,) for t in new])
            else:
                self.times.put([(t,) for t in new[tail:]])
            self.session.update(session)
            self.handle.registerTimer((session[1] + GAP_S) * 1000)  # ms, the watermark's unit
            yield _closed_frame(int(key[0]), closed)

        def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Iterator[Any]:
            if self.session.exists():
                start, last, count = (int(x) for x in self.session.get())
                self.session.clear()
                self.times.clear()
                yield _closed_frame(int(key[0]), [(start, count, last - start)])

        def close(self) -> None:
            pass

    return TimerSessionize()
