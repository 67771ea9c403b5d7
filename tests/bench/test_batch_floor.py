"""The batch_floor scenario's figures from synthetic progress and timings (no Spark, no cluster)."""

from __future__ import annotations

import pytest

from bench.scenarios import batch_floor
from bench.w1 import sparkjobs
from keyedstate.common.spark import BatchTiming


def _progress(batch_id: int, trigger_ms: int, rows: int = batch_floor.EVENTS_PER_BATCH) -> sparkjobs.BatchProgress:
    return sparkjobs.BatchProgress(batch_id, rows, {"triggerExecution": trigger_ms, "addBatch": trigger_ms - 50})


def test_p90_is_an_observed_batch() -> None:
    assert batch_floor.p90([float(v) for v in range(1, 21)]) == 18.0
    assert batch_floor.p90([5.0, 1.0, 3.0]) == 5.0
    assert batch_floor.p90([7.0]) == 7.0


def test_ours_joins_progress_and_timings_by_batch_and_leaves_out_the_warmup_batch() -> None:
    timings = [BatchTiming(b, tasks_s=0.1 * b, commit_s=0.05, total_s=0.2 * b, checkpoint_s=0.02) for b in range(3)]
    run = sparkjobs.OursRun(1.0, 3, timings, {}, [_progress(b, 300 + b) for b in range(3)])
    got = batch_floor.ours_batches(run)
    assert [b.trigger_ms for b in got] == [301.0, 302.0]
    assert [b.foreach_batch_ms for b in got] == pytest.approx([200.0, 400.0])
    assert [b.commit_ms for b in got] == pytest.approx([30.0, 30.0])
    assert [b.checkpoint_ms for b in got] == pytest.approx([20.0, 20.0])


def test_a_batch_that_did_not_read_one_file_is_an_error() -> None:
    run = sparkjobs.OursRun(1.0, 2, [], {}, [_progress(0, 300), _progress(1, 300, rows=2_000)])
    with pytest.raises(RuntimeError, match="did not read"):
        batch_floor.ours_batches(run)


def test_the_target_is_ours_over_native_per_batch_median_at_most_one() -> None:
    ours = [
        batch_floor.OursBatch(400.0, 300.0, 150.0, 100.0, 30.0, {"triggerExecution": 400, "addBatch": 310}),
        batch_floor.OursBatch(600.0, 500.0, 250.0, 150.0, 50.0, {"triggerExecution": 600, "addBatch": 510}),
    ]
    native = [_progress(1, 200), _progress(2, 400)]
    result = batch_floor.build_result({}, ours, native, [_progress(1, 250), _progress(2, 260)])
    target = result.ratios[0]
    assert target.value == pytest.approx(500.0 / 300.0)
    assert (target.target, target.direction) == (1.0, "<=")
    assert target.met is False
    assert all(r.target is None for r in result.ratios[1:])
    assert {m.unit for m in result.measurements} == {"ms"}
    assert "epoch commit 125 ms" in result.notes[0]
    assert "addBatch" in result.notes[1]
    assert "+200 ms" in result.notes[2]
    assert "off the critical path" in result.notes[3]
