"""The W2 input: per-user events with event times, written once to Parquet, and the plain-Python reference.

Shape of the data (fixed seed): micro-batch ``b`` holds the events whose times fall in the
hour ``[T0 + b*SPAN, T0 + (b+1)*SPAN)``, so event time increases from batch to batch; inside a
batch the rows are in *arrival* order, which is event time plus a random delay of up to
:data:`LATENESS_S`, so a user's events arrive out of time order and the session logic must sort
them. Users have heavy-tailed activity (log-normal weights): busy users keep sessions open across
many micro-batches, quiet ones open a new session with almost every event.

End of the stream: a session still open after the last event is not emitted; it stays in state,
and the checks read it from there. The reference follows the same rule.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

SCHEMA_DDL = "user long, ts long"
GAP_S = 1800
"""A session closes when an event arrives more than this many seconds after its last event (exactly 1800 s extends it)."""
SPAN_S = 3600
"""The event time one micro-batch covers."""
LATENESS_S = 600
"""Rows of a batch arrive up to this many seconds after their event time (the disorder inside a batch)."""
T0 = 1_700_000_000  # the first batch's event time, in Unix seconds

Session = tuple[int, int, int, int]
"""A closed session as emitted: (user, start, count, duration_s), duration = last event time - start."""


@dataclass(frozen=True)
class Sessions:
    """What a sessionization produced: the emitted (closed) sessions and the open ones left in state."""

    closed: frozenset[Session]
    open: dict[int, tuple[int, tuple[int, ...]]]
    """user -> (start, the open session's event times in time order)."""


@dataclass(frozen=True)
class W2Data:
    """The Parquet directory (``files_per_batch`` files per micro-batch) and its reference."""

    directory: Path
    files: list[Path]
    events: int
    users: int
    files_per_batch: int
    expected: Sessions

    @property
    def batches(self) -> int:
        return len(self.files) // self.files_per_batch


def reference(users: Iterable[int], times: Iterable[int], gap: int = GAP_S) -> Sessions:
    """Sessionize with a plain per-event loop: each user's events in time order, a gap > ``gap`` closes.

    It needs no notion of micro-batches: every batch's events are later than the previous
    batch's, so processing batch by batch ends in the same sessions as processing all at once.
    """
    per_user: dict[int, list[int]] = defaultdict(list)
    for u, t in zip(users, times):
        per_user[int(u)].append(int(t))
    closed: set[Session] = set()
    still_open: dict[int, tuple[int, tuple[int, ...]]] = {}
    for u, ts in per_user.items():
        ts.sort()
        current = [ts[0]]
        for t in ts[1:]:
            if t - current[-1] > gap:
                closed.add((u, current[0], len(current), current[-1] - current[0]))
                current = [t]
            else:
                current.append(t)
        still_open[u] = (current[0], tuple(current))
    return Sessions(frozenset(closed), still_open)


def _write(directory: Path, parts: list[tuple[np.ndarray, np.ndarray]]) -> list[Path]:
    """One Parquet file per part; modification times one second apart, in order.

    Spark's file source orders new files by modification time: files written within the same
    clock tick could otherwise be picked in another order, mixing the hours of two batches.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (user, ts) in enumerate(parts):
        path = directory / f"events-{i:03d}.parquet"
        pq.write_table(pa.table({"user": user, "ts": ts}), path)
        os.utime(path, (T0 + i, T0 + i))
        paths.append(path)
    return paths


def generate(directory: Path, events: int, users: int, batches: int, files_per_batch: int, seed: int) -> W2Data:
    """Draw ``events`` events over ``users`` users in ``batches`` hours with ``seed``; write the files."""
    if events % (batches * files_per_batch):
        raise ValueError(f"{events} events do not split evenly into {batches} batches of {files_per_batch} files")
    rng = np.random.default_rng(seed)
    weights = rng.lognormal(0.0, 1.0, size=users)
    weights /= weights.sum()
    per_batch = events // batches
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    for b in range(batches):
        user = rng.choice(users, size=per_batch, p=weights).astype(np.int64)
        ts = T0 + b * SPAN_S + rng.integers(0, SPAN_S, size=per_batch, dtype=np.int64)
        arrival = ts + rng.integers(0, LATENESS_S, size=per_batch, endpoint=True, dtype=np.int64)
        order = np.argsort(arrival, kind="stable")
        for f in np.array_split(order, files_per_batch):
            parts.append((user[f], ts[f]))
    paths = _write(directory, parts)
    all_users = np.concatenate([u for u, _ in parts])
    all_ts = np.concatenate([t for _, t in parts])
    expected = reference(all_users.tolist(), all_ts.tolist())
    logger.info("W2 data: %d events over %d users in %d files at %s", events, users, len(paths), directory)
    return W2Data(directory, paths, events, users, files_per_batch, expected)


def subset_users(data: W2Data, directory: Path, users: int) -> W2Data:
    """The events of users ``0 .. users-1`` only, in the same files and batches, with their reference.

    Keeping every batch (rather than the first events) keeps sessions spanning micro-batches.
    """
    import pyarrow.parquet as pq

    parts = []
    for path in data.files:
        table = pq.read_table(path)
        user = table.column("user").to_numpy()
        keep = user < users
        parts.append((user[keep], table.column("ts").to_numpy()[keep]))
    paths = _write(directory, parts)
    all_users = np.concatenate([u for u, _ in parts])
    all_ts = np.concatenate([t for _, t in parts])
    expected = reference(all_users.tolist(), all_ts.tolist())
    return W2Data(directory, paths, len(all_users), users, data.files_per_batch, expected)


def mismatches(expected: Sessions, got: Sessions, with_open: bool = True) -> tuple[int, int]:
    """(closed sessions missing or extra, open sessions differing) between ``expected`` and ``got``."""
    closed = len(expected.closed ^ got.closed)
    if not with_open:
        return closed, 0
    bad_open = sum(1 for u, v in expected.open.items() if got.open.get(u) != v)
    bad_open += sum(1 for u in got.open if u not in expected.open)
    return closed, bad_open


def check_reference(who: str, expected: Sessions, got: Sessions, with_open: bool = True) -> None:
    """Raise RuntimeError naming ``who`` unless ``got`` equals the reference (open sessions too, with ``with_open``)."""
    closed, bad_open = mismatches(expected, got, with_open)
    if closed or bad_open:
        raise RuntimeError(
            f"{who}: differs from the plain-Python reference: {closed} of {len(expected.closed)} closed sessions "
            f"missing or extra ({len(got.closed)} emitted), {bad_open} of {len(expected.open)} open sessions differ"
        )
