"""Throughput of the backend's hot path against raw rocksdict (a measurement, not a test).

Run: ``.venv/bin/python -m tests.unit.taskmanager.state.bench_state_backend [n_keys]`` from the repo root.
Prints keys/s for 1000-key batches of puts and multi-gets, and the backend/raw ratio.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import rocksdict

from keyedstate.common.clock import SYSTEM_CLOCK
from keyedstate.common.descriptors import StateDescriptor, StateKind, TtlConfig
from keyedstate.common.ids import KeyGroupRange, SubtaskId
from keyedstate.taskmanager.state import RocksDBResources, StateLimits, create_backend

BATCH = 1000


def _rate(n: int, fn) -> float:
    start = time.perf_counter()
    fn()
    return n / (time.perf_counter() - start)


def main(n: int = 200_000) -> None:
    keys = [b"user-%011d" % i for i in range(n)]  # 16 bytes
    value = b"x" * 100
    batches = [keys[i:i + BATCH] for i in range(0, n, BATCH)]
    values = [value] * BATCH
    resources = RocksDBResources()
    work = Path(tempfile.mkdtemp(prefix="bench-state-"))
    try:
        db = rocksdict.Rdict(str(work / "raw"), resources.db_options(), column_families={"s": resources.column_family_options()})
        cf = db.get_column_family("s")
        handle = db.get_column_family_handle("s")

        def raw_put() -> None:
            for b in batches:
                wb = rocksdict.WriteBatch(raw_mode=True)
                wb.set_default_column_family(handle)
                for k in b:
                    wb.put(k, value)
                db.write(wb)

        def raw_get() -> None:
            for b in batches:
                cf.get(b)

        raw = (_rate(n, raw_put), _rate(n, raw_get))
        del cf, handle
        db.close()

        results = {"raw rocksdict": raw}
        for label, ttl in (("backend", None), ("backend+TTL", TtlConfig(3_600_000))):
            backend = create_backend(
                "rocksdb", SubtaskId("bench", "op", 0 if ttl is None else 1), KeyGroupRange(0, 127), 128,
                [StateDescriptor("s", StateKind.VALUE, ttl)], local_dir=work, limits=StateLimits(),
                clock=SYSTEM_CLOCK, resources=resources,
            )
            put = _rate(n, lambda: [backend.value_put("s", b, values, b"") for b in batches])
            get = _rate(n, lambda: [backend.value_get("s", b, b"") for b in batches])
            results[label] = (put, get)
            backend.close()
        hm = create_backend("hashmap", SubtaskId("bench", "op", 2), KeyGroupRange(0, 127), 128,
                            [StateDescriptor("s", StateKind.VALUE)], local_dir=work, limits=StateLimits(), clock=SYSTEM_CLOCK)
        results["hashmap"] = (
            _rate(n, lambda: [hm.value_put("s", b, values, b"") for b in batches]),
            _rate(n, lambda: [hm.value_get("s", b, b"") for b in batches]),
        )
        print(f"{n} keys, batches of {BATCH}, 16 B keys, 100 B values, WAL on")
        for label, (put, get) in results.items():
            print(f"  {label:14s} put {put:10,.0f}/s ({put / raw[0]:.2f}x raw)   multi-get {get:10,.0f}/s ({get / raw[1]:.2f}x raw)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200_000)
