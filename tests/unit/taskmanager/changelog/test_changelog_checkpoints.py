"""The snapshot layer's view of a slot's changelog: cuts, materializations offered and confirmed, local segments.

A real local log in a temporary directory; the materializations are plain values (their upload
is the SnapshotManager's). What must hold: a checkpoint references the newest materialization
and every segment after it; local segments go only once a completed checkpoint confirmed a
materialization covering them; a superseded materialization that no checkpoint referenced gives
back exactly the files it uploaded itself, never one it reused.
"""

from __future__ import annotations

from pathlib import Path

from keyedstate.common.handles import ChangelogSegmentHandle, StateFileHandle, SubtaskStateHandle
from keyedstate.common.ids import JobId, KeyGroupRange, OperatorId, SubtaskId
from keyedstate.taskmanager.changelog import SlotChangelog
from keyedstate.taskmanager.snapshot.changelog import ChangelogCheckpoints, Materialization
from tests.fakes.clock import ManualClock

SUBTASK = SubtaskId(JobId("job"), OperatorId("op"), 0)
SHA = "ab" * 32


def _file(path: str) -> StateFileHandle:
    return StateFileHandle(path, 10, SHA, path.rsplit("/", 1)[-1], shared=True)


def _materialization(epoch: int, reused: tuple[str, ...], own: tuple[str, ...]) -> Materialization:
    files = tuple(_file(p) for p in (*reused, *own))
    return Materialization(epoch, files, 10 * len(files), frozenset(own))


def _log(tmp_path: Path) -> SlotChangelog:
    return SlotChangelog(tmp_path / "changelog", SUBTASK, ManualClock())


def _commit(log: SlotChangelog, *epochs: int) -> None:
    for epoch in epochs:
        with log.lock:
            log.append(epoch, [])


def test_the_first_cut_materializes_and_its_completion_drops_the_covered_segments(tmp_path: Path) -> None:
    log = _log(tmp_path)
    state = ChangelogCheckpoints(log)
    _commit(log, 0, 1)
    with log.lock:
        cut = state.cut(1)
    assert cut.materializes and len(cut.segments) == 1
    assert state.completed(_materialization(1, (), ("../shared/chk-1/a.sst",)), {})
    assert state.segments == [] and not list((tmp_path / "changelog").glob("*.seg"))


def test_a_checkpoint_references_the_candidate_and_only_the_segments_after_it(tmp_path: Path) -> None:
    log = _log(tmp_path)
    state = ChangelogCheckpoints(log)
    _commit(log, 0)
    with log.lock:
        state.cut(0)
    base = _materialization(0, (), ("../shared/chk-1/a.sst",))
    state.completed(base, {})
    _commit(log, 1, 2)
    with log.lock:
        first = state.cut(2)
    assert not first.materializes and [s.local.first_epoch for s in first.after(base)] == [1]
    uploaded = {first.segments[0].local.path: ChangelogSegmentHandle("../shared/chk-2/s1.seg", 1, 2, 9, SHA)}
    state.completed(base, uploaded)  # the same materialization: nothing newly confirmed, segment now durable
    assert state.segments[0].remote == uploaded[first.segments[0].local.path]
    _commit(log, 3)
    candidate = _materialization(3, ("../shared/chk-1/a.sst",), ("../shared/mat-x/b.sst",))
    assert state.offer(candidate) == []
    _commit(log, 4)
    with log.lock:
        cut = state.cut(4)
    assert cut.candidate is candidate and [s.local.last_epoch for s in cut.after(candidate)] == [4]
    # Until a checkpoint on top of the candidate completes, the segments since the confirmed one stay.
    assert len(list((tmp_path / "changelog").glob("*.seg"))) == 2
    assert state.completed(candidate, {})
    assert state.confirmed is candidate and state.candidate is None
    assert [s.local.last_epoch for s in state.segments] == [4]
    assert len(list((tmp_path / "changelog").glob("*.seg"))) == 1


def test_a_superseded_unreferenced_candidate_gives_back_only_the_files_it_uploaded(tmp_path: Path) -> None:
    state = ChangelogCheckpoints(_log(tmp_path))
    state.completed(_materialization(0, (), ("../shared/chk-1/a.sst",)), {})
    unused = _materialization(5, ("../shared/chk-1/a.sst",), ("../shared/mat-1/b.sst", "../shared/mat-1/MANIFEST"))
    assert state.offer(unused) == []
    newer = _materialization(9, ("../shared/chk-1/a.sst",), ("../shared/mat-2/c.sst",))
    assert sorted(f.path for f in state.offer(newer)) == ["../shared/mat-1/MANIFEST", "../shared/mat-1/b.sst"]
    # A stale offer (an older epoch than the newest) gives back its own files at once.
    stale = _materialization(7, ("../shared/chk-1/a.sst",), ("../shared/mat-3/d.sst",))
    assert [f.path for f in state.offer(stale)] == ["../shared/mat-3/d.sst"]
    assert state.candidate is newer


def test_a_candidate_a_checkpoint_referenced_is_never_given_back(tmp_path: Path) -> None:
    log = _log(tmp_path)
    state = ChangelogCheckpoints(log)
    state.completed(_materialization(0, (), ("../shared/chk-1/a.sst",)), {})
    referenced = _materialization(5, (), ("../shared/mat-1/b.sst",))
    state.offer(referenced)
    _commit(log, 1)
    with log.lock:
        state.cut(1)  # that checkpoint may still complete: its files may become the JobManager's
    assert state.offer(_materialization(9, (), ("../shared/mat-2/c.sst",))) == []


def test_a_restored_materialization_is_confirmed_and_its_segments_are_referenced_not_uploaded(tmp_path: Path) -> None:
    log = _log(tmp_path)
    state = ChangelogCheckpoints(log)
    restored = SubtaskStateHandle(
        OperatorId("op"),
        0,
        KeyGroupRange(0, 7),
        "rocksdb",
        files=[_file("../shared/chk-1/a.sst")],
        committed_epoch=4,
        changelog=[
            ChangelogSegmentHandle("../shared/chk-2/s1.seg", 1, 2, 30, SHA),
            ChangelogSegmentHandle("../shared/chk-4/s2.seg", 3, 4, 40, SHA),
        ],
        materialized_epoch=0,
    )
    state.restored(restored)
    _commit(log, 5, 6)
    with log.lock:
        cut = state.cut(6)
    # No snapshot of its own: the restored materialization, the restored segments, then the new one.
    assert not cut.materializes and cut.confirmed is not None and cut.confirmed.epoch == 0
    assert cut.confirmed.files == (_file("../shared/chk-1/a.sst"),) and cut.confirmed.incremental_size == 0
    assert [(s.local.first_epoch, s.local.last_epoch, s.remote) for s in cut.after(cut.confirmed)] == [
        (1, 2, restored.changelog[0]),
        (3, 4, restored.changelog[1]),
        (5, 6, None),
    ]


def test_a_sealed_segment_counts_its_change_sets_and_a_retracted_one_is_not_counted(tmp_path: Path) -> None:
    log = _log(tmp_path)
    _commit(log, 0, 1, 2)
    with log.lock:
        log.append(3, [])
        log.retract(3)
    with log.lock:
        (sealed,) = log.seal()
    assert (sealed.first_epoch, sealed.last_epoch, sealed.records) == (0, 2, 3)
