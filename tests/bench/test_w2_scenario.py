"""The W2 scenario's figures from given run times (no Spark, no cluster): ratios and the full-size estimate."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from bench.scenarios import w2_sessionization as w2
from bench.w2 import data as w2data
from bench.w2 import sparkjobs


def test_ratios_and_the_line_through_two_subset_sizes(tmp_path: Path) -> None:
    full = w2data.generate(tmp_path / "full", events=4_000, users=100, batches=2, files_per_batch=2, seed=3)
    warm = w2data.subset_users(full, tmp_path / "warm", 10)
    sub = w2data.subset_users(full, tmp_path / "sub", 50)
    sized = {"ours": full, "aIPWS": sub, "tWSiP": warm}
    runs = {
        label: sparkjobs.W2Run(s, sized[label].expected)
        for label, s in (("ours", 2.0), ("aIPWS", 12.0), ("tWSiP", 5.0))
    }
    rates = {label: sized[label].events / r.seconds for label, r in runs.items()}
    ratios = w2._ratios(rates, sized)
    faster = max(rates["aIPWS"], rates["tWSiP"])
    assert ratios[0].value == pytest.approx(rates["ours"] / faster) and ratios[0].target == w2.TARGET

    small_seconds = {"aIPWS": 4.0, "tWSiP": 5.0}

    def small_run(label: str) -> Callable[[w2data.W2Data, str], sparkjobs.W2Run]:
        return lambda d, tag: sparkjobs.W2Run(small_seconds[label], d.expected)

    variants = {label: small_run(label) for label in small_seconds}
    inputs = w2._Inputs(full, sub, warm, warm)
    extra, note = w2._extrapolated(variants, inputs, runs, sized, rates["ours"])
    # aIPWS: 4 s at 10 users, 12 s at 50 -> 0.2 s per user -> 22 s at 100 users
    assert extra[0].value == pytest.approx(rates["ours"] / (full.events / 22.0))
    # tWSiP ran on the warm-up subset itself: no second size, no estimate
    assert len(extra) == 1 and "tWSiP ran on the warm-up subset itself" in note
    assert "~22 s" in note and extra[0].target is None


def test_a_variant_that_disagrees_with_the_reference_fails_the_scenario(tmp_path: Path) -> None:
    data = w2data.generate(tmp_path / "d", events=400, users=20, batches=2, files_per_batch=1, seed=1)
    wrong = w2data.Sessions(frozenset(set(data.expected.closed) | {(99, 0, 1, 0)}), data.expected.open)
    with pytest.raises(RuntimeError, match="W2 aIPWS: differs"):
        w2._checked("aIPWS", data, sparkjobs.W2Run(1.0, wrong))
