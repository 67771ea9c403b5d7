"""W2 at a chosen size for the variants that run the same StatefulProcessor: ``python -m bench.w2.tws``.

``tWSiP`` (Spark's ``transformWithStateInPandas``) and ``ours-tWS`` (the same processor class on
this runtime) run on the same events, and ``ours`` (the bulk ``foreach_batch`` sessionization)
beside them; each variant's emitted and open sessions are checked against the plain-Python
reference, after a warm-up run of each on a small subset of the users. The W2 scenario
(``python -m bench --only w2``) runs all variants at its fixed sizes; this picks the size, for
measuring the migration on a shared machine. ``--timers`` runs the EventTime processor that closes
sessions by timer on both engines (``tWSiP`` and ``ours-tWS``).
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
    p.add_argument(
        "--timers",
        action="store_true",
        help="the EventTime processor that also closes sessions by timer, on tWSiP and ours-tWS (not ours)",
    )
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
                    spark, d, cluster.jobmanager_address, f"w2-tws-{n}", w2.PARALLELISM, work / f"t{n}", args.timers
                )

            def twsip(d: w2data.W2Data) -> sparkjobs.W2Run:
                return sparkjobs.run_twsip(spark, d, work / f"s{next(runs)}", args.timers)

            variants = {"tWSiP": twsip, "ours-tWS": ours_tws}
            if not args.timers:
                variants["ours"] = ours
            check = _checked_sessions if args.timers else w2._checked
            for label, fn in variants.items():
                check(label, warm, fn(warm))
            rates: dict[str, float] = {}
            for label, fn in variants.items():
                started = time.strftime("%H:%M:%S")
                run = check(label, full, fn(full))
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
        if "ours" in rates:
            print(f"ours / ours-tWS: {rates['ours'] / rates['ours-tWS']:.2f}", flush=True)
    return 0


def _checked_sessions(label: str, data: w2data.W2Data, run: sparkjobs.W2Run) -> sparkjobs.W2Run:
    """With timers a session closes once the watermark passes its last event + GAP_S, so which sessions are
    still open at the end depends on the last batches (Spark also runs batches without data); every session,
    closed or open, must be the reference's, and none emitted twice."""

    def every(s: w2data.Sessions) -> set[w2data.Session]:
        opened = {(u, start, len(times), times[-1] - start) for u, (start, times) in s.open.items()}
        return set(s.closed) | opened

    if run.open_read and every(run.result) != every(data.expected):
        raise RuntimeError(f"W2 {label} with timers: the sessions (closed and open) differ from the reference")
    if not run.result.closed <= every(data.expected):
        raise RuntimeError(f"W2 {label} with timers: emitted sessions the reference does not have")
    return run


if __name__ == "__main__":
    raise SystemExit(main())
