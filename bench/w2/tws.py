"""W2 at a chosen size for the variants that run the same StatefulProcessor: ``python -m bench.w2.tws``.

``tWSiP`` (Spark's ``transformWithStateInPandas``) and ``ours-tWS`` (the same processor class on
this runtime) run on the same events, and ``ours`` (the bulk ``foreach_batch`` sessionization)
beside them; each variant's emitted and open sessions are checked against the plain-Python
reference, after a warm-up run of each on a small subset of the users. The W2 scenario
(``python -m bench --only w2``) runs all variants at its fixed sizes; this picks the size, for
measuring the migration on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.scenarios import w2_sessionization as w2
from bench.w1 import sparkjobs as w1jobs
from bench.w2 import data as w2data
from bench.w2 import sparkjobs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.w2.tws", description=__doc__)
    p.add_argument("--events", type=int, default=200_000)
    p.add_argument("--users", type=int, default=5_000)
    p.add_argument("--batches", type=int, default=5)
    p.add_argument("--files-per-batch", type=int, default=2)
    p.add_argument("--warmup-users", type=int, default=100)
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="w2-tws-") as tmp:
        work = Path(tmp)
        full = w2data.generate(work / "input", args.events, args.users, args.batches, args.files_per_batch, args.seed)
        warm = w2data.subset_users(full, work / "warm", args.warmup_users)
        print(f"W2: {full.events} events, {full.users} users, {full.batches} micro-batches", flush=True)
        with w1jobs.cluster_and_spark(
            work, w2.PARALLELISM, w1jobs.SparkSettings(shuffle_partitions=w2.PARALLELISM)
        ) as (
            cluster,
            spark,
        ):
            sparkjobs.ship_executor_code()
            runs = iter(range(1_000))

            def ours(d: w2data.W2Data) -> sparkjobs.W2Run:
                n = next(runs)
                return sparkjobs.run_ours(
                    spark, d, cluster.jobmanager_address, f"w2-{n}", w2.PARALLELISM, work / f"o{n}"
                )

            def ours_tws(d: w2data.W2Data) -> sparkjobs.W2Run:
                n = next(runs)
                return sparkjobs.run_ours_tws(
                    spark, d, cluster.jobmanager_address, f"w2-tws-{n}", w2.PARALLELISM, work / f"t{n}"
                )

            def twsip(d: w2data.W2Data) -> sparkjobs.W2Run:
                return sparkjobs.run_twsip(spark, d, work / f"s{next(runs)}")

            variants = {"tWSiP": twsip, "ours-tWS": ours_tws, "ours": ours}
            for label, fn in variants.items():
                w2._checked(label, warm, fn(warm))
            rates: dict[str, float] = {}
            for label, fn in variants.items():
                started = time.strftime("%H:%M:%S")
                run = w2._checked(label, full, fn(full))
                rates[label] = full.events / run.seconds
                line = f"{started} {label}: {rates[label]:,.0f} events/s ({run.seconds:.1f} s, matches the reference)"
                if run.timings:
                    t = run.timings
                    line += (
                        f"; per micro-batch (median of {len(t)}): Spark job {statistics.median(x.tasks_s for x in t) * 1000:.0f} ms, "
                        f"commit + checkpoint {statistics.median(x.commit_s for x in t) * 1000:.0f} ms"
                    )
                print(line, flush=True)
        print(f"ours-tWS / tWSiP: {rates['ours-tWS'] / rates['tWSiP']:.2f}", flush=True)
        print(f"ours / ours-tWS: {rates['ours'] / rates['ours-tWS']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
