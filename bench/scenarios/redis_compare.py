"""Scenario 2: against Redis, the other place users keep state outside the executors.

The same keys and values as ``client_path`` (1M; quick 100k) go to a local ``redis-server``
(persistence off, so Redis has no durability at all: the comparison is generous to it) through
redis-py with hiredis: pipelined SET/GET (1000 commands per pipeline) and MSET/MGET (1000 keys
per command). Our batched put_many/get_many is measured in the same process, in the same run,
against one TaskManager with RocksDB. The issue names no target; the ratios are reported.
"""

from __future__ import annotations

import logging
from typing import Any

from bench._redis import RedisUnavailable, redis_server
from bench.result import BenchContext, Measurement, Ratio, ScenarioResult, Series
from bench.scenarios.client_path import (
    Sizes,
    _chunks,
    best_rate,
    check_values,
    client_get,
    client_put,
    cluster_state,
    dataset,
)

logger = logging.getLogger(__name__)

NAME = "redis_compare"
TITLE = "Against Redis: our batched put/get vs redis-py+hiredis pipelined SET/GET and MSET/MGET"

REDIS_BATCH = 1000


def redis_rates(port: int, keys: list[bytes], values: list[bytes], repeats: int) -> dict[str, float]:
    """keys/s of pipelined SET, pipelined GET, MSET and MGET (best of ``repeats``)."""
    import redis

    r = redis.Redis(host="127.0.0.1", port=port)
    n = len(keys)
    try:

        def pipe_set() -> None:
            for a, b in _chunks(n, REDIS_BATCH):
                p = r.pipeline(transaction=False)
                for k, v in zip(keys[a:b], values[a:b]):
                    p.set(k, v)
                p.execute()

        def pipe_get() -> None:
            out: list[Any] = []
            for a, b in _chunks(n, REDIS_BATCH):
                p = r.pipeline(transaction=False)
                for k in keys[a:b]:
                    p.get(k)
                out.extend(p.execute())
            check_values(out, values, "redis pipelined GET")

        def mset() -> None:
            for a, b in _chunks(n, REDIS_BATCH):
                r.mset(dict(zip(keys[a:b], values[a:b])))

        def mget() -> None:
            out: list[Any] = []
            for a, b in _chunks(n, REDIS_BATCH):
                out.extend(r.mget(keys[a:b]))
            check_values(out, values, "redis MGET")

        rates = {}
        for name, fn in (("SET", pipe_set), ("GET", pipe_get), ("MSET", mset), ("MGET", mget)):
            rates[name], _ = best_rate(n, fn, repeats)
            if name == "GET":
                r.flushall()  # MSET starts from an empty server, as SET did
        return rates
    finally:
        r.close()


def run(ctx: BenchContext) -> ScenarioResult:
    sizes = Sizes.for_ctx(ctx)
    n = sizes.keys
    repeats = 2 if ctx.quick else 3
    keys, values = dataset(n, ctx.seed)
    params = {
        "keys": n,
        "key_bytes": 16,
        "value_bytes": 100,
        "redis_batch": REDIS_BATCH,
        "redis": "redis-server on 127.0.0.1, --save '' --appendonly no (no durability)",
        "ours": "executor client -> 1 TaskManager process, RocksDB, WAL on",
        "repeats": f"best of {repeats}",
    }

    with cluster_state(ctx.workdir) as (state, _client, _pid):
        ours_put, _ = best_rate(n, lambda: client_put(state, keys, values), repeats)
        ours_get, _ = best_rate(
            n, lambda: check_values(client_get(state, keys), values, "the executor client"), repeats
        )
    measurements = [
        Measurement("ours: batched put (put_many)", ours_put, "keys/s"),
        Measurement("ours: batched get (get_many)", ours_get, "keys/s"),
    ]
    try:
        with redis_server(ctx.workdir / "redis") as port:
            rates = redis_rates(port, keys, values, repeats)
    except RedisUnavailable as exc:
        return ScenarioResult(
            NAME,
            TITLE,
            params,
            measurements,
            notes=[f"Redis baselines not run: {exc}"],
            skipped=f"{exc} (run `make bench-deps`)",
        )
    measurements += [
        Measurement("redis pipelined SET", rates["SET"], "keys/s", f"{REDIS_BATCH} per pipeline"),
        Measurement("redis pipelined GET", rates["GET"], "keys/s", f"{REDIS_BATCH} per pipeline"),
        Measurement("redis MSET", rates["MSET"], "keys/s", f"{REDIS_BATCH} keys per command"),
        Measurement("redis MGET", rates["MGET"], "keys/s", f"{REDIS_BATCH} keys per command"),
    ]
    ratios = [
        Ratio("our put / redis pipelined SET", ours_put / rates["SET"]),
        Ratio("our get / redis pipelined GET", ours_get / rates["GET"]),
        Ratio("our put / redis MSET", ours_put / rates["MSET"]),
        Ratio("our get / redis MGET", ours_get / rates["MGET"]),
    ]
    series = [
        Series(
            "redis_compare",
            "keyedstate (durable, RocksDB)",
            [0, 1],
            [ours_put, ours_get],
            "operation (0 = write, 1 = read)",
            "keys/s",
            "bar",
        ),
        Series(
            "redis_compare",
            "redis pipelined SET/GET",
            [0, 1],
            [rates["SET"], rates["GET"]],
            "operation (0 = write, 1 = read)",
            "keys/s",
            "bar",
        ),
        Series(
            "redis_compare",
            "redis MSET/MGET",
            [0, 1],
            [rates["MSET"], rates["MGET"]],
            "operation (0 = write, 1 = read)",
            "keys/s",
            "bar",
        ),
    ]
    print(
        f"   ours put {ours_put:,.0f} get {ours_get:,.0f}; redis SET {rates['SET']:,.0f} GET {rates['GET']:,.0f} "
        f"MSET {rates['MSET']:,.0f} MGET {rates['MGET']:,.0f} keys/s",
        flush=True,
    )
    return ScenarioResult(NAME, TITLE, params, measurements, ratios, series)
