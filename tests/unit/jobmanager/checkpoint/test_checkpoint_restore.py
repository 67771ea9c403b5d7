"""Loading checkpoints back, checking their files, and planning (rescaled) restores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from keyedstate.common.descriptors import (
    OperatorSpec,
    ReduceField,
    ReduceFunction,
    StateDescriptor,
    StateKind,
    TtlConfig,
)
from keyedstate.common.errors import CorruptCheckpointError, IncompatibleCheckpointError
from keyedstate.common.ids import JobId, KeyGroupRange, SubtaskId
from keyedstate.jobmanager.checkpoint import (
    CheckpointMetadata,
    CheckpointNotFoundError,
    FileRef,
    OperatorSnapshot,
    SubtaskSnapshot,
    checkpoint_dir_of,
    find_latest_checkpoint,
    load_checkpoint,
    plan_restore,
    verify_files_exist,
)

BASE = "file:///ckpt/job-1/chk-5"
VALUE = StateDescriptor("total", StateKind.VALUE)
LIST = StateDescriptor("events", StateKind.LIST)


def checkpoint(
    parallelism: int = 2, max_p: int = 8, states: tuple[StateDescriptor, ...] = (VALUE, LIST)
) -> CheckpointMetadata:
    from keyedstate.common.keygroups import key_group_range_for_subtask

    subtasks = tuple(
        SubtaskSnapshot(
            i,
            key_group_range_for_subtask(max_p, parallelism, i),
            "rocksdb",
            3,
            10,
            10,
            (
                FileRef(f"op-{i}/MANIFEST", 10, "", "MANIFEST", False),
                FileRef(f"../shared/{i}.sst", 5, "", f"{i}.sst", True),
            ),
        )
        for i in range(parallelism)
    )
    return CheckpointMetadata(
        "job-1", 5, False, 0, 3, max_p, (OperatorSnapshot("counts", parallelism, states, subtasks),)
    )


def test_rescale_assigns_every_overlapping_snapshot() -> None:
    meta = checkpoint(parallelism=2)  # [0,3] and [4,7]
    plan = plan_restore(meta, [OperatorSpec("counts", 3, (VALUE, LIST))], 8, checkpoint_dir=BASE)
    # New ranges: [0,2], [3,5], [6,7].
    assigned = {s.subtask_index: [h.subtask_index for h in handles] for s, handles in plan.items()}
    assert assigned == {0: [0], 1: [0, 1], 2: [1]}
    handle = plan[SubtaskId("job-1", "counts", 1)][1]
    assert (handle.key_groups.start, handle.key_groups.end) == (4, 7), "old range kept: the TaskManager filters"
    assert [f.path for f in handle.files] == [f"{BASE}/op-1/MANIFEST", "file:///ckpt/job-1/shared/1.sst"]

    down = plan_restore(
        meta, [OperatorSpec("counts", 1, (VALUE, LIST))], 8, checkpoint_dir=BASE + "/_metadata", job_id=JobId("job-2")
    )
    assert list(down) == [SubtaskId("job-2", "counts", 0)]
    assert [h.subtask_index for h in down[SubtaskId("job-2", "counts", 0)]] == [0, 1]
    same = plan_restore(meta, [OperatorSpec("counts", 2, (VALUE, LIST))], 8, checkpoint_dir=BASE)
    assert [[h.subtask_index for h in hs] for hs in same.values()] == [[0], [1]]


def test_up_to_max_parallelism_every_subtask_gets_exactly_its_owner() -> None:
    meta = checkpoint(parallelism=3, max_p=8)
    plan = plan_restore(meta, [OperatorSpec("counts", 8, (VALUE, LIST))], 8, checkpoint_dir=BASE)
    for subtask, handles in plan.items():
        assert len(handles) == 1
        owner = handles[0]
        assert subtask.subtask_index in KeyGroupRange(owner.key_groups.start, owner.key_groups.end)


def test_new_operators_and_states_start_empty() -> None:
    plan = plan_restore(
        checkpoint(),
        [
            OperatorSpec("counts", 2, (VALUE, LIST, StateDescriptor("fresh", StateKind.MAP))),
            OperatorSpec("brand-new", 2),
        ],
        8,
        checkpoint_dir=BASE,
    )
    assert plan[SubtaskId("job-1", "brand-new", 0)] == [] and plan[SubtaskId("job-1", "brand-new", 1)] == []
    assert len(plan[SubtaskId("job-1", "counts", 0)]) == 1


def test_max_parallelism_is_fixed_for_the_job_life() -> None:
    with pytest.raises(IncompatibleCheckpointError) as info:
        plan_restore(checkpoint(), [OperatorSpec("counts", 2, (VALUE, LIST))], 128, checkpoint_dir=BASE)
    message = str(info.value)
    assert "max parallelism 8 but the job has 128" in message and "fixed for a job's life" in message
    assert "pipeline.max-parallelism: 8" in message


def test_operator_missing_from_the_job_needs_allow_non_restored_state() -> None:
    with pytest.raises(
        IncompatibleCheckpointError,
        match=r"operator\(s\) \['counts'\] that the job does not have.*allow-non-restored-state",
    ):
        plan_restore(checkpoint(), [OperatorSpec("other", 1)], 8, checkpoint_dir=BASE)
    plan = plan_restore(checkpoint(), [OperatorSpec("other", 1)], 8, checkpoint_dir=BASE, allow_non_restored_state=True)
    assert plan == {SubtaskId("job-1", "other", 0): []}


def test_state_dropped_from_the_job_needs_allow_non_restored_state() -> None:
    with pytest.raises(
        IncompatibleCheckpointError, match="had state 'events' \\(list\\) which the job no longer declares"
    ):
        plan_restore(checkpoint(), [OperatorSpec("counts", 2, (VALUE,))], 8, checkpoint_dir=BASE)
    plan_restore(
        checkpoint(), [OperatorSpec("counts", 2, (VALUE,))], 8, checkpoint_dir=BASE, allow_non_restored_state=True
    )


@pytest.mark.parametrize(
    ("new_state", "message"),
    [
        (
            StateDescriptor("total", StateKind.MAP),
            "state 'total' of operator 'counts' was value state and is now declared as map",
        ),
        (
            StateDescriptor("total", StateKind.VALUE, TtlConfig(1000)),
            "checkpointed without TTL and is now declared with TTL",
        ),
        (
            StateDescriptor("total", StateKind.REDUCING, None, (ReduceField("n", ReduceFunction.SUM),)),
            "was value state",
        ),
    ],
)
def test_changed_states_are_refused_saying_what_differs(new_state: StateDescriptor, message: str) -> None:
    with pytest.raises(IncompatibleCheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_restore(checkpoint(), [OperatorSpec("counts", 2, (new_state, LIST))], 8, checkpoint_dir=BASE)
    # Even allow-non-restored-state never reinterprets state of another kind.
    with pytest.raises(IncompatibleCheckpointError):
        plan_restore(
            checkpoint(),
            [OperatorSpec("counts", 2, (new_state, LIST))],
            8,
            checkpoint_dir=BASE,
            allow_non_restored_state=True,
        )


def test_changed_reduce_fields_are_refused() -> None:
    old = StateDescriptor("sums", StateKind.REDUCING, None, (ReduceField("n"),))
    new = StateDescriptor("sums", StateKind.REDUCING, None, (ReduceField("n"), ReduceField("m")))
    with pytest.raises(
        IncompatibleCheckpointError,
        match=r"had fields \[n:sum:int64\] and is now declared with \[n:sum:int64, m:sum:int64\]",
    ):
        plan_restore(checkpoint(states=(old,)), [OperatorSpec("counts", 2, (new,))], 8, checkpoint_dir=BASE)


# -- loading from storage --------------------------------------------------------------------------
def _write(storage: Any, directory: str, meta: CheckpointMetadata, *, files: bool = True) -> None:
    storage.write_bytes(directory + "/_metadata", meta.to_bytes())
    if files:
        for _, _, f in meta.files():
            parent, _, _ = directory.rpartition("/")
            path = f"{parent}/{f.path[3:]}" if f.path.startswith("../") else f"{directory}/{f.path}"
            storage.write_bytes(path, b"x" * f.size)


def test_load_accepts_the_dir_or_the_metadata_file(storage: Any, tmp_path: Path) -> None:
    chk = tmp_path.as_uri() + "/job-1/chk-5"
    _write(storage, chk, checkpoint())
    assert load_checkpoint(storage, chk) == checkpoint()
    assert load_checkpoint(storage, chk + "/_metadata") == checkpoint()
    assert load_checkpoint(storage, chk + "/") == checkpoint()
    assert checkpoint_dir_of(chk + "/_metadata") == chk
    verify_files_exist(storage, checkpoint(), chk)


def test_load_reports_missing_and_incomplete_checkpoints(storage: Any, tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint or savepoint at .*nothing exists there"):
        load_checkpoint(storage, tmp_path.as_uri() + "/nope")
    storage.write_bytes(tmp_path.as_uri() + "/job-1/chk-6/op-0/MANIFEST", b"x")
    with pytest.raises(CheckpointNotFoundError, match="chk-6 has no _metadata: it is not a completed checkpoint"):
        load_checkpoint(storage, tmp_path.as_uri() + "/job-1/chk-6")


def test_corrupt_metadata_names_the_file(storage: Any, tmp_path: Path) -> None:
    path = tmp_path.as_uri() + "/job-1/chk-7/_metadata"
    storage.write_bytes(path, b'{"format": "keyedstate-checkpoint", "vers')
    with pytest.raises(CorruptCheckpointError, match=f"checkpoint metadata {path} is unusable: not valid UTF-8 JSON"):
        load_checkpoint(storage, path)


def test_verify_names_the_first_missing_or_truncated_file(storage: Any, tmp_path: Path) -> None:
    chk = tmp_path.as_uri() + "/job-1/chk-5"
    meta = checkpoint()
    _write(storage, chk, meta)
    storage.delete(tmp_path.as_uri() + "/job-1/shared/1.sst")
    with pytest.raises(
        CorruptCheckpointError, match=r"is missing .*/job-1/shared/1\.sst \(operator 'counts' subtask 1\)"
    ):
        verify_files_exist(storage, meta, chk)
    storage.write_bytes(tmp_path.as_uri() + "/job-1/shared/1.sst", b"x" * 5)
    storage.write_bytes(chk + "/op-0/MANIFEST", b"short")
    with pytest.raises(CorruptCheckpointError, match="op-0/MANIFEST has 5 bytes but _metadata records 10"):
        verify_files_exist(storage, meta, chk)


def test_find_latest_skips_incomplete_and_corrupt_checkpoints(storage: Any, tmp_path: Path) -> None:
    job = tmp_path.as_uri() + "/job-1"
    assert find_latest_checkpoint(storage, job) is None
    for cid in (3, 5):
        meta = checkpoint()
        meta = CheckpointMetadata(meta.job_id, cid, False, 0, 3, 8, meta.operators)
        _write(storage, f"{job}/chk-{cid}", meta, files=False)
    storage.write_bytes(f"{job}/chk-6/_metadata", b"garbage")
    storage.write_bytes(f"{job}/chk-7/op-0/MANIFEST", b"x")
    storage.write_bytes(f"{job}/chk-10x/_metadata", b"not a checkpoint dir name")
    latest = find_latest_checkpoint(storage, job)
    assert latest is not None and latest.checkpoint_id == 5 and latest.external_path == f"{job}/chk-5"
    assert latest.shared_files == {f"{job}/shared/0.sst", f"{job}/shared/1.sst"}
