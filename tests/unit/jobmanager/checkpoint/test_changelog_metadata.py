"""``_metadata`` of changelog checkpoints: format version 2 with segments, version 1 without, both read.

Segments count as shared files (registry, retention, gc, verification see them through
``files()``), and a subtask whose segments could not rebuild its epochs is refused whole.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from keyedstate.common.descriptors import StateDescriptor, StateKind
from keyedstate.common.errors import CorruptCheckpointError
from keyedstate.common.handles import ChangelogSegmentHandle, StateFileHandle, SubtaskStateHandle
from keyedstate.common.ids import KeyGroupRange, OperatorId
from keyedstate.jobmanager.checkpoint.completed import CompletedCheckpoint
from keyedstate.jobmanager.checkpoint.metadata import (
    CheckpointMetadata,
    FileRef,
    OperatorSnapshot,
    SegmentRef,
    SubtaskSnapshot,
)

SHA = "cd" * 32
MAT = FileRef("../shared/mat-1/counts-0-000009.sst", 400, SHA, "000009.sst", True)
SEGMENTS = (
    SegmentRef("../shared/chk-7/counts-0-aa-000001.seg", 13, 15, 120, SHA),
    SegmentRef("../shared/chk-8/counts-0-bb-000002.seg", 16, 17, 80, SHA),
)


def changelog_checkpoint(
    segments: tuple[SegmentRef, ...] = SEGMENTS, materialized: int | None = 12
) -> CheckpointMetadata:
    sub = SubtaskSnapshot(0, KeyGroupRange(0, 7), "rocksdb", 17, 600, 80, (MAT,), segments, materialized)
    return CheckpointMetadata(
        job_id="orders",
        checkpoint_id=8,
        savepoint=False,
        timestamp_ms=1,
        epoch=17,
        max_parallelism=8,
        operators=(OperatorSnapshot("counts", 1, (StateDescriptor("total", StateKind.VALUE),), (sub,)),),
    )


def test_a_changelog_checkpoint_round_trips_as_version_2_and_lists_its_segments_as_shared_files() -> None:
    meta = changelog_checkpoint()
    assert meta.problems() == [] and meta.has_changelog
    raw = json.loads(meta.to_json())
    assert raw["version"] == 2
    assert raw["operators"][0]["subtasks"][0]["materialized_epoch"] == 12
    assert [s["first_epoch"] for s in raw["operators"][0]["subtasks"][0]["changelog"]] == [13, 16]
    again = CheckpointMetadata.from_json(meta.to_bytes())
    assert again == meta
    paths = [f.path for _, _, f in again.files()]
    assert paths == [MAT.path, *(s.path for s in SEGMENTS)]
    completed = CompletedCheckpoint(again, "file:///ckpt/orders/chk-8")
    assert "file:///ckpt/orders/shared/chk-7/counts-0-aa-000001.seg" in completed.shared_files


def test_a_checkpoint_without_segments_is_still_version_1_and_version_1_files_are_read() -> None:
    meta = changelog_checkpoint(segments=(), materialized=None)
    raw = json.loads(meta.to_json())
    assert raw["version"] == 1 and "changelog" not in raw["operators"][0]["subtasks"][0]
    assert CheckpointMetadata.from_json(json.dumps(raw)) == meta


def test_restore_handles_carry_absolute_segment_paths_and_the_materialized_epoch() -> None:
    sub = changelog_checkpoint().operators[0].subtasks[0]
    handle = sub.to_handle(OperatorId("counts"), "s3://b/ckpt/orders/chk-8")
    assert handle.changelog == [
        ChangelogSegmentHandle("s3://b/ckpt/orders/shared/chk-7/counts-0-aa-000001.seg", 13, 15, 120, SHA),
        ChangelogSegmentHandle("s3://b/ckpt/orders/shared/chk-8/counts-0-bb-000002.seg", 16, 17, 80, SHA),
    ]
    assert handle.materialized_epoch == 12 and handle.snapshot_epoch == 12
    plain = SubtaskStateHandle(OperatorId("c"), 0, KeyGroupRange(0, 1), "rocksdb", [StateFileHandle("x", 1, SHA)])
    assert plain.snapshot_epoch == plain.committed_epoch


def _damaged(mutate: Any) -> str:
    raw = json.loads(changelog_checkpoint().to_json())
    mutate(raw["operators"][0]["subtasks"][0])
    return json.dumps(raw)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_damaged(lambda s: s["changelog"].pop(0)), "starts at epoch 16, after epoch 13"),
        (_damaged(lambda s: s["changelog"].pop()), "the changelog ends at epoch 15, the snapshot is of epoch 17"),
        (_damaged(lambda s: s["changelog"][1].update(first_epoch=17)), "changelog[1] starts at epoch 17"),
        (_damaged(lambda s: s.update(materialized_epoch=18)), "must be at most committed_epoch 17"),
        (_damaged(lambda s: s["changelog"][0].update(path="../../x.seg")), "must be ../shared/<name>"),
        (
            _damaged(lambda s: s.pop("materialized_epoch")),
            "missing field 'operators[0].subtasks[0].materialized_epoch'",
        ),
    ],
)
def test_segments_that_cannot_rebuild_the_epochs_are_refused(data: str, message: str) -> None:
    with pytest.raises(CorruptCheckpointError) as info:
        CheckpointMetadata.from_json(data)
    assert message in info.value.message


def test_a_savepoint_with_segments_is_refused() -> None:
    meta = dataclasses.replace(changelog_checkpoint(), savepoint=True)
    assert any("a savepoint must be self-contained" in p for p in meta.problems())
