"""The chaos soak (opt in: ``-m chaos_soak``): many seeds, one after the other, and a summary.

    .venv/bin/python -m pytest tests/chaos -m chaos_soak                      # seeds 1000..1059
    KEYEDSTATE_CHAOS_SOAK_RUNS=100 .venv/bin/python -m pytest tests/chaos -m chaos_soak
    KEYEDSTATE_CHAOS_SEEDS=1017 .venv/bin/python -m pytest tests/chaos -m chaos_soak   # replay one

It writes ``summary.json`` and ``summary.md`` to ``KEYEDSTATE_CHAOS_RESULTS`` (default
``var/chaos/``): runs, faults scheduled and injected by kind, batches re-run, events lost and
doubled (both must be 0), and every failure with its seed; failed runs' logs go to ``failed/``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.chaos._run import RunResult
from tests.chaos._schedule import FaultSchedule
from tests.chaos.conftest import seed_param, soak_seeds

pytestmark = [pytest.mark.chaos_soak, pytest.mark.timeout(600)]


@pytest.mark.parametrize("seed", [seed_param(s) for s in soak_seeds()])
def test_soak(seed: int, chaos_run: Callable[..., RunResult]) -> None:
    result = chaos_run(FaultSchedule.from_seed(seed), soak=True)
    assert result.passed, result.report()
