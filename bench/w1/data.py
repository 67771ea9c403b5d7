"""The W1 input: uniform (user, amount) events written once to Parquet, and the exact reference.

Amounts are integer cents, so every variant's sums can be compared for equality.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

SCHEMA_DDL = "user long, amount long"


@dataclass(frozen=True)
class W1Data:
    """The Parquet directory and the per-user reference ``(count, sum)`` as dense arrays."""

    directory: Path
    files: list[Path]
    events: int
    users: int
    counts: np.ndarray  # counts[u] = events of user u
    sums: np.ndarray  # sums[u] = sum of amounts of user u

    def file_batches(self, files_per_batch: int) -> list[list[Path]]:
        return [self.files[i : i + files_per_batch] for i in range(0, len(self.files), files_per_batch)]

    def expected(self) -> dict[int, tuple[int, int]]:
        """``{user: (count, sum)}`` for every user with at least one event."""
        seen = np.nonzero(self.counts)[0]
        return dict(zip(seen.tolist(), zip(self.counts[seen].tolist(), self.sums[seen].tolist())))


def generate(directory: Path, events: int, users: int, files: int, seed: int) -> W1Data:
    """Draw ``events`` uniform events over ``users`` users with ``seed``; write ``files`` Parquet files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if events % files:
        raise ValueError(f"{events} events do not split evenly into {files} files")
    rng = np.random.default_rng(seed)
    user = rng.integers(0, users, size=events, dtype=np.int64)
    amount = rng.integers(1, 10_000, size=events, dtype=np.int64, endpoint=True)  # cents
    directory.mkdir(parents=True, exist_ok=True)
    per_file = events // files
    paths = []
    for f in range(files):
        part = slice(f * per_file, (f + 1) * per_file)
        path = directory / f"events-{f:03d}.parquet"
        pq.write_table(pa.table({"user": user[part], "amount": amount[part]}), path)
        paths.append(path)
    counts = np.bincount(user, minlength=users).astype(np.int64)
    sums = np.bincount(user, weights=amount, minlength=users)
    # float64 bincount is exact here (every partial sum < 2**53); keep it integral
    sums = np.rint(sums).astype(np.int64)
    logger.info("W1 data: %d events over %d users in %d files at %s", events, users, files, directory)
    return W1Data(directory, paths, events, users, counts, sums)


def subset(data: W1Data, directory: Path, events: int, files: int) -> W1Data:
    """The first ``events`` events of ``data`` re-written as ``files`` files, with their reference."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.concat_tables([pq.read_table(p) for p in data.files]).slice(0, events)
    directory.mkdir(parents=True, exist_ok=True)
    per_file = events // files
    paths = []
    for f in range(files):
        path = directory / f"events-{f:03d}.parquet"
        pq.write_table(table.slice(f * per_file, per_file), path)
        paths.append(path)
    user = table.column("user").to_numpy()
    amount = table.column("amount").to_numpy()
    counts = np.bincount(user, minlength=data.users).astype(np.int64)
    sums = np.rint(np.bincount(user, weights=amount, minlength=data.users)).astype(np.int64)
    return W1Data(directory, paths, per_file * files, data.users, counts, sums)


def mismatches(data: W1Data, got: dict[int, tuple[int, int]]) -> int:
    """How many users differ from the reference (missing, extra or wrong values)."""
    expected = data.expected()
    bad = sum(1 for u, v in expected.items() if got.get(u) != v)
    bad += sum(1 for u in got if u not in expected)
    return bad


def check_reference(who: str, data: W1Data, got: dict[int, tuple[int, int]]) -> None:
    """Raise RuntimeError naming ``who`` unless ``got`` is exactly the plain-Python reference."""
    bad = mismatches(data, got)
    if bad:
        raise RuntimeError(f"{who}: {bad} of {len(data.expected())} users differ from the plain-Python reference")
