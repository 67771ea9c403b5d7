"""The single-process baselines: rocksdict in-process (the storage engine alone) and a dict (the CPU limit).

Both apply the same micro-batches as the streaming variants (two files at a time, in order),
so they pay for reading Parquet too.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np

from bench.w1.data import W1Data

logger = logging.getLogger(__name__)

_VECTOR = struct.Struct(">qq")  # (count, sum), the same layout as the runtime's reducing state


def _read(files: list[Path]) -> Any:  # a pyarrow.Table (pyarrow publishes no types)
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pa.concat_tables([pq.read_table(f) for f in files])


def run_rocksdict(data: W1Data, files_per_batch: int, db_dir: Path) -> tuple[float, dict[int, tuple[int, int]]]:
    """Read each batch with pyarrow, pre-aggregate per user, multi-get, combine, WriteBatch.

    Returns (seconds, final state). The DB is a plain raw-mode Rdict with the WAL on, as an
    embedded user would open it.
    """
    import rocksdict

    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    db = rocksdict.Rdict(str(db_dir), opts)
    pack, unpack = _VECTOR.pack, _VECTOR.unpack
    try:
        start = time.perf_counter()
        for files in data.file_batches(files_per_batch):
            agg = _read(files).group_by("user").aggregate([("amount", "count"), ("amount", "sum")])
            users = agg.column("user").to_numpy()
            keys = _int_keys(users)
            counts = agg.column("amount_count").to_pylist()
            sums = agg.column("amount_sum").to_pylist()
            # rocksdict's stub takes an invariant List of every key type and returns Any | None;
            # a list of keys gives a list of values (None where absent).
            current = cast("list[bytes | None]", db.get(cast("list[Any]", keys)))
            wb = rocksdict.WriteBatch(raw_mode=True)
            put = wb.put
            for k, old, c, s in zip(keys, current, counts, sums):
                if old is None:
                    put(k, pack(c, s))
                else:
                    oc, os_ = unpack(old)
                    put(k, pack(oc + c, os_ + s))
            db.write(wb)
        elapsed = time.perf_counter() - start
        items = cast("Iterator[tuple[bytes, bytes]]", db.items())  # raw mode: bytes keys and values
        final = {int.from_bytes(k, "big", signed=True): unpack(v) for k, v in items}
        return elapsed, final
    finally:
        db.close()


def run_pure_python(data: W1Data, files_per_batch: int) -> tuple[float, dict[int, tuple[int, int]]]:
    """A dict updated event by event in one Python loop (reading Parquet included)."""
    state: dict[int, list[int]] = {}
    start = time.perf_counter()
    for files in data.file_batches(files_per_batch):
        table = _read(files)
        get = state.get
        for user, amount in zip(table.column("user").to_pylist(), table.column("amount").to_pylist()):
            entry = get(user)
            if entry is None:
                state[user] = [1, amount]
            else:
                entry[0] += 1
                entry[1] += amount
    elapsed = time.perf_counter() - start
    return elapsed, {u: (c, s) for u, (c, s) in state.items()}


def _int_keys(users: np.ndarray) -> list[bytes]:
    """The int serializer's bytes (8-byte big-endian) for each user, without a per-key struct call."""
    raw = users.astype(">i8").tobytes()
    return [raw[i : i + 8] for i in range(0, len(raw), 8)]
