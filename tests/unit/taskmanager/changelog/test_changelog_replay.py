"""Epoch commits with the changelog on, and replay of the logged segments into fresh real backends.

A slot commits random epochs of every state kind (TTL states included) while its clock moves;
replaying the sealed segments into an empty backend, whose own clock is elsewhere, must give the
same stored bytes (values, list elements, map entries and their TTL timestamps), in the same key
groups or split over two backends of a higher parallelism.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from keyedstate.common.batches import Winner
from keyedstate.common.descriptors import OperatorSpec, ReduceField, StateDescriptor, StateKind, TtlConfig
from keyedstate.common.errors import CorruptCheckpointError, InvalidArgumentError
from keyedstate.common.ids import JobId, KeyGroupRange, OperatorId, SubtaskId, TaskManagerId
from keyedstate.common.keygroups import key_group_range_for_subtask
from keyedstate.taskmanager.changelog import ReplaySource, SlotChangelog, read_segment, replay
from keyedstate.taskmanager.epochs import EpochTransaction
from keyedstate.taskmanager.epochs.attempt import TaskAttempt
from keyedstate.taskmanager.epochs.slot import EpochCommitError, SlotEpochs
from keyedstate.taskmanager.slots import SlotTable
from keyedstate.taskmanager.state import KeyedStateBackend, StateLimits, create_backend
from keyedstate.taskmanager.state.mutation import Mutation, MutationKind
from tests.fakes.clock import ManualClock

MP = 64
FULL = KeyGroupRange(0, MP - 1)
SUBTASK = SubtaskId(JobId("job-cl"), OperatorId("op"), 0)
STATES = (
    StateDescriptor("v", StateKind.VALUE, ttl=TtlConfig(60_000)),
    StateDescriptor("l", StateKind.LIST),
    StateDescriptor("m", StateKind.MAP, ttl=TtlConfig(60_000)),
    StateDescriptor("r", StateKind.REDUCING, reduce_fields=(ReduceField("count"),)),
)
KINDS = ["rocksdb", "hashmap"]


def _backend(
    kind: str,
    base: Path,
    key_groups: KeyGroupRange,
    clock: ManualClock,
    index: int = 0,
    limits: StateLimits | None = None,
) -> KeyedStateBackend:
    subtask = SubtaskId(SUBTASK.job_id, SUBTASK.operator_id, index)
    return create_backend(
        kind, subtask, key_groups, MP, STATES, local_dir=base, limits=limits or StateLimits(), clock=clock
    )


def _logging_slot(
    kind: str, base: Path, clock: ManualClock, *, fast: bool = True, limits: StateLimits | None = None
) -> tuple[KeyedStateBackend, SlotEpochs, SlotChangelog]:
    table = SlotTable(1, TaskManagerId("tm-cl"))
    slot = table.reserve(SUBTASK, OperatorSpec(SUBTASK.operator_id, 1, STATES), FULL, MP, 0, 1, "", False)
    backend = _backend(kind, base / "live", FULL, clock, limits=limits)
    table.activate(slot, backend)
    changelog = SlotChangelog(base / "changelog", SUBTASK, clock)
    return backend, SlotEpochs(slot, backend, base / "staging", fast_commit=fast, changelog=changelog), changelog


def _stage(rng: random.Random, epochs: SlotEpochs, epoch: int) -> dict[int, Winner]:
    keys = [b"k%d" % i for i in range(30)]
    winners = {}
    for partition in range(rng.randint(1, 3)):
        attempt = rng.randint(1, 3)
        tx = EpochTransaction(epochs, TaskAttempt(epoch, partition, attempt))
        for _ in range(rng.randint(1, 8)):
            n = rng.randint(1, 6)
            ks = rng.sample(keys, n)
            op = rng.random()
            if op < 0.3:
                tx.value_put("v", ks, [rng.randbytes(rng.randint(0, 20)) for _ in ks], b"")
            elif op < 0.45:
                tx.list_append("l", ks, [rng.randbytes(4) for _ in ks], b"ns")
            elif op < 0.55:
                tx.list_update("l", ks, [rng.randbytes(3) for _ in ks], b"ns")
            elif op < 0.7:
                tx.map_put("m", ks, [rng.randbytes(2) for _ in ks], [rng.randbytes(5) for _ in ks], b"")
            elif op < 0.78:
                tx.map_remove("m", ks, [rng.randbytes(2) for _ in ks], b"")
            elif op < 0.92:
                tx.reduce("r", ks, [(1).to_bytes(8, "big", signed=True) for _ in ks], b"", False)
            else:
                tx.clear(rng.choice(["v", "l", "m", "r"]), ks, b"" if rng.random() < 0.5 else b"ns")
        winners[partition] = Winner(partition, attempt)
    return winners


def _contents(*backends: KeyedStateBackend) -> dict[str, dict[bytes, bytes]]:
    """Every stored entry (TTL headers included) of every state, merged over ``backends``."""
    out: dict[str, dict[bytes, bytes]] = {d.name: {} for d in STATES}
    for b in backends:
        for d in STATES:
            out[d.name].update(dict(b.validation.lookup(d.name).store.items()))
    return out


def _segments(changelog: SlotChangelog) -> list[tuple[str, bytes]]:
    return [(str(s.path), s.path.read_bytes()) for s in changelog.seal()]


@pytest.mark.parametrize("fast", [True, False], ids=["fast-commit", "general-commit"])
@pytest.mark.parametrize("kind", KINDS)
def test_replay_rebuilds_the_committed_bytes_with_the_commit_time_ttl_stamps(
    kind: str, fast: bool, tmp_path: Path
) -> None:
    rng = random.Random(15)
    clock = ManualClock()
    live, epochs, changelog = _logging_slot(kind, tmp_path, clock, fast=fast)
    segments: list[tuple[str, bytes]] = []
    for epoch in range(12):
        epochs.commit(epoch, _stage(rng, epochs, epoch), routing_version=1)
        clock.advance(1_234)
        if epoch % 4 == 3:
            segments += _segments(changelog)  # a checkpoint every four epochs
    assert len(segments) == 3
    assert [cs.epoch for _, data in segments for cs in read_segment(data, "s")] == list(range(12))

    replay_clock = ManualClock(now_ms=1_800_000_000_000)  # a restore runs later: the stamps must not move
    restored = _backend(kind, tmp_path / "restored", FULL, replay_clock)
    assert replay(restored, [ReplaySource(-1, segments)]) == 11
    assert _contents(restored) == _contents(live)
    assert restored.committed_epoch() == live.committed_epoch() == 11
    assert replay_clock.now_ms() == 1_800_000_000_000 and restored.clock is replay_clock


@pytest.mark.parametrize("kind", KINDS)
def test_replay_into_a_higher_parallelism_splits_by_key_group(kind: str, tmp_path: Path) -> None:
    rng = random.Random(16)
    clock = ManualClock()
    live, epochs, changelog = _logging_slot(kind, tmp_path, clock)
    for epoch in range(8):
        epochs.commit(epoch, _stage(rng, epochs, epoch), routing_version=1)
        clock.advance(500)
    segments = _segments(changelog)
    parts = [
        _backend(kind, tmp_path / f"p{i}", key_group_range_for_subtask(MP, 3, i), ManualClock(), index=i)
        for i in range(3)
    ]
    for part in parts:
        replay(part, [ReplaySource(-1, segments)])
    # Each key lands in exactly one of the new slots: the one owning its key group.
    for d in STATES:
        held = [set(_contents(part)[d.name]) for part in parts]
        assert sum(map(len, held)) == len(set().union(*held)) > 0
    assert _contents(*parts) == _contents(live)


@pytest.mark.parametrize("kind", KINDS)
def test_change_sets_up_to_the_materialized_epoch_are_skipped(kind: str, tmp_path: Path) -> None:
    rng = random.Random(17)
    clock = ManualClock()
    live, epochs, changelog = _logging_slot(kind, tmp_path, clock)
    for epoch in range(4):
        epochs.commit(epoch, _stage(rng, epochs, epoch), routing_version=1)
    head = _segments(changelog)
    for epoch in range(4, 9):
        epochs.commit(epoch, _stage(rng, epochs, epoch), routing_version=1)
    tail = _segments(changelog)

    # "Materialized" state at epoch 3, then every segment: epochs 0..3 must not apply twice (reduce, append).
    restored = _backend(kind, tmp_path / "restored", FULL, ManualClock())
    assert replay(restored, [ReplaySource(-1, head)]) == 3
    assert replay(restored, [ReplaySource(3, head + tail)]) == 8
    assert _contents(restored) == _contents(live)


def test_segments_out_of_commit_order_are_refused(tmp_path: Path) -> None:
    clock = ManualClock()
    log = SlotChangelog(tmp_path / "log", SUBTASK, clock)
    log.append(0, [Mutation(MutationKind.VALUE_PUT, "v", b"a", b"", value=b"1")])
    first = _segments(log)
    log.append(1, [Mutation(MutationKind.VALUE_PUT, "v", b"a", b"", value=b"2")])
    second = _segments(log)
    restored = _backend("hashmap", tmp_path / "r", FULL, clock)
    with pytest.raises(CorruptCheckpointError, match="holds epoch 0 after epoch 1"):
        replay(restored, [ReplaySource(-1, second + first)])
    assert restored.value_get("v", [b"a"], b"") == [None]  # refused before anything applied


def test_append_retract_seal_and_discard(tmp_path: Path) -> None:
    log = SlotChangelog(tmp_path / "log", SUBTASK, ManualClock())
    put = [Mutation(MutationKind.VALUE_PUT, "v", b"a", b"", value=b"1")]
    log.append(0, put)
    with pytest.raises(InvalidArgumentError, match="epochs must increase"):
        log.append(0, put)
    log.append(1, put)
    log.retract(1)  # its apply failed: the commit is retried and logs epoch 1 again
    log.append(1, put)
    [first] = log.seal()
    assert (first.first_epoch, first.last_epoch) == (0, 1)
    assert [cs.epoch for cs in read_segment(first.path.read_bytes(), "s")] == [0, 1]
    log.append(2, put)
    [second] = log.seal()
    assert log.seal() == []
    assert log.discard_through(1) == 1
    assert not first.path.exists() and second.path.exists()
    # A restarted slot starts an empty log (it is rebuilt from a checkpoint's segments).
    log.close()
    assert list(SlotChangelog(tmp_path / "log", SUBTASK, ManualClock()).directory.iterdir()) == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_commit_that_fails_to_apply_leaves_no_record_and_its_retry_is_logged_once(kind: str, tmp_path: Path) -> None:
    clock = ManualClock()
    live, epochs, changelog = _logging_slot(kind, tmp_path, clock, limits=StateLimits(max_list_elements=3))
    tx = EpochTransaction(epochs, TaskAttempt(0, 0, 1))
    tx.list_append("l", [b"full", b"full"], [b"1", b"2"], b"ns")
    epochs.commit(0, {0: Winner(0, 1)}, routing_version=1)
    # Two more elements fit on their own but not on top of the committed two: the apply fails.
    EpochTransaction(epochs, TaskAttempt(1, 0, 1)).list_append("l", [b"full", b"full"], [b"3", b"4"], b"ns")
    with pytest.raises(EpochCommitError, match="state.limits.list.max-elements"):
        epochs.commit(1, {0: Winner(0, 1)}, routing_version=1)
    epochs.abort(1)
    EpochTransaction(epochs, TaskAttempt(1, 0, 2)).list_append("l", [b"full"], [b"3"], b"ns")
    epochs.commit(1, {0: Winner(0, 2)}, routing_version=1)

    segments = _segments(changelog)
    logged = [cs for _, data in segments for cs in read_segment(data, "s")]
    assert [(cs.epoch, [m.values for m in cs.mutations]) for cs in logged] == [(0, [(b"1", b"2")]), (1, [(b"3",)])]
    restored = _backend(kind, tmp_path / "restored", FULL, ManualClock(), limits=StateLimits(max_list_elements=3))
    replay(restored, [ReplaySource(-1, segments)])
    assert _contents(restored) == _contents(live)
    assert restored.list_get("l", [b"full"], b"ns") == [[b"1", b"2", b"3"]]
