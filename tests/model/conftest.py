"""Fixtures of the model tests, and a summary of every exploration at the end of the run."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.model.checker import Report, explore
from tests.model.protocol import DOCUMENTED, Experiment, Model, Protections

_REPORTS: list[tuple[str, Report]] = []

Check = Callable[..., Report]


@pytest.fixture
def check(request: pytest.FixtureRequest) -> Check:
    """Explore an experiment under some protections; the report is also kept for the summary."""

    def run(
        experiment: Experiment,
        protections: Protections = DOCUMENTED,
        *,
        liveness: bool = True,
        ignore: frozenset[str] = frozenset(),
    ) -> Report:
        report = explore(Model(experiment, protections, ignore), experiment.name, liveness=liveness)
        _REPORTS.append((request.node.name, report))
        print(report.counterexample() if report.violation else report.summary())
        return report

    return run


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _REPORTS:
        return
    tr = terminalreporter
    tr.section("exactly-once model checking")
    total_states = sum(r.states for _, r in _REPORTS)
    total_time = sum(r.seconds for _, r in _REPORTS)
    for test, r in _REPORTS:
        tr.write_line(f"{test}")
        tr.write_line(f"    {r.summary()}")
        if r.violation:
            tr.write_line(f"    trace: {r.story()}")
    tr.write_line(f"{len(_REPORTS)} explorations, {total_states:,} states, {total_time:.1f} s")
