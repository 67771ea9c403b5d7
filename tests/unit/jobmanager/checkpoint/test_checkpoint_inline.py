"""Checkpoints in the JobManager's memory: the coordinator stores the files acks carry inline,
refuses a state over the limit with its own reason, and refuses inline files for a checkpoint
that goes to files. Real ``jobmanager://`` storage, manual time."""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import pytest

from keyedstate.common.handles import StateFileHandle, SubtaskStateHandle
from keyedstate.common.ids import CheckpointId, KeyGroupRange, OperatorId
from keyedstate.common.keygroups import key_group_range_for_subtask
from keyedstate.common.storage import open_storage
from keyedstate.jobmanager.checkpoint import AckOutcome, PendingStatus
from keyedstate.jobmanager.checkpoint import CheckpointFailureReason as R
from tests.unit.jobmanager.checkpoint.conftest import JOB, MAX_P


@pytest.fixture
def in_memory(make_harness: Any) -> Any:
    root = f"jobmanager://unit-{uuid.uuid4().hex[:8]}"
    storage = open_storage(root)
    h = make_harness(
        mode="manual", storage_override=storage, job_dir_override=f"{root}/{JOB}", inline_max_state_size=1000
    )
    yield h
    storage.delete_dir(f"{root}/{JOB}")


def _handle(h: Any, subtask: Any, size: int) -> SubtaskStateHandle:
    op = next(o for o in h.cluster.operators if o.operator_id == subtask.operator_id)
    kg = key_group_range_for_subtask(MAX_P, op.parallelism, subtask.subtask_index)
    data = bytes([subtask.subtask_index]) * size
    owner = f"{subtask.operator_id}-{subtask.subtask_index}"
    return SubtaskStateHandle(
        operator_id=OperatorId(subtask.operator_id),
        subtask_index=subtask.subtask_index,
        key_groups=KeyGroupRange(kg.start, kg.end),
        backend="hashmap",
        files=[
            StateFileHandle(f"{owner}/state.kvs", len(data), hashlib.sha256(data).hexdigest(), "state.kvs", data=data)
        ],
        full_size=len(data),
        incremental_size=len(data),
    )


def test_inline_files_are_stored_in_memory_and_the_checkpoint_completes(in_memory: Any) -> None:
    h = in_memory
    pending = h.coordinator.trigger()
    barrier = h.cluster.barrier(pending.checkpoint_id)
    assert barrier.inline_max_state_size == 1000 and not barrier.incremental
    for subtask in h.cluster.subtasks():
        assert h.coordinator.acknowledge(pending.checkpoint_id, _handle(h, subtask, 600)) is AckOutcome.SUCCESS
    assert pending.status is PendingStatus.COMPLETED
    latest = h.coordinator.latest_completed()
    assert latest.external_path == f"{h.job_dir}/chk-1"
    stored = h.storage.read_bytes(f"{h.job_dir}/chk-1/counts-1/state.kvs")
    assert stored == bytes([1]) * 600
    assert [f.size for _, _, f in latest.metadata.files()] == [600, 600, 600]
    assert b"state.kvs" in h.storage.read_bytes(f"{h.job_dir}/chk-1/_metadata")


def test_a_state_over_the_limit_aborts_with_state_size_limit_exceeded(in_memory: Any) -> None:
    h = in_memory
    pending = h.coordinator.trigger()
    first, second = h.cluster.subtasks()[:2]
    assert h.coordinator.acknowledge(pending.checkpoint_id, _handle(h, first, 1000)) is AckOutcome.SUCCESS
    assert h.coordinator.acknowledge(pending.checkpoint_id, _handle(h, second, 1001)) is AckOutcome.DISCARDED
    assert pending.status is PendingStatus.ABORTED
    assert pending.failure_reason is R.STATE_SIZE_LIMIT_EXCEEDED
    assert "1001 bytes, more than the 1000 bytes of execution.checkpointing.jobmanager-storage.max-state-size" in (
        pending.failure_message or ""
    )
    assert "use execution.checkpointing.storage: filesystem" in (pending.failure_message or "")
    assert not list(h.storage.list(f"{h.job_dir}/chk-{pending.checkpoint_id}", recursive=True))
    assert h.coordinator.consecutive_failures == 1


def test_inline_files_for_a_checkpoint_written_to_files_are_refused(make_harness: Any) -> None:
    h = make_harness(mode="manual")
    pending = h.coordinator.trigger()
    assert h.cluster.barrier(pending.checkpoint_id).inline_max_state_size == 0
    subtask = h.cluster.subtasks()[0]
    assert h.coordinator.acknowledge(pending.checkpoint_id, _handle(h, subtask, 10)) is AckOutcome.DISCARDED
    assert pending.status is PendingStatus.ABORTED and pending.failure_reason is R.CHECKPOINT_DECLINED
    assert "the TaskManager must upload them there" in (pending.failure_message or "")


def test_a_late_inline_ack_is_answered_as_usual(in_memory: Any) -> None:
    h = in_memory
    pending = h.coordinator.trigger()
    for subtask in h.cluster.subtasks():
        h.coordinator.acknowledge(pending.checkpoint_id, _handle(h, subtask, 10))
    again = _handle(h, h.cluster.subtasks()[0], 10)
    assert h.coordinator.acknowledge(CheckpointId(pending.checkpoint_id), again) is AckOutcome.DUPLICATE
    assert again.files[0].data is None
