"""Smoke runs of the benchmark suite: ``python -m bench --quick`` must still work end to end.

The default suite runs four quick scenarios without Spark (about 30 s: the client path, Redis,
the coordinator and a restore from S3, with the report and its charts); the others run with
``-m slow`` (``make test-all``): the three Spark workloads (W1, W2, batch_floor: about two
minutes, their pipelines checked against references in the default suite all the same by
tests/bench/test_w2_pipeline.py and tests/integration/spark) and the TLS client path, the 1 GB
checkpoint, the memory bound, the claim modes, the changelog commit cost and the slot processes (about 90 s).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


DEFAULT_SCENARIOS = ("client_path", "redis_compare", "coordinator_scale", "restore")
SPARK_SCENARIOS = ("w1", "w2", "batch_floor")
OTHER_SCENARIOS = (
    "client_path_tls",
    "checkpoint",
    "memory",
    "claim_modes",
    "changelog_commit",
    "changelog_checkpoint",
    "slot_processes",
)


def test_the_smoke_runs_cover_every_scenario() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "bench", "--list"], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    names = {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}
    runs = (DEFAULT_SCENARIOS, SPARK_SCENARIOS, OTHER_SCENARIOS)
    assert names == {n for run in runs for n in run}, "a new scenario must join one of the smoke runs"


@pytest.mark.timeout(480)
def test_quick_run_produces_results_and_charts(tmp_path: Path) -> None:
    _quick_run(tmp_path, DEFAULT_SCENARIOS)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("scenarios", [SPARK_SCENARIOS, OTHER_SCENARIOS], ids=["spark", "other"])
def test_quick_run_of_the_other_scenarios(tmp_path: Path, scenarios: tuple[str, ...]) -> None:
    _quick_run(tmp_path, scenarios)


def _quick_run(tmp_path: Path, scenarios: tuple[str, ...]) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--only", ",".join(scenarios), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=450,
    )
    assert proc.returncode == 0, f"bench failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    doc = json.loads((out / "results.json").read_text())
    assert doc["machine"]["cores"] and doc["machine"]["versions"]["rocksdict"]
    names = [s["name"] for s in doc["scenarios"]]
    assert set(names) == set(scenarios)
    for s in doc["scenarios"]:
        assert s["error"] is None, f"{s['name']}: {s['error']}"
        assert s["measurements"], f"{s['name']} measured nothing"
        for chart in s["charts"]:
            assert (out / f"{chart}.png").exists(), f"{s['name']}: chart {chart}.png missing"
    for summary in ("throughput.png", "ratios.png"):
        assert (out / summary).stat().st_size > 0
    assert "targets met:" in proc.stdout
