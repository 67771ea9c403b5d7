"""The checkpoint history keeps each subtask's ack (time, sync and async phases, sizes) for the REST API."""

from __future__ import annotations

import dataclasses
from typing import Any

from keyedstate.common.ids import CheckpointId, JobId
from keyedstate.common.lifecycle import CheckpointStatus
from keyedstate.jobmanager.checkpoint import CheckpointFailureReason, CheckpointStatsTracker, SubtaskAckStats


def test_each_ack_is_recorded_with_the_coordinators_clock_and_the_handles_timings(make_harness: Any) -> None:
    h = make_harness(mode="manual")
    h.coordinator.trigger()
    subtasks = h.cluster.subtasks()
    for i, subtask in enumerate(subtasks):
        h.clock.advance(100)
        handle = dataclasses.replace(h.cluster.snapshot(subtask, 1), sync_duration_ms=10 + i, async_duration_ms=200 + i)
        h.coordinator.acknowledge(CheckpointId(1), handle)
        entry = h.coordinator.stats.entry(CheckpointId(1))
        assert entry is not None and len(entry.acks) == i + 1
        ack = entry.acks[-1]
        assert (ack.operator_id, ack.subtask_index) == (subtask.operator_id, subtask.subtask_index)
        assert (ack.sync_duration_ms, ack.async_duration_ms) == (10 + i, 200 + i)
        assert ack.ack_timestamp_ms == h.clock.now_ms()
        assert ack.full_size == handle.full_size and ack.incremental_size == handle.incremental_size
    entry = h.coordinator.stats.entry(CheckpointId(1))
    assert entry is not None and entry.status is CheckpointStatus.COMPLETED
    # Completion keeps the acks; the full size is the sum of the subtasks'.
    assert len(entry.acks) == len(subtasks)
    assert sum(a.full_size for a in entry.acks) == entry.full_size


def test_acks_of_a_checkpoint_no_longer_in_progress_are_not_recorded() -> None:
    stats = CheckpointStatsTracker(JobId("job"))
    stats.report_pending(CheckpointId(1), 0, savepoint=False, num_subtasks=2, path="p", epoch=0)
    ack = SubtaskAckStats("op", 0, 5, 1, 2, 3, 4)
    stats.report_ack(CheckpointId(1), ack)
    stats.report_failed(CheckpointId(1), CheckpointFailureReason.CHECKPOINT_EXPIRED, "late", duration_ms=9)
    stats.report_ack(CheckpointId(1), dataclasses.replace(ack, subtask_index=1))
    entry = stats.entry(CheckpointId(1))
    assert entry is not None and entry.acks == (ack,) and entry.num_acknowledged == 1
    stats.close()


def test_acks_in_progress_read_in_arrival_order_and_reads_are_snapshots() -> None:
    stats = CheckpointStatsTracker(JobId("job"), history_size=2)
    stats.report_pending(CheckpointId(1), 0, savepoint=False, num_subtasks=3, path="p", epoch=0)
    acks = [SubtaskAckStats("op", i, 10 + i, 1, 2, 3, 4) for i in range(3)]
    stats.report_ack(CheckpointId(1), acks[0])
    stats.report_ack(CheckpointId(1))  # counted, without timings
    first = stats.entry(CheckpointId(1))
    stats.report_ack(CheckpointId(1), acks[1])
    assert first is not None and first.acks == (acks[0],) and first.num_acknowledged == 2
    (listed,) = stats.history()
    assert listed.acks == (acks[0], acks[1]) and listed.num_acknowledged == 3
    stats.report_completed(CheckpointId(1), duration_ms=5, full_size=9, incremental_size=3, path="p", epoch=0)
    stats.report_ack(CheckpointId(1), acks[2])
    done = stats.entry(CheckpointId(1))
    assert done is not None and done.acks == (acks[0], acks[1]) and done.num_acknowledged == 3
    assert stats.latest_completed == done
    # A checkpoint pushed out of the history while in progress records nothing more.
    for cid in (2, 3):
        stats.report_pending(CheckpointId(cid), 0, savepoint=False, num_subtasks=1, path="p", epoch=0)
    assert stats.entry(CheckpointId(1)) is None
    stats.report_ack(CheckpointId(1), acks[2])
    assert stats.entry(CheckpointId(1)) is None and [e.checkpoint_id for e in stats.history()] == [3, 2]
    stats.close()
