"""CI smoke run of the benchmark suite: ``python -m bench --quick`` must still work end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(480)
def test_quick_run_produces_results_and_charts(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=450,
    )
    assert proc.returncode == 0, f"bench failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    doc = json.loads((out / "results.json").read_text())
    assert doc["machine"]["cores"] and doc["machine"]["versions"]["rocksdict"]
    names = [s["name"] for s in doc["scenarios"]]
    assert {"client_path", "redis_compare", "coordinator_scale"} <= set(names)
    for s in doc["scenarios"]:
        assert s["error"] is None, f"{s['name']}: {s['error']}"
        assert s["measurements"], f"{s['name']} measured nothing"
        for chart in s["charts"]:
            assert (out / f"{chart}.png").exists(), f"{s['name']}: chart {chart}.png missing"
    for summary in ("throughput.png", "ratios.png"):
        assert (out / summary).stat().st_size > 0
    assert "targets met:" in proc.stdout
