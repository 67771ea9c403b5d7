"""Fixtures of the chaos suite: ``chaos_run(schedule)`` runs one schedule; soak results are summarized.

A schedule whose daemons run on network-namespace hosts takes the ``netns`` fixture (root and
iptables; skipped with the reason otherwise). Each run works in its own ``tmp_path``; the logs of
a failed run (daemons, drivers, progress) are copied to the results directory.

Environment:

* ``KEYEDSTATE_CHAOS_SEEDS=1234,1240``: the seeds the soak runs (replay); default 1000..1000+N-1
  with ``KEYEDSTATE_CHAOS_SOAK_RUNS=N`` (default 60);
* ``KEYEDSTATE_CHAOS_RESULTS``: where the soak writes ``summary.json``, ``summary.md`` and the logs
  of failed runs (default ``var/chaos/`` in the repository, which git ignores).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.chaos._direct import DirectChaosRun
from tests.chaos._epoch import EpochChaosRun
from tests.chaos._run import RunResult, keep_logs
from tests.chaos._schedule import FaultSchedule
from tests.chaos._summary import write_summary

logger = logging.getLogger(__name__)

_REPO = Path(__file__).resolve().parents[2]


def results_dir() -> Path:
    return Path(os.environ.get("KEYEDSTATE_CHAOS_RESULTS") or _REPO / "var" / "chaos")


def soak_seeds() -> list[int]:
    explicit = os.environ.get("KEYEDSTATE_CHAOS_SEEDS", "").strip()
    if explicit:
        return [int(s) for s in explicit.replace(" ", ",").split(",") if s]
    return list(range(1000, 1000 + int(os.environ.get("KEYEDSTATE_CHAOS_SOAK_RUNS", "60"))))


def seed_param(seed: int) -> Any:
    """``pytest.param`` of a seed, id ``seed_<n>``, with the netns and spark markers its schedule needs."""
    schedule = FaultSchedule.from_seed(seed)
    marks = [pytest.mark.netns] if schedule.netns else []
    if schedule.mode == "epoch":
        marks.append(pytest.mark.spark)
    return pytest.param(seed, id=f"seed_{seed}", marks=marks)


@pytest.fixture(scope="session")
def chaos_results() -> Iterator[list[RunResult]]:
    """Every run's result in this session; the soak's summary is written when the session ends."""
    results: list[RunResult] = []
    yield results
    soak = [r for r in results if getattr(r, "_soak", False)]
    if soak:
        json_path, md_path = write_summary(soak, results_dir())
        logger.warning("chaos soak summary: %s and %s", json_path, md_path)
        print(f"\nchaos soak summary: {md_path}\n{md_path.read_text(encoding='utf-8')}")


@pytest.fixture
def chaos_run(
    request: pytest.FixtureRequest, tmp_path: Path, chaos_results: list[RunResult]
) -> Iterator[Callable[..., RunResult]]:
    """``chaos_run(schedule, soak=False, config=None)``: run the schedule to its end and return its :class:`RunResult`.

    ``config`` adds keys for every daemon of the run (the JobManager's apply to the job)."""

    def run(
        schedule: FaultSchedule,
        soak: bool = False,
        deadline_s: float | None = None,
        config: dict[str, str] | None = None,
    ) -> RunResult:
        net = request.getfixturevalue("netns") if schedule.netns else None
        base = tmp_path / f"seed-{schedule.seed}"
        chaos: EpochChaosRun | DirectChaosRun
        if schedule.mode == "epoch":
            chaos = EpochChaosRun(schedule, base, net, deadline_s=deadline_s or 300.0, config=config)
        else:
            chaos = DirectChaosRun(schedule, base, net, deadline_s=deadline_s or 180.0, config=config)
        try:
            result = chaos.run()
            if not result.passed:
                chaos.cluster.dump_threads()  # what a daemon that stopped answering waits on, in its log
        finally:
            chaos.close()
        result._soak = soak  # type: ignore[attr-defined]
        chaos_results.append(result)
        if not result.passed:
            kept = results_dir() / "failed" / f"seed-{schedule.seed}"
            try:
                keep_logs(base, kept)
                result.log_dir = str(kept)
                (kept / "report.txt").write_text(result.report() + "\n", encoding="utf-8")
            except OSError as exc:
                logger.warning("could not keep the logs of seed %d: %s", schedule.seed, exc)
        return result

    yield run
