"""The runner's bookkeeping: ratio verdicts, table and JSON round trip, discovery order, and a failing scenario."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import report
from bench.__main__ import _order_key, discover, run_scenario
from bench.result import Measurement, Ratio, ScenarioResult, Series


def _result() -> ScenarioResult:
    return ScenarioResult(
        "demo",
        "Demo scenario",
        {"keys": 10},
        [Measurement("put", 812_000, "keys/s", "best of 3"), Measurement("sync phase", 12.5, "ms")],
        [Ratio("ours / baseline", 0.95, 0.9), Ratio("time / plain upload", 1.4, 1.25, "<="), Ratio("info", 3.0)],
        [Series("demo_chart", "ours", [1, 2], [3, 4], "GB", "s")],
        ["profile: most time in write"],
    )


def test_ratio_verdicts_follow_direction() -> None:
    assert Ratio("a", 0.9, 0.9).met is True
    assert Ratio("a", 0.89, 0.9).met is False
    assert Ratio("a", 1.25, 1.25, "<=").met is True
    assert Ratio("a", 1.26, 1.25, "<=").met is False
    assert Ratio("a", 5.0).met is None


def test_table_shows_verdicts_and_summary() -> None:
    outcome = report.ScenarioOutcome("demo", "Demo scenario", _result(), duration_s=1.0)
    failed = report.ScenarioOutcome("broken", "Broken", error="Traceback ...\nValueError: no data")
    text = report.format_results([outcome, failed])
    assert "MET" in text and "MISSED" in text
    assert "ValueError: no data" in text
    assert "targets met: 1/2" in text
    assert "demo:time / plain upload" in text and "scenarios with errors: broken" in text


def test_json_round_trip_keeps_everything(tmp_path: Path) -> None:
    outcome = report.ScenarioOutcome("demo", "Demo scenario", _result(), duration_s=2.0)
    path = tmp_path / "results.json"
    report.write_json(path, {"cpu": "x"}, {"mode": "quick"}, [outcome])
    doc = json.loads(path.read_text())
    scenario = doc["scenarios"][0]
    assert scenario["error"] is None and scenario["ratios"][1]["met"] is False
    assert report.result_from_json(scenario) == _result()


def test_charts_and_results_page(tmp_path: Path) -> None:
    outcomes = [report.ScenarioOutcome("demo", "Demo scenario", _result())]
    charts = report.draw_series_charts(outcomes, tmp_path) + report.draw_summary_charts(outcomes, tmp_path)
    assert sorted(p.name for p in charts) == ["demo_chart.png", "ratios.png", "throughput.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in charts)
    md = report.results_markdown(
        {"versions": {}}, {"mode": "full"}, outcomes, "results", [p.stem for p in charts], "python -m bench"
    )
    copied = report.publish_results(tmp_path / "RESULTS.md", charts, tmp_path / "results", md)
    assert "![demo_chart](results/demo_chart.png)" in md and "| demo | ours / baseline | 0.95 | >= 0.9 | MET |" in md
    assert all(p.exists() for p in copied) and (tmp_path / "RESULTS.md").read_text() == md


def test_discovery_order_puts_known_scenarios_first() -> None:
    assert _order_key("client_path") < _order_key("redis_compare") < _order_key("w1_keyed_aggregate")
    assert _order_key("w1_keyed_aggregate") < _order_key("checkpoint_s3") < _order_key("coordinator_scale")
    assert _order_key("coordinator_scale") < _order_key("zzz_new")
    scenarios, broken = discover()
    assert not broken, broken[0].error if broken else ""
    assert {"client_path", "redis_compare", "coordinator_scale"} <= set(scenarios)


@pytest.mark.parametrize(
    "body, expected",
    [
        ("def run(ctx):\n    raise ValueError('the data set is missing')\n", "ValueError: the data set is missing"),
        ("import os\ndef run(ctx):\n    os._exit(3)\n", "exit code 3"),
    ],
)
def test_a_failing_scenario_is_an_error_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, expected: str
) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "failing_scenario.py").write_text("NAME = 'failing'\nTITLE = 'fails'\n" + body)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "pkg"))
    outcome = run_scenario("failing", "failing_scenario", "fails", "quick", tmp_path / "work", tmp_path / "out", 1, 60)
    assert outcome.result is None and outcome.error is not None
    assert expected in outcome.error


def test_a_hanging_scenario_is_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "hanging_scenario.py").write_text(
        "import threading\nNAME = 'hang'\nTITLE = 'hangs'\ndef run(ctx):\n    threading.Event().wait()\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "pkg"))
    outcome = run_scenario("hang", "hanging_scenario", "hangs", "quick", tmp_path / "work", tmp_path / "out", 1, 3)
    assert outcome.error is not None and "timed out after 3 s" in outcome.error
