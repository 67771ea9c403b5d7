"""trigger_waiting (a turn instead of a refusal), the epoch of acks, and the lineage in ``_metadata``.

Time only moves when a test advances the manual scheduler; a caller waiting for its turn runs on
a thread of its own, and the test waits until its wake-up is scheduled before moving time.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import pytest

from keyedstate.common.errors import CorruptCheckpointError
from keyedstate.jobmanager.checkpoint import AckOutcome, CheckpointException, EpochCut, load_completed_checkpoint
from keyedstate.jobmanager.checkpoint import CheckpointFailureReason as R
from keyedstate.jobmanager.checkpoint.metadata import CheckpointMetadata
from keyedstate.jobmanager.lineage import EMPTY_LINEAGE, EpochLineage, LineageEntry
from tests.fixtures.waiting import Call, wait_for

LINEAGE = EpochLineage.of([LineageEntry("q1", 0, 0), LineageEntry("q2", 3, 5)])


def completed_one(h: Any) -> None:
    h.coordinator.trigger()
    h.coordinator.wait_for(1, timeout=0)


def test_trigger_waiting_waits_out_the_minimum_pause_on_the_scheduler(make_harness: Any) -> None:
    h = make_harness(min_pause_ms=5_000)
    completed_one(h)
    h.scheduler.advance(1_000)
    start = h.clock.monotonic_ms()
    call = Call(lambda: h.coordinator.trigger_waiting(60_000))
    wait_for(lambda: h.scheduler.pending() == [4_000], 10, "the wait for the rest of the minimum pause")
    assert len(h.cluster.barriers) == 1
    h.scheduler.advance(3_999)
    assert call.is_alive()
    h.scheduler.advance(1)
    pending = call.outcome()
    assert pending.checkpoint_id == 2 and h.clock.monotonic_ms() - start == 4_000
    assert h.coordinator.wait_for(2, timeout=0).checkpoint_id == 2


def test_trigger_waiting_waits_for_the_checkpoint_in_flight(make_harness: Any) -> None:
    h = make_harness(mode="manual")
    h.coordinator.trigger()
    call = Call(lambda: h.coordinator.trigger_waiting(60_000))
    wait_for(lambda: h.coordinator.stats.history()[0].status == "IN_PROGRESS", 10, "checkpoint 1 in flight")
    assert len(h.cluster.barriers) == 1
    h.cluster.ack_all(1)  # checkpoint 1 completes: the waiting caller gets the next turn
    pending = call.outcome()
    assert pending.checkpoint_id == 2 and [b.checkpoint_id for b in h.cluster.barriers] == [1, 2]


def test_trigger_waiting_gives_up_at_its_deadline_naming_the_refusal(make_harness: Any) -> None:
    h = make_harness(min_pause_ms=10_000)
    completed_one(h)
    call = Call(lambda: h.coordinator.trigger_waiting(3_000))
    wait_for(lambda: h.scheduler.pending() == [3_000], 10, "the wait for a turn")
    h.scheduler.advance(3_000)
    with pytest.raises(CheckpointException) as info:
        call.outcome()
    assert info.value.failure_reason is R.MINIMUM_TIME_BETWEEN_CHECKPOINTS
    assert info.value.detail == (
        "the last checkpoint completed 3000 ms ago and execution.checkpointing.min-pause is 10000 ms; retry in 7000 ms "
        "(waited 3000 ms for a turn)"
    )
    assert len(h.cluster.barriers) == 1


def test_trigger_waiting_raises_other_refusals_at_once(make_harness: Any) -> None:
    h = make_harness(tasks=list)
    with pytest.raises(CheckpointException) as info:
        h.coordinator.trigger_waiting(60_000)
    assert info.value.failure_reason is R.NOT_ALL_REQUIRED_TASKS_RUNNING
    assert h.scheduler.pending() == [] and h.cluster.barriers == []


def test_trigger_waiting_stops_waiting_when_the_jobmanager_closes(make_harness: Any) -> None:
    h = make_harness(min_pause_ms=10_000)
    completed_one(h)
    closed = threading.Event()
    call = Call(lambda: h.coordinator.trigger_waiting(60_000, closed=closed))
    wait_for(lambda: h.scheduler.pending() == [10_000], 10, "the wait for a turn")
    closed.set()
    with pytest.raises(CheckpointException, match=r"\(waited 60000 ms for a turn\)") as info:
        call.outcome()
    assert info.value.failure_reason is R.MINIMUM_TIME_BETWEEN_CHECKPOINTS


def test_a_savepoint_never_waits_for_a_turn(make_harness: Any) -> None:
    h = make_harness(mode="manual", min_pause_ms=10_000)
    h.coordinator.trigger()
    pending = h.coordinator.trigger_waiting(0, savepoint=True)
    assert pending.savepoint and pending.checkpoint_id == 2


# -- acks must hold the cut's epoch ---------------------------------------------------------------
def test_an_ack_from_a_slot_that_committed_after_the_cut_is_refused(make_harness: Any) -> None:
    h = make_harness(mode="manual")
    h.coordinator.trigger()  # cut at -1: nothing committed yet
    assert h.cluster.barriers[0].epoch == -1
    first, *rest = h.cluster.subtasks()
    assert h.cluster.ack(first, 1) is AckOutcome.SUCCESS
    h.cluster.committed_epoch = 0  # a commit slipped in: the other slots now hold epoch 0
    assert h.cluster.ack(rest[0], 1) is AckOutcome.DISCARDED
    with pytest.raises(CheckpointException) as info:
        h.coordinator.wait_for(1, timeout=0)
    assert info.value.failure_reason is R.CHECKPOINT_DECLINED
    assert info.value.detail == (
        f"subtask {rest[0]} sent an unusable acknowledgement for checkpoint 1: its committed epoch is 0 but the "
        "checkpoint was cut at epoch -1"
    )
    assert h.coordinator.latest_completed() is None
    # Late acks of the spoiled checkpoint change nothing.
    assert h.cluster.ack(rest[-1], 1) is AckOutcome.DISCARDED


# -- the lineage in _metadata ---------------------------------------------------------------------
@contextmanager
def _cut(epoch: int, lineage: EpochLineage) -> Iterator[EpochCut]:
    yield EpochCut(epoch, lineage)


def test_a_completed_checkpoint_records_the_cuts_lineage_up_to_its_epoch(make_harness: Any, tmp_path: Path) -> None:
    h = make_harness()
    h.cluster.committed_epoch = 6
    full = EpochLineage.of([*LINEAGE.entries, LineageEntry("q3", 7, 7)])  # a binding past the cut is not held
    h.cluster.cut = lambda: _cut(6, full)
    h.coordinator.trigger()
    completed = h.coordinator.wait_for(1, timeout=0)
    assert completed.metadata.epoch == 6 and completed.metadata.lineage == LINEAGE
    raw = json.loads((Path(h.job_dir[len("file://") :]) / "chk-1" / "_metadata").read_text())
    assert raw["epoch"] == 6
    assert raw["lineage"] == [
        {"query_id": "q1", "offset": 0, "first_epoch": 0},
        {"query_id": "q2", "offset": 3, "first_epoch": 5},
    ]
    assert load_completed_checkpoint(h.storage, completed.external_path).metadata.lineage == LINEAGE


def _metadata_dict(h: Any) -> dict[str, Any]:
    h.coordinator.trigger()
    return cast("dict[str, Any]", json.loads(h.coordinator.wait_for(1, timeout=0).metadata.to_json()))


def test_metadata_without_a_lineage_reads_as_empty_and_out_of_order_bindings_are_sorted(make_harness: Any) -> None:
    raw = _metadata_dict(make_harness())
    del raw["lineage"]
    assert CheckpointMetadata.from_json(json.dumps(raw)).lineage == EMPTY_LINEAGE
    raw["lineage"] = [
        {"query_id": "q2", "offset": 3, "first_epoch": 5},
        {"query_id": "q1", "offset": 0, "first_epoch": 0},
    ]
    assert CheckpointMetadata.from_json(json.dumps(raw)).lineage == LINEAGE


@pytest.mark.parametrize(
    "lineage, problem",
    [
        ({"query_id": "q1"}, "field 'lineage' must be a list"),
        ([{"query_id": "q1", "first_epoch": 0}], "missing field 'lineage[0].offset'"),
        ([{"query_id": 7, "offset": 0, "first_epoch": 0}], "field 'lineage[0].query_id' must be a string, got 7"),
        (
            [{"query_id": "q", "offset": 0, "first_epoch": True}],
            "field 'lineage[0].first_epoch' must be an integer, got True",
        ),
    ],
)
def test_a_damaged_lineage_is_reported_naming_the_field(make_harness: Any, lineage: Any, problem: str) -> None:
    raw = _metadata_dict(make_harness())
    raw["lineage"] = lineage
    with pytest.raises(CorruptCheckpointError) as info:
        CheckpointMetadata.from_json(json.dumps(raw), source="chk-1/_metadata")
    assert info.value.message == (
        f"checkpoint metadata chk-1/_metadata is unusable: {problem}. Restore from another checkpoint or savepoint "
        "(statectl checkpoint list shows the retained ones)"
    )


# -- checkpoint_holding: a checkpoint at an epoch, triggered only when none is ------------------------
def test_checkpoint_holding_returns_the_retained_checkpoint_at_the_epoch_without_a_barrier(make_harness: Any) -> None:
    h = make_harness()
    h.cluster.committed_epoch = 4
    completed_one(h)
    latest = h.coordinator.checkpoint_holding(3, threading.Event()).checkpoint
    assert latest is not None and latest.checkpoint_id == 1 and latest.metadata.epoch == 4
    assert len(h.cluster.barriers) == 1


def test_checkpoint_holding_tries_a_declined_checkpoint_again_after_a_pause(make_harness: Any) -> None:
    h = make_harness(mode="decline")
    h.cluster.committed_epoch = 2
    call = Call(lambda: h.coordinator.checkpoint_holding(2, threading.Event(), counted=False))
    wait_for(lambda: h.scheduler.pending() == [200], 10, "the pause after the declined checkpoint")
    assert len(h.cluster.barriers) == 1
    assert h.failovers == [], "an uncounted checkpoint's decline failed the job over"
    h.cluster.mode = "ack"
    h.scheduler.advance(200)
    waited = call.outcome()
    latest = waited.checkpoint
    assert latest is not None and latest.checkpoint_id == 2 and latest.metadata.epoch == 2
    assert waited.last_failure is not None and waited.last_failure.startswith("CHECKPOINT_DECLINED: "), waited


def test_checkpoint_holding_gives_up_at_the_checkpoint_timeout(make_harness: Any) -> None:
    h = make_harness(mode="decline", timeout_ms=300)
    call = Call(lambda: h.coordinator.checkpoint_holding(0, threading.Event(), counted=False))
    for tries in (1, 2):
        wait_for(lambda: h.scheduler.pending() == [200], 10, "the pause after a declined checkpoint")
        assert len(h.cluster.barriers) == tries
        h.scheduler.advance(200)
    waited = call.outcome()
    assert waited.checkpoint is None and len(h.cluster.barriers) == 2
    assert waited.last_failure is not None and "declined checkpoint 2" in waited.last_failure, waited


def test_checkpoint_holding_stops_when_no_longer_wanted_or_closed(make_harness: Any) -> None:
    h = make_harness()
    assert h.coordinator.checkpoint_holding(0, threading.Event(), wanted=lambda: False).checkpoint is None
    closed = threading.Event()
    closed.set()
    assert h.coordinator.checkpoint_holding(0, closed).checkpoint is None
    assert h.cluster.barriers == []


@pytest.mark.parametrize("mode", ["refused", "declined"])
def test_checkpoint_holding_skips_the_retry_pause_once_no_longer_wanted(make_harness: Any, mode: str) -> None:
    # A refused trigger (no task running, as during a failover) and a failed checkpoint alike:
    # when the caller stops wanting a checkpoint (its run was replaced), the wait ends at once,
    # without the 200 ms pause (time never moves here, so a pause would hang the call).
    h = make_harness(tasks=list) if mode == "refused" else make_harness(mode="decline")
    h.cluster.committed_epoch = 1
    answers = iter([True])  # wanted at the first look only
    waited = Call(lambda: h.coordinator.checkpoint_holding(1, threading.Event(), wanted=lambda: next(answers, False)))
    outcome = waited.outcome()
    assert outcome.checkpoint is None
    expected = "NOT_ALL_REQUIRED_TASKS_RUNNING: " if mode == "refused" else "CHECKPOINT_DECLINED: "
    assert outcome.last_failure is not None and outcome.last_failure.startswith(expected), outcome
    assert h.scheduler.pending() == []
    assert len(h.cluster.barriers) == (0 if mode == "refused" else 1)
