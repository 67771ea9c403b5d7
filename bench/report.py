"""Presenting a run: the console table, ``results.json``, the PNG charts and ``bench/RESULTS.md``.

Everything here works on :class:`ScenarioResult` objects (or their JSON form read back), so a
chart or a results page can be redrawn from a saved ``results.json`` without running anything.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.result import Measurement, Ratio, ScenarioResult, Series

logger = logging.getLogger(__name__)

THROUGHPUT_CHART = "throughput"
RATIOS_CHART = "ratios"


@dataclass
class ScenarioOutcome:
    """One scenario as the runner saw it: its result, or the error that stopped it."""

    name: str
    title: str
    result: ScenarioResult | None = None
    error: str | None = None
    duration_s: float = 0.0
    charts: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        body = self.result.to_json() if self.result is not None else ScenarioResult(self.name, self.title).to_json()
        body.update(error=self.error, duration_s=round(self.duration_s, 2), charts=self.charts)
        return body


def result_from_json(data: dict[str, Any]) -> ScenarioResult:
    """Rebuild a ScenarioResult from its ``to_json()`` form (``met`` and runner fields are dropped)."""
    ratios = [Ratio(**{k: v for k, v in r.items() if k != "met"}) for r in data.get("ratios", [])]
    return ScenarioResult(
        name=data["name"],
        title=data["title"],
        params=dict(data.get("params", {})),
        measurements=[Measurement(**m) for m in data.get("measurements", [])],
        ratios=ratios,
        series=[Series(**s) for s in data.get("series", [])],
        notes=list(data.get("notes", [])),
        skipped=data.get("skipped"),
    )


# -- formatting -----------------------------------------------------------------------------------
def format_value(value: float) -> str:
    """Compact human figure: 1.23M, 456k, 12.3, 0.045."""
    a = abs(value)
    if a >= 10_000_000:
        return f"{value / 1e6:.0f}M"
    if a >= 1_000_000:
        return f"{value / 1e6:.2f}M"
    if a >= 10_000:
        return f"{value / 1e3:.0f}k"
    if a >= 100:
        return f"{value:.0f}"
    if a >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def verdict(ratio: Ratio) -> str:
    met = ratio.met
    return "-" if met is None else ("MET" if met else "MISSED")


def target_text(ratio: Ratio) -> str:
    return "" if ratio.target is None else f"{ratio.direction} {ratio.target:g}"


def _table(headers: list[str], rows: list[list[str]], align_right: set[int]) -> list[str]:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in align_right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]


def format_results(outcomes: list[ScenarioOutcome]) -> str:
    """The console table: per scenario its measurements, then its ratios with target and verdict."""
    out: list[str] = []
    for oc in outcomes:
        out.append("")
        out.append(f"== {oc.name}: {oc.title}  ({oc.duration_s:.1f} s)")
        if oc.error:
            out.append(f"   ERROR: {oc.error.strip().splitlines()[-1] if oc.error.strip() else 'failed'}")
            continue
        res = oc.result
        assert res is not None
        if res.skipped:
            out.append(f"   skipped: {res.skipped}")
        if res.params:
            out.append("   params: " + ", ".join(f"{k}={v}" for k, v in res.params.items()))
        if res.measurements:
            rows = [[m.name, format_value(m.value), m.unit, m.note] for m in res.measurements]
            out += ["   " + s for s in _table(["measurement", "value", "unit", "note"], rows, {1})]
        if res.ratios:
            out.append("")
            rows = [[r.name, f"{r.value:.3g}", target_text(r), verdict(r), r.note] for r in res.ratios]
            out += ["   " + s for s in _table(["ratio", "value", "target", "verdict", "note"], rows, {1})]
        for note in res.notes:
            out.append(f"   note: {note}")
    out.append("")
    out.append(summary_line(outcomes))
    return "\n".join(out)


def summary_line(outcomes: list[ScenarioOutcome]) -> str:
    ratios = [r for oc in outcomes if oc.result for r in oc.result.ratios if r.target is not None]
    met = sum(1 for r in ratios if r.met)
    errors = [oc.name for oc in outcomes if oc.error]
    text = f"targets met: {met}/{len(ratios)}"
    missed = [f"{oc.name}:{r.name}" for oc in outcomes if oc.result for r in oc.result.ratios if r.met is False]
    if missed:
        text += "; missed: " + ", ".join(missed)
    if errors:
        text += "; scenarios with errors: " + ", ".join(errors)
    return text


# -- JSON -------------------------------------------------------------------------------------------
def write_json(path: Path, machine: dict[str, Any], params: dict[str, Any], outcomes: list[ScenarioOutcome]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"machine": machine, "params": params, "scenarios": [oc.to_json() for oc in outcomes]}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)


# -- charts -----------------------------------------------------------------------------------------
def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def draw_series_charts(outcomes: list[ScenarioOutcome], outdir: Path) -> list[Path]:
    """One PNG per ``Series.chart`` stem; the series sharing a stem share the axes."""
    charts: dict[str, list[tuple[str, Series]]] = {}
    for oc in outcomes:
        if oc.result is None:
            continue
        for s in oc.result.series:
            charts.setdefault(s.chart, []).append((oc.name, s))
            if s.chart not in oc.charts:
                oc.charts.append(s.chart)
    if not charts:
        return []
    plt = _pyplot()
    paths = []
    for stem, series in charts.items():
        fig, ax = plt.subplots(figsize=(7, 4.2))
        bars = [s for _, s in series if s.kind == "bar"]
        for _, s in series:
            if s.kind == "line":
                ax.plot(s.x, s.y, marker="o", label=s.label)
        if bars:
            width = 0.8 / len(bars)
            for i, s in enumerate(bars):
                ax.bar([x + (i - (len(bars) - 1) / 2) * width for x in range(len(s.x))], s.y, width, label=s.label)
            ax.set_xticks(range(len(bars[0].x)), [f"{x:g}" if abs(x) < 10_000 else format_value(x) for x in bars[0].x])
        ax.set_xlabel(series[0][1].x_label)
        ax.set_ylabel(series[0][1].y_label)
        ax.set_title(stem.replace("_", " "))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = outdir / f"{stem}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def draw_summary_charts(outcomes: list[ScenarioOutcome], outdir: Path) -> list[Path]:
    """``throughput.png`` (every rate measured, per scenario) and ``ratios.png`` (ratios against targets)."""
    plt = _pyplot()
    paths = []
    rates = [(oc.name, m) for oc in outcomes if oc.result for m in oc.result.measurements if m.unit.endswith("/s")]
    if rates:
        fig, ax = plt.subplots(figsize=(9, max(3.0, 0.32 * len(rates) + 1.2)))
        names = sorted({n for n, _ in rates}, key=[n for n, _ in rates].index)
        colors = {n: f"C{i % 10}" for i, n in enumerate(names)}
        labels = [f"{m.name} ({m.unit})" for _, m in rates]
        ax.barh(range(len(rates)), [m.value for _, m in rates], color=[colors[n] for n, _ in rates])
        ax.set_yticks(range(len(rates)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("throughput (log scale)")
        ax.set_title("throughput per scenario (same run)")
        from matplotlib.patches import Patch

        ax.legend(handles=[Patch(color=colors[n], label=n) for n in names], fontsize=7, loc="lower right")
        ax.grid(True, axis="x", alpha=0.3)
        fig.tight_layout()
        path = outdir / f"{THROUGHPUT_CHART}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    ratios = [(oc.name, r) for oc in outcomes if oc.result for r in oc.result.ratios]
    if ratios:
        fig, ax = plt.subplots(figsize=(9, max(3.0, 0.32 * len(ratios) + 1.2)))
        color = {True: "tab:green", False: "tab:red", None: "tab:gray"}
        # Log scale: reported-only ratios (batched / single-key: hundreds) sit next to targets near 1.
        ax.barh(range(len(ratios)), [max(r.value, 1e-4) for _, r in ratios], color=[color[r.met] for _, r in ratios])
        ax.set_xscale("log")
        ax.axvline(1.0, color="gray", linewidth=0.8, linestyle=":")
        for i, (_, r) in enumerate(ratios):
            if r.target is not None:
                ax.plot([r.target, r.target], [i - 0.4, i + 0.4], color="black", linewidth=2)
        ax.set_yticks(range(len(ratios)), [f"{n}: {r.name}" for n, r in ratios], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("ratio, log scale (black tick: target; green met, red missed, grey no target)")
        ax.set_title("ratios against targets (same run)")
        ax.grid(True, axis="x", alpha=0.3)
        fig.tight_layout()
        path = outdir / f"{RATIOS_CHART}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# -- RESULTS.md -------------------------------------------------------------------------------------
def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def results_markdown(
    machine: dict[str, Any],
    params: dict[str, Any],
    outcomes: list[ScenarioOutcome],
    chart_dir: str,
    charts: list[str],
    command: str,
) -> str:
    """``bench/RESULTS.md``: machine, targets with verdicts, every scenario's figures and notes, charts."""
    lines = [
        "# Benchmark results",
        "",
        f"Produced by `{command}` ({params.get('mode', '?')} mode). Every target is a ratio measured in this one run "
        "on this machine; absolute figures are for context and drift between runs.",
        "",
        "## Machine",
        "",
        f"- CPU: {machine.get('cpu')}, {machine.get('cores')} cores, {machine.get('ram_gb')} GiB RAM, {machine.get('os')}",
        f"- Python {machine.get('python')}, commit `{machine.get('git_commit')}`",
        "- " + ", ".join(f"{k} {v}" for k, v in machine.get("versions", {}).items() if v),
        "",
        "## Targets",
        "",
        "| scenario | ratio | value | target | verdict |",
        "|---|---|---:|---|---|",
    ]
    for oc in outcomes:
        if oc.error:
            lines.append(f"| {oc.name} | (error) | | | ERROR |")
        for r in oc.result.ratios if oc.result else []:
            lines.append(f"| {oc.name} | {_md_escape(r.name)} | {r.value:.3g} | {target_text(r)} | {verdict(r)} |")
    lines += ["", summary_line(outcomes), ""]
    for oc in outcomes:
        lines += [f"## {oc.name}: {oc.title}", ""]
        if oc.error:
            lines += ["```", oc.error.strip()[-2000:], "```", ""]
            continue
        res = oc.result
        assert res is not None
        if res.skipped:
            lines += [f"Skipped: {res.skipped}", ""]
        if res.params:
            lines += ["Parameters: " + ", ".join(f"`{k}={v}`" for k, v in res.params.items()), ""]
        if res.measurements:
            lines += ["| measurement | value | unit | note |", "|---|---:|---|---|"]
            lines += [
                f"| {_md_escape(m.name)} | {format_value(m.value)} | {m.unit} | {_md_escape(m.note)} |"
                for m in res.measurements
            ]
            lines.append("")
        if res.ratios:
            lines += ["| ratio | value | target | verdict | note |", "|---|---:|---|---|---|"]
            lines += [
                f"| {_md_escape(r.name)} | {r.value:.3g} | {target_text(r)} | {verdict(r)} | {_md_escape(r.note)} |"
                for r in res.ratios
            ]
            lines.append("")
        for note in res.notes:
            lines += [f"- {note}"]
        if res.notes:
            lines.append("")
        for stem in oc.charts:
            lines += [f"![{stem}]({chart_dir}/{stem}.png)", ""]
    lines += ["## Summary charts", ""]
    lines += [f"![{c}]({chart_dir}/{c}.png)" for c in charts if c in (THROUGHPUT_CHART, RATIOS_CHART)]
    lines.append("")
    return "\n".join(lines)


def publish_results(md_path: Path, charts: list[Path], chart_dst: Path, markdown: str) -> list[Path]:
    """Write RESULTS.md and copy the PNGs of this run that it links (to ``bench/results/``)."""
    chart_dst.mkdir(parents=True, exist_ok=True)
    for stale in chart_dst.glob("*.png"):
        stale.unlink()
    copied = []
    for png in charts:
        target = chart_dst / png.name
        shutil.copyfile(png, target)
        copied.append(target)
    md_path.write_text(markdown)
    return copied
