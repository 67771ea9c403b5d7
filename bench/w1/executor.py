"""Code that runs inside Spark's Python workers (shipped by value: executors cannot import ``bench``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, cast


def preaggregate(batches: Iterable[Any]) -> Any:
    """The partition's rows folded per user with Arrow: a table (user, n, total), or None when empty."""
    import pyarrow as pa

    batches = [b for b in batches if b.num_rows]
    if not batches:
        return None
    agg = pa.Table.from_batches(batches).group_by("user").aggregate([("amount", "count"), ("amount", "sum")])
    return agg.select(["user", "amount_count", "amount_sum"]).rename_columns(["user", "n", "total"])


def ours_process(batches: Iterator[Any], state: Any) -> None:
    """One Spark partition of a micro-batch: pre-aggregate, then one server-side reduce per user."""
    agg = preaggregate(batches)
    if agg is None:
        return
    users = agg.column("user").to_pylist()
    operands = list(zip(agg.column("n").to_pylist(), agg.column("total").to_pylist()))
    state.reducing("totals", key_serializer="int").add_many(users, operands)


def preaggregate_only(batches: Iterable[Any]) -> Iterator[Any]:
    """A mapInArrow function: the partition pre-aggregated as ours does it, its users counted; no state at all."""
    import pyarrow as pa

    agg = preaggregate(batches)
    keys = 0 if agg is None else agg.num_rows
    yield pa.RecordBatch.from_pydict({"keys": [keys]}, schema=pa.schema([("keys", pa.int64())]))


# -- the Redis variant -------------------------------------------------------------------------
_REDIS: dict[int, Any] = {}
_REDIS_CHUNK = 1000  # keys per MGET/MSET, the batch size the field notes measured


def redis_update(port: int) -> Any:
    """A mapInArrow function: pre-aggregate the partition, then MGET, add, MSET (no durability)."""

    def run(batches: Iterable[Any]) -> Iterator[Any]:
        import numpy as np
        import pyarrow as pa
        import redis

        agg = preaggregate(batches)
        updated = 0
        if agg is not None:
            client = _REDIS.get(port)
            if client is None:  # one connection per reused Python worker
                client = _REDIS[port] = redis.Redis(host="127.0.0.1", port=port)
            raw = agg.column("user").to_numpy().astype(">i8").tobytes()
            keys = [raw[i : i + 8] for i in range(0, len(raw), 8)]
            delta = np.stack([agg.column("n").to_numpy(), agg.column("total").to_numpy()], axis=1)
            for start in range(0, len(keys), _REDIS_CHUNK):
                part = keys[start : start + _REDIS_CHUNK]
                old = cast("list[bytes | None]", client.mget(part))  # bytes: no decode_responses
                current = np.frombuffer(b"".join(v if v is not None else bytes(16) for v in old), dtype=">i8")
                new = (current.reshape(-1, 2) + delta[start : start + len(part)]).astype(">i8").tobytes()
                client.mset({k: new[i * 16 : i * 16 + 16] for i, k in enumerate(part)})
            updated = len(keys)
        yield pa.RecordBatch.from_pydict({"keys": [updated]}, schema=pa.schema([("keys", pa.int64())]))

    return run


# -- transformWithStateInPandas --------------------------------------------------------------
def twsip_processor() -> Any:
    """A StatefulProcessor keeping (count, sum) in a ValueState per user."""
    import pandas as pd
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class RunningAggregate(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.total = handle.getValueState("total", "count long, sum long")

        def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
            n = 0
            s = 0
            for pdf in rows:
                n += len(pdf)
                s += int(pdf["amount"].sum())
            if self.total.exists():
                c, t = self.total.get()
                n, s = n + c, s + t
            self.total.update((n, s))
            yield pd.DataFrame({"user": [key[0]], "count": [n], "sum": [s]})

        def close(self) -> None:
            pass

    return RunningAggregate()
