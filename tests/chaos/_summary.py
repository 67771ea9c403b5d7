"""The soak's summary: what ran, which faults were injected, what was lost or doubled (nothing, or the seeds)."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tests.chaos._run import RunResult
from tests.chaos._schedule import CATALOGUE


def summarize(results: list[RunResult]) -> dict[str, Any]:
    scheduled: Counter[str] = Counter()
    injected: Counter[str] = Counter()
    for r in results:
        for f in r.faults:
            scheduled[f["kind"]] += 1
            injected[f["kind"]] += int(f["fired"])
    failures = [
        {
            "seed": r.seed,
            "mode": r.mode,
            "netns": r.netns,
            "failure": ((r.failure or "").splitlines() or ["?"])[0][:400],
            "lost": r.lost,
            "doubled": r.doubled,
            "logs": r.log_dir,
        }
        for r in results
        if not r.passed
    ]
    return {
        "generated": time.strftime("%Y-%m-%d %H:%M:%S"),
        "runs": len(results),
        "passed": sum(r.passed for r in results),
        "failed": len(failures),
        "modes": dict(Counter(r.mode for r in results)),
        "netns_runs": sum(r.netns for r in results),
        "faults_scheduled": dict(sorted(scheduled.items())),
        "faults_injected": dict(sorted(injected.items())),
        "faults_injected_total": sum(injected.values()),
        "driver_starts": sum(r.driver_starts for r in results),
        "batch_runs": sum(r.batch_runs for r in results),
        "batches_rerun": sum(r.batches_rerun for r in results),
        "replays_of_committed_batches": sum(r.replays for r in results),
        "queries_started": sum(r.queries_started for r in results),
        "operator_actions": sum(r.operator_actions for r in results),
        "events_checked": sum(r.events_checked for r in results),
        "events_lost": sum(r.lost for r in results),
        "events_doubled": sum(r.doubled for r in results),
        "events_unexpected": sum(r.unexpected for r in results),
        "duration_s": round(sum(r.duration_s for r in results), 1),
        "outcomes": dict(Counter(r.outcome or "-" for r in results)),
        "failures": failures,
        "seeds": [r.seed for r in results],
    }


def markdown(summary: dict[str, Any]) -> str:
    s = summary
    lines = [
        f"# Chaos soak, {s['generated']}",
        "",
        "| runs | passed | failed | events checked | lost | doubled | batch runs | re-runs | replays | driver starts "
        "| queries started | operator actions | time |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {s['runs']} ({', '.join(f'{n} {m}' for m, n in sorted(s['modes'].items()))}; {s['netns_runs']} on netns) "
        f"| {s['passed']} | {s['failed']} | {s['events_checked']} | {s['events_lost']} | {s['events_doubled']} "
        f"| {s['batch_runs']} | {s['batches_rerun']} | {s['replays_of_committed_batches']} | {s['driver_starts']} "
        f"| {s['queries_started']} | {s['operator_actions']} | {s['duration_s'] / 60:.1f} min |",
        "",
        "| fault kind | scheduled | injected |",
        "|---|---|---|",
    ]
    for kind in CATALOGUE:
        lines.append(f"| {kind} | {s['faults_scheduled'].get(kind, 0)} | {s['faults_injected'].get(kind, 0)} |")
    lines += ["", "Outcomes: " + "; ".join(f"{o}: {n}" for o, n in sorted(s["outcomes"].items()))]
    if s["failures"]:
        lines += ["", "| seed | mode | failure | lost | doubled |", "|---|---|---|---|---|"]
        for f in s["failures"]:
            lines.append(
                f"| {f['seed']} | {f['mode']}{' netns' if f['netns'] else ''} | "
                f"{f['failure'].replace('|', '/')} | {f['lost']} | {f['doubled']} |"
            )
        lines += [
            "",
            "Replay one: `KEYEDSTATE_CHAOS_SEEDS=<seed> .venv/bin/python -m pytest tests/chaos -m chaos_soak`",
        ]
    else:
        lines += ["", "No failures."]
    return "\n".join(lines) + "\n"


def write_summary(results: list[RunResult], directory: Path) -> tuple[Path, Path]:
    """``summary.json`` (with every run) and ``summary.md`` in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    summary = summarize(results)
    json_path, md_path = directory / "summary.json", directory / "summary.md"
    json_path.write_text(
        json.dumps({**summary, "runs_detail": [r.to_dict() for r in results]}, indent=1), encoding="utf-8"
    )
    md_path.write_text(markdown(summary), encoding="utf-8")
    return json_path, md_path
