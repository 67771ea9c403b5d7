"""Throughput of the backend's hot path against raw rocksdict (a measurement, not a test).

Run from the repo root: ``.venv/bin/python -m tests.unit.taskmanager.state.bench_state_backend [n_keys] [rounds]``.
Prints keys/s for 1000-key batches of puts and multi-gets and the ratio to raw rocksdict. Every
scenario runs ``rounds`` times, interleaved, and the best round counts: on a shared 2-core
machine single runs vary by 2x.

"raw, stored keys" issues the same rocksdict calls on the keys as the backend stores them
(key-group prefixed, so one batch is scattered over the key space); the ratio to it is the
backend's own Python overhead.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import rocksdict

from keyedstate.common.clock import SYSTEM_CLOCK
from keyedstate.common.descriptors import StateDescriptor, StateKind, TtlConfig
from keyedstate.common.ids import KeyGroupRange, SubtaskId
from keyedstate.common.keygroups import key_groups
from keyedstate.taskmanager.state import KeyedStateBackend, RocksDBResources, StateLimits, create_backend, layout

BATCH = 1000


def _rate(n: int, fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return n / (time.perf_counter() - start)


def main(n: int = 200_000, rounds: int = 5) -> None:
    keys = [b"user-%011d" % i for i in range(n)]  # 16 bytes
    value = b"x" * 100
    batches = [keys[i : i + BATCH] for i in range(0, n, BATCH)]
    values = [value] * BATCH
    resources = RocksDBResources()
    work = Path(tempfile.mkdtemp(prefix="bench-state-"))
    scenarios: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {}
    closers: list[Callable[[], None]] = []
    try:

        def raw_scenario(name: str, batch_keys: list[list[bytes]], stored_value: bytes) -> None:
            db = rocksdict.Rdict(
                str(work / name), resources.db_options(), column_families={"s": resources.column_family_options()}
            )
            cf = db.get_column_family("s")
            handle = db.get_column_family_handle("s")

            def put() -> None:
                for b in batch_keys:
                    wb = rocksdict.WriteBatch(raw_mode=True)
                    wb.set_default_column_family(handle)
                    for k in b:
                        wb.put(k, stored_value)
                    db.write(wb)

            # rocksdict's stub takes an invariant List of every key type: a list of bytes is one.
            scenarios[name] = (put, lambda: [cf.get(cast("list[Any]", b)) for b in batch_keys])
            refs = [cf, handle]

            def close() -> None:
                refs.clear()
                db.close()

            closers.append(close)

        def backend_scenario(name: str, b: KeyedStateBackend) -> None:
            def put() -> None:
                for k in batches:
                    b.value_put("s", k, values, b"")

            scenarios[name] = (put, lambda: [b.value_get("s", k, b"") for k in batches])

        raw_scenario("raw rocksdict", batches, value)
        stored = [layout.build_prefixes(key_groups(b, 128), b, b"", 16) for b in batches]
        raw_scenario("raw, stored keys", stored, b"\x00" + value)
        for index, (label, kind, ttl) in enumerate(
            (
                ("backend", "rocksdb", None),
                ("backend + TTL", "rocksdb", TtlConfig(3_600_000)),
                ("hashmap", "hashmap", None),
            )
        ):
            backend = create_backend(
                kind,
                SubtaskId("bench", "op", index),
                KeyGroupRange(0, 127),
                128,
                [StateDescriptor("s", StateKind.VALUE, ttl)],
                local_dir=work,
                limits=StateLimits(),
                clock=SYSTEM_CLOCK,
                resources=resources,
            )
            backend_scenario(label, backend)
            closers.append(backend.close)

        best = {name: [0.0, 0.0] for name in scenarios}
        for _ in range(rounds):
            for name, (put, get) in scenarios.items():
                best[name][0] = max(best[name][0], _rate(n, put))
                best[name][1] = max(best[name][1], _rate(n, get))
        raw = best["raw rocksdict"]
        same = best["raw, stored keys"]
        print(f"{n} keys, batches of {BATCH}, 16 B keys, 100 B values, WAL on, best of {rounds} rounds")
        for name, (put_rate, get_rate) in best.items():
            print(
                f"  {name:17s} put {put_rate:10,.0f}/s ({put_rate / raw[0]:.2f}x raw, {put_rate / same[0]:.2f}x stored-key raw)"
                f"   multi-get {get_rate:10,.0f}/s ({get_rate / raw[1]:.2f}x raw, {get_rate / same[1]:.2f}x stored-key raw)"
            )
    finally:
        for close in closers:
            close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
