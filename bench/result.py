"""The contract between scenarios and the runner.

Each scenario module in ``bench/scenarios/`` exposes::

    NAME: str                      # short id, e.g. "client_path"
    TITLE: str                     # one line for the table heading
    def run(ctx: BenchContext) -> ScenarioResult

The runner (``bench/__main__.py``) picks scenarios, gives each a fresh work directory,
collects the results, prints the table, writes ``bench/out/results.json`` and draws the charts.
Every target is a *ratio measured in the same run*, because absolute times drift on shared
2-core machines; absolute figures are reported alongside for context only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Mode = Literal["quick", "full"]


@dataclass(frozen=True)
class BenchContext:
    """What a scenario gets from the runner."""

    mode: Mode
    workdir: Path  # empty directory owned by this scenario; removed afterwards unless --keep
    outdir: Path  # where charts and artefacts go (bench/out by default)
    seed: int = 42

    @property
    def quick(self) -> bool:
        return self.mode == "quick"


@dataclass(frozen=True)
class Measurement:
    """One absolute figure, e.g. ("client multi-put", 812_000, "keys/s")."""

    name: str
    value: float
    unit: str
    note: str = ""


@dataclass(frozen=True)
class Ratio:
    """One same-run ratio with its target.

    ``direction`` says which side of the target passes: ">=" for throughput ratios
    (ours / baseline), "<=" for cost ratios (our time / baseline time, bytes fraction...).
    ``target`` is None for a ratio that is reported without a target.
    """

    name: str
    value: float
    target: float | None = None
    direction: Literal[">=", "<="] = ">="
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        return self.value >= self.target if self.direction == ">=" else self.value <= self.target


@dataclass(frozen=True)
class Series:
    """A chart series: ``x`` against ``y`` (e.g. state size MB against checkpoint seconds)."""

    chart: str  # chart file stem; series with the same chart share one PNG
    label: str
    x: list[float]
    y: list[float]
    x_label: str
    y_label: str
    kind: Literal["line", "bar"] = "line"


@dataclass(frozen=True)
class ScenarioResult:
    name: str
    title: str
    params: dict[str, Any] = field(default_factory=dict)
    measurements: list[Measurement] = field(default_factory=list)
    ratios: list[Ratio] = field(default_factory=list)
    series: list[Series] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # profile summaries, caveats
    skipped: str | None = None  # reason, when a baseline could not run here

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["ratios"] = [dict(dataclasses.asdict(r), met=r.met) for r in self.ratios]
        return out
