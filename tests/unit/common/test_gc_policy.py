"""The daemons' garbage-collector policy: thresholds raised, start-up objects frozen."""

from __future__ import annotations

import gc

from keyedstate.common import gc_policy


def test_apply_raises_the_thresholds_and_freezes_what_exists() -> None:
    before = gc.get_threshold()
    try:
        gc_policy.apply()
        assert gc.get_threshold() == gc_policy.THRESHOLDS
        assert gc_policy.THRESHOLDS[0] > before[0]
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
