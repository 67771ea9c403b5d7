"""The benchmark runner: ``python -m bench [--quick] [--only NAME,...] [--out DIR] [--keep] [--results-md]``.

Scenarios are the modules of ``bench/scenarios/`` that define ``NAME``, ``TITLE`` and
``run(ctx)``. Each one runs in its own Python process (so a crash, a leaked thread or a JVM of
one scenario cannot disturb the next, and memory figures start from a clean process) and in a
fresh subdirectory of a temporary work directory. A scenario that fails is recorded as an error
and the run goes on; the exit code is 1 when any scenario failed. Missed targets do not change
the exit code: they are results.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import pkgutil
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from bench import report
from bench.machine import REPO_ROOT, describe, machine_info
from bench.result import BenchContext, Mode

logger = logging.getLogger(__name__)

SCENARIO_PACKAGE = "bench.scenarios"
# Display order; a scenario whose NAME starts with one of these sorts there, unknown ones go last.
ORDER = (
    "client_path",
    "slot_processes",
    "redis_compare",
    "w1",
    "w2",
    "batch_floor",
    "checkpoint",
    "restore",
    "memory",
    "coordinator_scale",
)
DEFAULT_OUT = REPO_ROOT / "bench" / "out"
RESULTS_MD = REPO_ROOT / "bench" / "RESULTS.md"
RESULTS_CHARTS = REPO_ROOT / "bench" / "results"
QUICK_TIMEOUT_S = 600.0


def _order_key(name: str) -> tuple[int, str]:
    for i, prefix in enumerate(ORDER):
        if name == prefix or name.startswith(prefix):
            return (i, name)
    return (len(ORDER), name)


def discover() -> tuple[dict[str, tuple[str, str]], list[report.ScenarioOutcome]]:
    """Scenario NAME -> (module, TITLE), in display order; modules that fail to import become errors."""
    import bench.scenarios as pkg

    found: dict[str, tuple[str, str]] = {}
    broken: list[report.ScenarioOutcome] = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_"):
            continue
        module_name = f"{SCENARIO_PACKAGE}.{info.name}"
        try:
            module: ModuleType = importlib.import_module(module_name)
        except Exception:
            broken.append(report.ScenarioOutcome(info.name, f"module {module_name}", error=traceback.format_exc()))
            continue
        name, title, run = (getattr(module, a, None) for a in ("NAME", "TITLE", "run"))
        if not isinstance(name, str) or not isinstance(title, str) or not callable(run):
            continue  # a helper module, not a scenario
        if name in found:
            broken.append(
                report.ScenarioOutcome(
                    name,
                    title,
                    error=f"NAME {name!r} is defined by both {found[name][0]} and {module_name}; rename one",
                )
            )
            continue
        found[name] = (module_name, title)
    ordered = dict(sorted(found.items(), key=lambda kv: _order_key(kv[0])))
    return ordered, broken


def run_worker(module_name: str, mode: Mode, workdir: Path, outdir: Path, seed: int, result_path: Path) -> int:
    """Child-process side: run one scenario and write its result as JSON."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    module = importlib.import_module(module_name)
    ctx = BenchContext(mode=mode, workdir=workdir, outdir=outdir, seed=seed)
    result = module.run(ctx)
    result_path.write_text(json.dumps(result.to_json()))
    return 0


def run_scenario(
    name: str, module_name: str, title: str, mode: Mode, base: Path, outdir: Path, seed: int, timeout_s: float | None
) -> report.ScenarioOutcome:
    """Parent side: run one scenario in a child process and collect its result or error."""
    workdir = base / name
    workdir.mkdir(parents=True, exist_ok=True)
    result_path = base / f"{name}.result.json"
    err_path = base / f"{name}.stderr.log"
    cmd = [
        sys.executable,
        "-m",
        "bench",
        "--_worker",
        module_name,
        "--_mode",
        mode,
        "--_workdir",
        str(workdir),
        "--out",
        str(outdir),
        "--_seed",
        str(seed),
        "--_result",
        str(result_path),
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    start = time.perf_counter()
    outcome = report.ScenarioOutcome(name, title)
    with open(err_path, "wb") as err:
        # The child's stdout (progress lines) goes to ours; stderr is kept for the error report
        # and echoed, so a failing scenario shows its traceback where it happened.
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stderr=err, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            rc = None
    outcome.duration_s = time.perf_counter() - start
    stderr = err_path.read_text(errors="replace")
    if stderr.strip():
        sys.stderr.write(stderr[-8000:])
    if rc is None:
        outcome.error = f"timed out after {timeout_s:.0f} s (raise --timeout, or look at {err_path})"
    elif rc != 0 or not result_path.exists():
        tail = "\n".join(stderr.strip().splitlines()[-25:])
        outcome.error = f"exit code {rc}:\n{tail}" if tail else f"exit code {rc} and no result written"
    else:
        try:
            outcome.result = report.result_from_json(json.loads(result_path.read_text()))
        except Exception as exc:
            outcome.error = f"unreadable result {result_path}: {exc}"
    return outcome


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """Kill the scenario's process group (its TaskManagers, redis-server or JVM too)."""
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
    proc.wait()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="small data sizes; the whole run takes under 2 minutes")
    p.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results directory (default {DEFAULT_OUT})")
    p.add_argument("--keep", action="store_true", help="keep the work directory (data, logs) after the run")
    p.add_argument(
        "--results-md", action="store_true", help="also write bench/RESULTS.md and copy the charts to bench/results/"
    )
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--commit-mode",
        choices=("sync", "overlapped"),
        default="sync",
        help="execution.checkpointing.commit-mode of the Spark scenarios' clusters (default sync)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help=f"seconds per scenario before it is killed (default: {QUICK_TIMEOUT_S:.0f} quick, none full)",
    )
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    # Internal: the child process that runs one scenario.
    for hidden in ("--_worker", "--_mode", "--_workdir", "--_result"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--_seed", type=int, default=42, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args._worker:
        os.environ["KEYEDSTATE_BENCH_COMMIT_MODE"] = args.commit_mode  # inherited by the scenario's process
    if args._worker:
        return run_worker(args._worker, args._mode, Path(args._workdir), Path(args.out), args._seed, Path(args._result))

    scenarios, broken = discover()
    if args.list:
        for name, (module_name, title) in scenarios.items():
            print(f"{name:22s} {title}  ({module_name})")
        return 0
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in scenarios]
        if unknown:
            print(
                f"unknown scenario(s): {', '.join(unknown)}; known: {', '.join(scenarios) or 'none'}", file=sys.stderr
            )
            return 2
        scenarios = {n: v for n, v in scenarios.items() if n in wanted}
        broken = []
    mode: Mode = "quick" if args.quick else "full"
    timeout = args.timeout if args.timeout is not None else (QUICK_TIMEOUT_S if args.quick else None)
    outdir: Path = args.out.resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="keyedstate-bench-"))

    machine = machine_info()
    params: dict[str, Any] = {
        "mode": mode,
        "seed": args.seed,
        "scenarios": list(scenarios),
        "out": str(outdir),
        "workdir": str(base),
        "command": " ".join(["python -m bench", *(argv if argv is not None else sys.argv[1:])]),
    }
    print(describe(machine))
    print(
        f"params  : mode={mode}, seed={args.seed}, scenarios={','.join(scenarios) or 'none'}, out={outdir}, workdir={base}"
    )
    sys.stdout.flush()

    outcomes: list[report.ScenarioOutcome] = list(broken)
    started = time.perf_counter()
    try:
        for name, (module_name, title) in scenarios.items():
            print(f"\n>> {name}: {title}", flush=True)
            outcome = run_scenario(name, module_name, title, mode, base, outdir, args.seed, timeout)
            state = "ERROR" if outcome.error else ("skipped" if outcome.result and outcome.result.skipped else "done")
            print(f"<< {name}: {state} in {outcome.duration_s:.1f} s", flush=True)
            outcomes.append(outcome)
    finally:
        if args.keep:
            print(f"work directory kept: {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    params["total_s"] = round(time.perf_counter() - started, 1)

    charts: list[Path] = []
    try:
        charts = report.draw_series_charts(outcomes, outdir) + report.draw_summary_charts(outcomes, outdir)
    except Exception:
        # Charts are a view of the results; losing them must not lose the table and JSON.
        logger.exception("drawing the charts failed")
        print(f"drawing the charts failed:\n{traceback.format_exc()}", file=sys.stderr)
    report.write_json(outdir / "results.json", machine, params, outcomes)
    print(report.format_results(outcomes))
    print(
        f"\nresults: {outdir / 'results.json'}; charts: {', '.join(p.name for p in charts) or 'none'}; "
        f"total {params['total_s']} s"
    )
    if args.results_md:
        markdown = report.results_markdown(
            machine, params, outcomes, RESULTS_CHARTS.name, [p.stem for p in charts], params["command"]
        )
        report.publish_results(RESULTS_MD, charts, RESULTS_CHARTS, markdown)
        print(f"wrote {RESULTS_MD} and {RESULTS_CHARTS}/")
    return 1 if any(oc.error for oc in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
