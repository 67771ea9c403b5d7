"""EpochLineage: which Spark query's batches a job's epochs are, and the batches it refuses."""

from __future__ import annotations

import re

import pytest

from keyedstate.common.errors import EpochGapError, Reason
from keyedstate.jobmanager.lineage import EMPTY_LINEAGE, EpochLineage, LineageEntry

UNNAMED = "the unnamed query (batches run outside a streaming query)"


def lineage(*entries: tuple[str, int, int]) -> EpochLineage:
    return EpochLineage.of(LineageEntry(*e) for e in entries)


def test_a_new_query_at_batch_0_starts_right_after_the_state_it_finds() -> None:
    assert EMPTY_LINEAGE.epoch_of("q1", 0, -1) == 0
    assert EMPTY_LINEAGE.epoch_of("q1", 0, 7) == 8  # a new checkpointLocation over existing state
    two = lineage(("q1", 0, 0))
    assert two.epoch_of("q2", 0, 41) == 42


def test_the_current_querys_batches_map_by_its_offset_whatever_the_state_holds() -> None:
    current = lineage(("q1", 0, 0), ("q2", 5, 7))  # q2's batch 2 was job epoch 7
    for committed in (-1, 3, 8, 100):
        assert current.epoch_of("q2", 2, committed) == 7
        assert current.epoch_of("q2", 9, committed) == 14  # the coordinator decides gap / already committed


def test_a_new_query_that_is_not_at_batch_0_is_refused_on_empty_state() -> None:
    with pytest.raises(EpochGapError) as info:
        EMPTY_LINEAGE.epoch_of("q1", 3, -1)
    assert info.value.reason is Reason.EPOCH_GAP
    assert info.value.message == (
        "query q1 is at batch 3, but the job's state is empty and has none of this query's batches 0..2: the job was "
        "resubmitted empty, or restored from a checkpoint of another query. Restore a checkpoint that holds this query's "
        "batch 2 (statectl job restore JOB --from PATH), or start the query from a new checkpointLocation"
    )


def test_a_new_query_that_is_not_at_batch_0_is_refused_on_another_querys_state() -> None:
    with pytest.raises(EpochGapError) as info:
        lineage(("q0", 0, 0)).epoch_of("q1", 1, 5)
    assert info.value.message.startswith(
        "query q1 is at batch 1, but the job's state holds epoch 5 (of query q0) and has none of this query's batches 0..0"
    )
    assert "batch 0 (statectl job restore JOB --from PATH)" in info.value.message


def test_a_superseded_query_is_refused_at_any_batch() -> None:
    moved = lineage(("q1", 0, 0), ("q2", 4, 4))
    for batch in (0, 3, 4, 99):
        with pytest.raises(EpochGapError) as info:
            moved.epoch_of("q1", batch, 6)
        assert info.value.message == (
            "the job's state has moved on from query q1 to query q2 (since epoch 4); stop this query, or restore a "
            "checkpoint taken before epoch 4"
        )


def test_the_unnamed_query_is_a_query_like_any_other() -> None:
    # Batches outside a streaming query (Spark Connect, foreachBatch called by hand) share the id "".
    assert EMPTY_LINEAGE.epoch_of("", 0, -1) == 0
    bound = EMPTY_LINEAGE.bind("", 0, 0)
    assert bound.epoch_of("", 3, 2) == 3
    with pytest.raises(
        EpochGapError,
        match="^" + re.escape(UNNAMED) + " is at batch 2, but the job's state holds epoch 4 \\(of query q1\\)",
    ):
        lineage(("q1", 0, 0)).epoch_of("", 2, 4)
    with pytest.raises(EpochGapError) as info:
        lineage(("", 0, 0), ("q1", 3, 3)).epoch_of("", 5, 4)
    assert info.value.message.startswith(f"the job's state has moved on from {UNNAMED} to query q1 (since epoch 3)")
    with pytest.raises(EpochGapError, match=re.escape(f"from query q1 to {UNNAMED} (since epoch 2)")):
        lineage(("q1", 0, 0), ("", 2, 2)).epoch_of("q1", 2, 2)


def test_bind_appends_a_new_query_and_keeps_the_current_one_unchanged() -> None:
    first = EMPTY_LINEAGE.bind("q1", 0, 0)
    assert first.entries == (LineageEntry("q1", 0, 0),)
    assert first.bind("q1", 7, 7) is first  # the current query's later batches bind nothing
    second = first.bind("q2", 0, 8)
    assert second.entries == (LineageEntry("q1", 0, 0), LineageEntry("q2", 8, 8))
    assert second.current == LineageEntry("q2", 8, 8)
    assert second.epoch_of("q2", 1, 8) == 9
    # Immutable: asking for an epoch binds nothing, and the old value is untouched.
    assert first.entries == (LineageEntry("q1", 0, 0),)
    first.epoch_of("q3", 0, 0)
    assert first.entries == (LineageEntry("q1", 0, 0),)
    assert second.to_list() == [
        {"query_id": "q1", "offset": 0, "first_epoch": 0},
        {"query_id": "q2", "offset": 8, "first_epoch": 8},
    ]


def test_up_to_drops_the_bindings_a_restored_state_does_not_hold() -> None:
    full = lineage(("q1", 0, 0), ("q2", 3, 3), ("q3", 6, 10))
    assert full.up_to(10) == full
    assert full.up_to(9).entries == (LineageEntry("q1", 0, 0), LineageEntry("q2", 3, 3))
    assert full.up_to(2).entries == (LineageEntry("q1", 0, 0),)
    assert full.up_to(-1) == EMPTY_LINEAGE
    restored = full.up_to(2)
    # After restoring epoch 2, q1 is current again; q2 binds afresh, but only from its batch 0.
    assert restored.epoch_of("q1", 3, 2) == 3
    assert restored.epoch_of("q2", 0, 2) == 3
    with pytest.raises(EpochGapError, match="query q2 is at batch 1"):
        restored.epoch_of("q2", 1, 2)


def test_of_orders_bindings_by_their_first_epoch() -> None:
    shuffled = EpochLineage.of([LineageEntry("q3", 6, 10), LineageEntry("q1", 0, 0), LineageEntry("q2", 3, 3)])
    assert [e.query_id for e in shuffled.entries] == ["q1", "q2", "q3"]
    assert shuffled.current == LineageEntry("q3", 6, 10)
    assert EMPTY_LINEAGE.current is None
