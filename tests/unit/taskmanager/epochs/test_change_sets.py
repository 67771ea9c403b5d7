"""Change sets of overlapped commits: written at Prepare, replayed by restores, compared exactly.

The adversary: one slot commits random epochs (every state kind, TTL and not, several
partitions and attempts, random winners, plain committed writes in between) in overlapped mode:
Prepare writes the change set to real file:// checkpoint storage, the clock moves on, then the
apply. Three replicas that saw nothing but the change sets replay them: one over the whole
key-group range and two that split it (a rescale). After every replay the replicas must hold
exactly the bytes of the committing slot (RocksDB: every entry of every column family, TTL
headers included; HashMap: every table), and the committed epoch.

Also: the read fence (a call of epoch E+1 waits for the apply of E), refusals of bad files, and
an apply that keeps the Prepare's timestamp.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keyedstate.common.batches import Winner
from keyedstate.common.changesets import ChangeSetFile
from keyedstate.common.config import Configuration
from keyedstate.common.descriptors import OperatorSpec
from keyedstate.common.errors import CorruptCheckpointError, EpochConflictError, Reason, UnavailableError
from keyedstate.common.ids import KeyGroupRange, TaskManagerId
from keyedstate.common.keygroups import key_group
from keyedstate.common.storage import StorageCache
from keyedstate.taskmanager.changelog.change_sets import ChangeSetStore
from keyedstate.taskmanager.epochs.attempt import TaskAttempt
from keyedstate.taskmanager.epochs.manager import EpochManager
from keyedstate.taskmanager.epochs.slot import EpochCommitError, SlotEpochs
from keyedstate.taskmanager.slots import SlotTable
from keyedstate.taskmanager.state import StateLimits, create_backend
from tests.fakes.clock import ManualClock
from tests.unit.taskmanager.epochs.test_fast_commit_differential import (
    MP,
    STATES,
    SUBTASK,
    TTL_MS,
    Gen,
    Slot,
    _stage,
)

VERSION = 1


def make_slot(base: Path, clock: ManualClock, kind: str, key_groups: KeyGroupRange, checkpoint_base: str = "") -> Slot:
    """A slot of SUBTASK over ``key_groups`` (lists unbounded: every staged epoch applies)."""
    table = SlotTable(1, TaskManagerId("tm-cs"))
    slot = table.reserve(
        SUBTASK, OperatorSpec(SUBTASK.operator_id, 1, STATES), key_groups, MP, 0, VERSION, checkpoint_base, False
    )
    backend = create_backend(
        kind, SUBTASK, key_groups, MP, STATES, local_dir=base, limits=StateLimits(max_list_elements=10_000), clock=clock
    )
    table.activate(slot, backend)
    return Slot(backend, SlotEpochs(slot, backend, base / "staging"))


@pytest.fixture
def store() -> ChangeSetStore:
    return ChangeSetStore(StorageCache(Configuration()))


def _upload(store: ChangeSetStore, slot: Slot, base: str) -> Any:
    def upload(epoch: int, timestamp_ms: int, mutations: Any) -> ChangeSetFile:
        return store.upload(base, SUBTASK, VERSION, epoch, timestamp_ms, mutations, MP)

    return upload


def _write_direct(gen: Gen, slots: tuple[Slot, ...]) -> None:
    """Plain (non-epoch) writes of random keys, each to every slot whose key groups hold it."""
    rng = gen.rng
    keys = [gen.key() for _ in range(rng.randint(1, 5))]
    operands = [gen.operand("sum") for _ in keys]
    elements = [gen.value() for _ in keys]
    user_keys = [rng.choice(gen.user_keys) for _ in keys]
    values = [gen.value() for _ in keys]
    for s in slots:
        b = s.backend
        mine = [i for i, k in enumerate(keys) if key_group(k, MP) in b.key_groups]
        if not mine:
            continue
        ks = [keys[i] for i in mine]
        b.reduce("sum", ks, [operands[i] for i in mine], b"", False)
        b.list_append("l", ks, [elements[i] for i in mine], b"")
        b.map_put("m_ttl", ks, [user_keys[i] for i in mine], [values[i] for i in mine], b"")
        b.value_put("v_ttl", ks, [values[i] for i in mine], b"")


@pytest.mark.parametrize("kind", ["rocksdb", "hashmap"])
def test_replayed_change_sets_rebuild_the_committed_state_exactly(
    kind: str, tmp_path: Path, store: ChangeSetStore
) -> None:
    seed = int(os.environ.get("CHANGE_SET_SEED", random.randrange(1 << 32)))
    print(f"CHANGE_SET_SEED={seed}")
    gen = Gen(random.Random(seed))
    rng = gen.rng
    clock = ManualClock()
    job_dir = f"file://{tmp_path}/checkpoints/job"
    source = make_slot(tmp_path / "source", clock, kind, KeyGroupRange(0, MP - 1), job_dir)
    whole = make_slot(tmp_path / "whole", clock, kind, KeyGroupRange(0, MP - 1))
    low = make_slot(tmp_path / "low", clock, kind, KeyGroupRange(0, MP // 2 - 1))
    high = make_slot(tmp_path / "high", clock, kind, KeyGroupRange(MP // 2, MP - 1))
    replicas = (whole, low, high)
    # Plain committed writes reach the replicas as they reach the source (as a restored snapshot would).
    pending: list[ChangeSetFile] = []
    try:
        for epoch in range(60):
            where = f"seed {seed}, epoch {epoch}"
            if rng.random() < 0.2:
                # Direct writes land between commits: the replicas replay what they lag behind first.
                for replica in replicas:
                    store.replay(replica.backend, job_dir, pending)
                pending = []
                _write_direct(gen, (source, *replicas))
            clock.advance(rng.randint(0, 2 * TTL_MS))
            winners = _stage(gen, (source,), epoch)
            written = source.epochs.prepare(epoch, winners, VERSION, _upload(store, source, job_dir))
            assert written is not None and written.path == f"changelog/{epoch}/v{VERSION}-{SUBTASK.operator_id}-0"
            assert source.backend.committed_epoch() == epoch - 1, "Prepare applies nothing"
            pending.append(written)
            clock.advance(rng.randint(1, TTL_MS))  # the apply comes later; it must stamp TTL as the Prepare did
            assert source.epochs.commit(epoch, winners, VERSION)[0] == epoch
            if rng.random() < 0.4 or epoch == 59:
                for replica in replicas:
                    assert store.replay(replica.backend, job_dir, pending) == epoch, where
                pending = []
                want = source.contents()
                assert whole.contents() == want, where
                split = [low.contents(), high.contents()]
                assert {name: sorted(split[0][name] + split[1][name]) for name in want} == {
                    name: sorted(entries) for name, entries in want.items()
                }, where
                for replica in replicas:
                    assert replica.backend.committed_epoch() == epoch, where
        assert all(source.contents()[d.name] for d in STATES), f"seed {seed}: a state stayed empty"
    finally:
        for s in (source, *replicas):
            s.close()


def test_a_replay_refuses_gaps_missing_and_altered_files_before_applying(tmp_path: Path, store: ChangeSetStore) -> None:
    clock = ManualClock()
    job_dir = f"file://{tmp_path}/job"
    source = make_slot(tmp_path / "s", clock, "rocksdb", KeyGroupRange(0, MP - 1), job_dir)
    replica = make_slot(tmp_path / "r", clock, "rocksdb", KeyGroupRange(0, MP - 1))
    try:
        files = []
        for epoch in range(3):
            source.view(epoch, 0, 1).value_put("v", [b"k%d" % epoch], [b"x"], b"")
            winners = {0: Winner(0, 1)}
            files.append(source.epochs.prepare(epoch, winners, VERSION, _upload(store, source, job_dir)))
            source.epochs.commit(epoch, winners, VERSION)
        f0, f1, f2 = files
        assert f0 is not None and f1 is not None and f2 is not None
        with pytest.raises(
            CorruptCheckpointError, match=r"holds epoch -1, but the decided epochs to replay are \[1, 2\]"
        ):
            store.replay(replica.backend, job_dir, [f1, f2])
        altered = ChangeSetFile(f1.epoch, f1.operator_id, f1.subtask_index, f1.path, f1.size, "0" * 64)
        with pytest.raises(CorruptCheckpointError, match="its decision recorded"):
            store.replay(replica.backend, job_dir, [f0, altered])
        (tmp_path / "job" / f2.path).unlink()
        with pytest.raises(CorruptCheckpointError, match="of decided epoch 2 is missing"):
            store.replay(replica.backend, job_dir, [f0, f1, f2])
        assert replica.backend.committed_epoch() == -1, "nothing applies before every file checked out"
        assert store.replay(replica.backend, job_dir, [f0, f1]) == 1
        assert replica.backend.value_get("v", [b"k0", b"k1", b"k2"], b"") == [b"x", b"x", None]
    finally:
        source.close()
        replica.close()


def test_prepare_with_a_change_set_refuses_an_epoch_already_applied(tmp_path: Path, store: ChangeSetStore) -> None:
    clock = ManualClock()
    job_dir = f"file://{tmp_path}/job"
    slot = make_slot(tmp_path / "s", clock, "hashmap", KeyGroupRange(0, MP - 1), job_dir)
    try:
        slot.view(0, 0, 1).value_put("v", [b"k"], [b"x"], b"")
        slot.epochs.commit(0, {0: Winner(0, 1)}, VERSION)
        with pytest.raises(EpochConflictError, match="already holds epoch 0, so it has no staged writes"):
            slot.epochs.prepare(0, {0: Winner(0, 1)}, VERSION, _upload(store, slot, job_dir))
    finally:
        slot.close()


@pytest.fixture
def overlapped(tmp_path: Path) -> Iterator[tuple[EpochManager, Any, ManualClock]]:
    """An EpochManager over one slot that commits overlapped (its checkpoint base is real file:// storage)."""
    clock = ManualClock()
    table = SlotTable(1, TaskManagerId("tm-fence"))
    slot = table.reserve(
        SUBTASK,
        OperatorSpec(SUBTASK.operator_id, 1, STATES),
        KeyGroupRange(0, MP - 1),
        MP,
        0,
        VERSION,
        f"file://{tmp_path}/job",
        False,
    )
    backend = create_backend(
        "rocksdb",
        SUBTASK,
        KeyGroupRange(0, MP - 1),
        MP,
        STATES,
        local_dir=tmp_path / "db",
        limits=StateLimits(),
        clock=clock,
    )
    table.activate(slot, backend)
    manager = EpochManager(
        table, lambda s: tmp_path / "inst", change_sets=ChangeSetStore(StorageCache(Configuration()))
    )
    yield manager, slot, clock
    manager.close()
    backend.close()


def test_the_read_fence_holds_a_call_of_the_next_epoch_until_the_apply(overlapped: Any) -> None:
    manager, slot, _clock = overlapped
    manager.view(slot, TaskAttempt(0, 0, 1)).value_put("v", [b"k"], [b"first"], b"")
    # Without a pending overlapped apply nothing waits (the synchronous mode's behaviour).
    manager.view(slot, TaskAttempt(5, 0, 1), fence_wait_s=0.0)
    files = manager.prepare_epoch(SUBTASK.job_id, 0, {0: Winner(0, 1)}, VERSION, upload_change_set=True)
    assert [f.epoch for f in files] == [0]
    with pytest.raises(UnavailableError, match="waited 0.1 s for epoch 0 to be applied here; retry") as info:
        manager.view(slot, TaskAttempt(1, 0, 1), fence_wait_s=0.1)
    assert info.value.reason is Reason.EPOCH_NOT_APPLIED
    seen: list[Any] = []

    def next_batch() -> None:
        view = manager.view(slot, TaskAttempt(1, 0, 1), fence_wait_s=30.0)
        seen.append(view.value_get("v", [b"k"], b""))

    reader = threading.Thread(target=next_batch)
    reader.start()
    reader.join(0.3)
    assert reader.is_alive() and seen == [], "the call of epoch 1 waits while epoch 0 is decided but not applied"
    manager.commit_epoch(SUBTASK.job_id, 0, {0: Winner(0, 1)}, routing_version=VERSION)
    reader.join(10)
    assert seen == [[b"first"]], "released by the apply, it reads the previous batch"


def test_the_apply_keeps_the_timestamp_of_the_prepare(tmp_path: Path, store: ChangeSetStore) -> None:
    clock = ManualClock()
    job_dir = f"file://{tmp_path}/job"
    slot = make_slot(tmp_path / "s", clock, "rocksdb", KeyGroupRange(0, MP - 1), job_dir)
    try:
        slot.view(0, 0, 1).value_put("v_ttl", [b"k"], [b"x"], b"")
        slot.epochs.prepare(0, {0: Winner(0, 1)}, VERSION, _upload(store, slot, job_dir))
        clock.advance(TTL_MS - 1)
        slot.epochs.commit(0, {0: Winner(0, 1)}, VERSION)
        assert slot.backend.value_get("v_ttl", [b"k"], b"") == [b"x"]
        clock.advance(1)
        assert slot.backend.value_get("v_ttl", [b"k"], b"") == [None], "expired TTL_MS after the Prepare, not the apply"
    finally:
        slot.close()


@pytest.mark.parametrize("kind", ["hashmap", "rocksdb"])
def test_prepare_refuses_an_epoch_whose_apply_would_pass_the_list_limit(
    tmp_path: Path, store: ChangeSetStore, kind: str
) -> None:
    """A decided epoch must apply: the limit the apply enforces is met at Prepare, before any file or decision."""
    clock = ManualClock()
    job_dir = f"file://{tmp_path}/job"
    table = SlotTable(1, TaskManagerId("tm-limit"))
    key_groups = KeyGroupRange(0, MP - 1)
    reserved = table.reserve(
        SUBTASK, OperatorSpec(SUBTASK.operator_id, 1, STATES), key_groups, MP, 0, VERSION, job_dir, False
    )
    backend = create_backend(
        kind,
        SUBTASK,
        key_groups,
        MP,
        STATES,
        local_dir=tmp_path / "s",
        limits=StateLimits(max_list_elements=3),
        clock=clock,
    )
    table.activate(reserved, backend)
    slot = Slot(backend, SlotEpochs(reserved, backend, tmp_path / "s" / "staging"))
    try:
        slot.view(0, 0, 1).list_append("l", [b"k", b"k"], [b"a", b"b"], b"")
        slot.epochs.commit(0, {0: Winner(0, 1)}, VERSION)
        # Each attempt alone is within the limit (staging checks only what it stages); together
        # with the committed two they would make five.
        slot.view(1, 0, 1).list_append("l", [b"k"], [b"c"], b"")
        slot.view(1, 1, 1).list_append("l", [b"k", b"k"], [b"d", b"e"], b"")
        winners = {0: Winner(0, 1), 1: Winner(1, 1)}
        with pytest.raises(EpochCommitError, match="epoch 1 cannot be applied.*state.limits.list.max-elements") as info:
            slot.epochs.prepare(1, winners, VERSION, _upload(store, slot, job_dir))
        assert info.value.reason is Reason.SIZE_LIMIT
        assert not (tmp_path / "job" / "changelog").exists()  # no change set was written
        assert backend.committed_epoch() == 0 and backend.list_get("l", [b"k"], b"") == [[b"a", b"b"]]
        # Within the limit the same Prepare passes and its file is written.
        slot.epochs.abort(1)
        slot.view(1, 0, 2).list_append("l", [b"k"], [b"c"], b"")
        written = slot.epochs.prepare(1, {0: Winner(0, 2)}, VERSION, _upload(store, slot, job_dir))
        assert written is not None and written.size > 0
        slot.epochs.commit(1, {0: Winner(0, 2)}, VERSION)
        assert backend.list_get("l", [b"k"], b"") == [[b"a", b"b", b"c"]]
    finally:
        slot.close()
