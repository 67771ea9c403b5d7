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
START = "start"  # ValueState: the open session's first event time
TIMES = "times"  # ListState: the open session's event times, in time order

Closed = tuple[int, int, int]  # (start, count, duration_s) of one closed session of a user


def advance(
    start: int | None, times: list[int], new: list[int], gap: int = GAP_S
) -> tuple[int, list[int], list[Closed]]:
    """One user's session after its ``new`` events (sorted by time) arrive.

    ``start``/``times``: the open session (None/[] when the user has none). Returns the open
    session's start and times afterwards and the sessions the new events closed, in order. The
    returned list is ``times`` extended in place when no session closed.
    """
    closed: list[Closed] = []
    if start is None:
        start, times = new[0], [new[0]]
        new = new[1:]
    last = times[-1]
    for t in new:
        if t - last > gap:
            closed.append((start, len(times), last - start))
            start, times = t, [t]
        else:
            times.append(t)
        last = t
    return start, times, closed


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

    Bulk calls only: one multi-get of the starts and one of the lists for the partition's users,
    then one append for the sessions that went on, one clear + append for those that were
    replaced, and one put of the new starts. Returns the closed sessions as one RecordBatch (None
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
    starts_state = state.value(START, key_serializer="int", value_serializer="int")
    times_state = state.list(TIMES, key_serializer="int", value_serializer="int")
    starts = starts_state.get_many(keys)
    lists = times_state.get_many(keys)
    append_keys: list[int] = []
    append_values: list[int] = []
    replaced: list[int] = []
    put_keys: list[int] = []
    put_values: list[int] = []
    out_users: list[int] = []
    out: list[Closed] = []
    for i, u in enumerate(keys):
        new = times_list[bounds[i] : bounds[i + 1]]
        old_start = starts[i]
        start, times, closed = advance(old_start, lists[i], new)
        if old_start is not None and not closed:
            append_keys += [u] * len(new)  # the session went on: only its new events are written
            append_values += new
            continue
        if old_start is not None:
            replaced.append(u)
        append_keys += [u] * len(times)
        append_values += times
        put_keys.append(u)
        put_values.append(start)
        out_users += [u] * len(closed)
        out += closed
    if replaced:
        times_state.clear_many(replaced)  # staged before the appends: the epoch applies them in order
    if append_keys:
        times_state.append_many(append_keys, append_values)
    if put_keys:
        starts_state.put_many(put_keys, put_values)
    return _closed_batch(out_users, out)


def ours_process(batches: Iterable[Any], state: Any) -> list[Any] | None:
    """The ``process`` of ours' ``foreach_batch``: the partition's closed sessions as its output."""
    out = sessionize_partition(batches, state)
    return None if out is None else [out]


def ours_process_to_files(directory: str) -> Any:
    """TEMPORARY, until ``foreach_batch`` has its output channel: the closed sessions go to one Arrow
    file per (batch, partition), replaced by a retried attempt (a keyed partition always holds the same users).
    """

    def process(batches: Iterable[Any], state: Any) -> None:
        import os

        import pyarrow as pa
        from pyspark import TaskContext

        out = sessionize_partition(batches, state)
        ctx = TaskContext.get()
        if out is None or ctx is None:
            return
        path = os.path.join(directory, f"b{state.batch_id:06d}-p{ctx.partitionId():04d}.arrow")
        with pa.OSFile(path + ".tmp", "wb") as sink, pa.ipc.new_file(sink, out.schema) as writer:
            writer.write_batch(out)
        os.replace(path + ".tmp", path)

    return process


# -- applyInPandasWithState ---------------------------------------------------------------------
AIPWS_STATE_DDL = "start long, times binary"
"""The times travel packed (big-endian int64s): PySpark 4.3's worker cannot parse an ``array<long>``
field in a state schema (KeyError 'elementType' in ``StructType.fromJson``)."""


def pack_times(times: list[int]) -> bytes:
    import struct

    return struct.pack(f">{len(times)}q", *times)


def unpack_times(packed: bytes) -> list[int]:
    import struct

    return list(struct.unpack(f">{len(packed) // 8}q", packed))


def aipws_sessionize(key: Any, pdfs: Iterator[Any], state: Any) -> Iterator[Any]:
    """``applyInPandasWithState``: the session of one user in a GroupState (start, times)."""
    import pandas as pd

    new: list[int] = sorted(t for pdf in pdfs for t in pdf["ts"].tolist())
    start: int | None = None
    times: list[int] = []
    if state.exists:
        old_start, packed = state.get
        start, times = int(old_start), unpack_times(bytes(packed))
    start, times, closed = advance(start, times, new)
    state.update((start, pack_times(times)))
    user = int(key[0])
    yield pd.DataFrame(
        {
            "user": [user] * len(closed),
            "start": [c[0] for c in closed],
            "count": [c[1] for c in closed],
            "duration": [c[2] for c in closed],
        },
        dtype="int64",
    )


# -- transformWithStateInPandas -----------------------------------------------------------------
def twsip_processor() -> Any:
    """A StatefulProcessor keeping the session in a ListState of times plus a ValueState with its start."""
    import pandas as pd
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class Sessionize(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.start = handle.getValueState(START, "start long")
            self.times = handle.getListState(TIMES, "ts long")

        def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
            new: list[int] = sorted(t for pdf in rows for t in pdf["ts"].tolist())
            old_start: int | None = None
            times: list[int] = []
            if self.start.exists():
                old_start = int(self.start.get()[0])
                times = [int(r[0]) for r in self.times.get()]
            before = len(times)
            start, times, closed = advance(old_start, times, new)
            if old_start is not None and not closed:
                self.times.appendList([(t,) for t in times[before:]])
            else:
                self.times.put([(t,) for t in times])
                self.start.update((start,))
            user = int(key[0])
            yield pd.DataFrame(
                {
                    "user": [user] * len(closed),
                    "start": [c[0] for c in closed],
                    "count": [c[1] for c in closed],
                    "duration": [c[2] for c in closed],
                },
                dtype="int64",
            )

        def close(self) -> None:
            pass

    return Sessionize()
