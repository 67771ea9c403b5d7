"""The commit fast path against the general path (the reference), for every state kind, on both backends.

Two identical slots (same backend kind, same clock, same limits) receive the same random staged
epochs: value puts and clears, reduces, list appends, updates and clears, map puts, removes and
clears, with TTL and without, under several partitions and attempts, with winners chosen at
random (some partitions lose, some winners staged nothing here), plus plain committed writes
between epochs. One slot commits with the fast path (``SlotEpochs(fast_commit=True)``), the
other with the general path that folds the records into Mutations and applies them through
``KeyedStateBackend.apply`` (``fast_commit=False``). After every commit both must hold the same
bytes (RocksDB: every entry of every column family; HashMap: every table) and report the same
mutation count; a commit that fails (a list grown past ``state.limits.list.max-elements``) must
fail on both with the same reason and message and apply nothing, and is then aborted on both.

The seed is printed and taken from ``FAST_COMMIT_SEED`` when set; ``FAST_COMMIT_EPOCHS`` sets
how many rounds each backend runs. Checked to fail (seed 1, 300 rounds), each with one mistake
planted in ``fast_commit.py``: RocksDB list appends started at sequence 0 instead of the list's
next one (round 4), map removes skipped on RocksDB (round 13) or on HashMap (round 13), value
TTL headers not stamped with the commit time (round 0), a reducing REPLACE folded like a DELTA
(round 78).
"""

from __future__ import annotations

import logging
import os
import random
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from keyedstate.common.batches import Winner
from keyedstate.common.descriptors import (
    NumberType,
    OperatorSpec,
    ReduceField,
    ReduceFunction,
    StateDescriptor,
    StateKind,
    TtlConfig,
)
from keyedstate.common.errors import KeyedStateError
from keyedstate.common.ids import JobId, KeyGroupRange, OperatorId, SubtaskId, TaskManagerId
from keyedstate.taskmanager.epochs import EpochTransaction, records
from keyedstate.taskmanager.epochs.attempt import TaskAttempt
from keyedstate.taskmanager.epochs.slot import SlotEpochs
from keyedstate.taskmanager.slots import SlotTable
from keyedstate.taskmanager.state import KeyedStateBackend, StateLimits, create_backend
from keyedstate.taskmanager.state.metadata import COMMITTED_EPOCH
from tests.fakes.clock import ManualClock

MP = 64
SUBTASK = SubtaskId(JobId("job-diff"), OperatorId("op"), 0)
TTL_MS = 100
MAX_LIST = 10  # small, so that some commits grow a list past the limit
SUM2 = struct.Struct(">qq")
MINMAX = struct.Struct(">dqq")
FAST_LOGGER = "keyedstate.taskmanager.epochs.fast_commit"

STATES = (
    StateDescriptor("v", StateKind.VALUE),
    StateDescriptor("v_ttl", StateKind.VALUE, ttl=TtlConfig(TTL_MS)),
    StateDescriptor("l", StateKind.LIST),
    StateDescriptor("l_ttl", StateKind.LIST, ttl=TtlConfig(TTL_MS)),
    StateDescriptor("m", StateKind.MAP),
    StateDescriptor("m_ttl", StateKind.MAP, ttl=TtlConfig(TTL_MS)),
    StateDescriptor("sum", StateKind.REDUCING, reduce_fields=(ReduceField("count"), ReduceField("total"))),
    StateDescriptor(
        "minmax",
        StateKind.REDUCING,
        reduce_fields=(
            ReduceField("max", ReduceFunction.MAX, NumberType.FLOAT64),
            ReduceField("min", ReduceFunction.MIN, NumberType.INT64),
            ReduceField("n"),
        ),
    ),
    StateDescriptor(
        "sum_ttl", StateKind.REDUCING, reduce_fields=(ReduceField("count"), ReduceField("total")), ttl=TtlConfig(TTL_MS)
    ),
)
KINDS = {d.name: d.kind for d in STATES}


@dataclass
class Slot:
    backend: KeyedStateBackend
    epochs: SlotEpochs

    def view(self, epoch: int, partition: int, attempt: int) -> EpochTransaction:
        return EpochTransaction(self.epochs, TaskAttempt(epoch, partition, attempt))

    def contents(self) -> dict[str, Any]:
        """Every stored entry of every state: RocksDB column families in key order, or the HashMap tables."""
        out: dict[str, Any] = {}
        for d in STATES:
            store = self.backend.validation.lookup(d.name).store
            if isinstance(store, dict):  # HashMap: (key, namespace) -> stored value, list or map
                out[d.name] = sorted((k, _frozen(v)) for k, v in store.items())
            else:  # RocksDB: the column family in key order
                out[d.name] = list(store.items())
        return out

    def close(self) -> None:
        self.epochs.close()
        self.backend.close()


def _frozen(entry: Any) -> Any:
    if isinstance(entry, list):
        return tuple(entry)
    if isinstance(entry, dict):
        return tuple(sorted(entry.items()))
    return entry


def make_slot(base: Path, clock: ManualClock, kind: str, *, fast: bool) -> Slot:
    table = SlotTable(1, TaskManagerId("tm-diff"))
    slot = table.reserve(
        SUBTASK, OperatorSpec(SUBTASK.operator_id, 1, STATES), KeyGroupRange(0, MP - 1), MP, 0, 1, "", False
    )
    backend = create_backend(
        kind,
        SUBTASK,
        KeyGroupRange(0, MP - 1),
        MP,
        STATES,
        local_dir=base,
        limits=StateLimits(max_list_elements=MAX_LIST),
        clock=clock,
    )
    table.activate(slot, backend)
    return Slot(backend, SlotEpochs(slot, backend, base / "staging", fast_commit=fast))


@pytest.fixture(params=["rocksdb", "hashmap"])
def pair(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Slot, Slot, ManualClock]]:
    clock = ManualClock()
    kind = str(request.param)
    fast = make_slot(tmp_path / "fast", clock, kind, fast=True)
    general = make_slot(tmp_path / "general", clock, kind, fast=False)
    yield fast, general, clock
    fast.close()
    general.close()


class Gen:
    """Random requests over a small key space, so that keys repeat within and across attempts."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        # Mostly short keys; a few past 127 bytes take the multi-byte varint path of the key layout.
        self.keys = [b"k%d" % i for i in range(rng.randint(2, 12))] + [b"long" * 40]
        self.namespaces = [b"", b"ns", b"\x00\xff"]
        self.user_keys = [b"u%d" % i for i in range(6)] + [b"", b"\xff" * 3]

    def key(self) -> bytes:
        return self.rng.choice(self.keys)

    def ns(self, n: int) -> bytes | list[bytes]:
        rng = self.rng
        return rng.choice(self.namespaces) if rng.random() < 0.7 else [rng.choice(self.namespaces) for _ in range(n)]

    def operand(self, state: str) -> bytes:
        rng = self.rng
        if state == "minmax":
            return MINMAX.pack(rng.uniform(-1e3, 1e3), rng.randint(-(1 << 63), (1 << 63) - 1), rng.randint(-5, 5))
        return SUM2.pack(rng.randint(-3, 3), rng.choice([1, -1, (1 << 62) - 1]) * rng.randint(1, 2))

    def value(self) -> bytes:
        return self.rng.randbytes(self.rng.randint(0, 12))


def _request(gen: Gen, view: EpochTransaction) -> None:
    """One random write request of an attempt (the same call goes to both slots)."""
    rng = gen.rng
    state = rng.choice(STATES).name
    kind = KINDS[state]
    n = rng.randint(1, 8)
    keys = [gen.key() for _ in range(n)]
    ns = gen.ns(n)
    if rng.random() < 0.15:
        view.clear(state, keys, ns)
    elif kind is StateKind.VALUE:
        view.value_put(state, keys, [gen.value() for _ in keys], ns)
    elif kind is StateKind.REDUCING:
        view.reduce(state, keys, [gen.operand(state) for _ in keys], ns, False)
    elif kind is StateKind.LIST:
        if rng.random() < 0.25:
            view.list_update(state, keys, [gen.value() for _ in keys], ns)
        else:
            view.list_append(state, keys, [gen.value() for _ in keys], ns)
    elif rng.random() < 0.3:
        view.map_remove(state, keys, [rng.choice(gen.user_keys) for _ in keys], ns)
    else:
        view.map_put(state, keys, [rng.choice(gen.user_keys) for _ in keys], [gen.value() for _ in keys], ns)


def _stage(gen: Gen, slots: tuple[Slot, ...], epoch: int) -> dict[int, Winner]:
    """Random requests of several attempts of several partitions, staged in every slot; the winners."""
    rng = gen.rng
    winners: dict[int, Winner] = {}
    plan: list[tuple[int, int]] = []
    for partition in rng.sample(range(6), rng.randint(1, 4)):
        attempts = rng.sample(range(1, 5), rng.randint(1, 3))
        plan.extend((partition, a) for a in attempts for _ in range(rng.randint(0, 4)))
        if rng.random() < 0.9:
            winners[partition] = Winner(partition, rng.choice(attempts))
    rng.shuffle(plan)  # attempts' requests interleave, as concurrent tasks' do
    for partition, attempt in plan:
        state = rng.getstate()
        for s in slots:
            rng.setstate(state)  # the same random request for every slot
            try:
                _request(gen, s.view(epoch, partition, attempt))
            except KeyedStateError:
                pass  # a staged list past the limit is refused at staging, on both slots alike
    if rng.random() < 0.1:
        winners[77] = Winner(77, 1)  # a winner that staged nothing here
    return winners


def _write_committed(gen: Gen, slots: tuple[Slot, ...]) -> None:
    """Plain (non-epoch) writes straight into the backends, so that commits meet existing state."""
    rng = gen.rng
    state = rng.getstate()
    for s in slots:
        rng.setstate(state)
        b = s.backend
        keys = [gen.key() for _ in range(rng.randint(1, 5))]
        try:
            b.reduce("sum", keys, [gen.operand("sum") for _ in keys], b"", False)
            b.list_append("l", keys, [gen.value() for _ in keys], b"")
            b.map_put("m_ttl", keys, [rng.choice(gen.user_keys) for _ in keys], [gen.value() for _ in keys], b"")
            b.value_put("v_ttl", keys, [gen.value() for _ in keys], b"")
        except KeyedStateError:
            pass


def _commit(slot: Slot, epoch: int, winners: dict[int, Winner]) -> tuple[int, int] | tuple[str, str]:
    try:
        return slot.epochs.commit(epoch, winners, routing_version=1)
    except KeyedStateError as exc:
        return exc.reason.value, exc.message


# 250 rounds per backend (about 5 s each) in the default suite: every planted mistake above was
# found by round 78. The soak (-m slow, make test-all) runs 2000.
@pytest.mark.timeout(900)
@pytest.mark.parametrize("rounds", [250, pytest.param(2000, marks=pytest.mark.slow)])
def test_fast_and_general_commits_leave_the_same_state(
    pair: tuple[Slot, Slot, ManualClock], caplog: pytest.LogCaptureFixture, rounds: int
) -> None:
    seed = int(os.environ.get("FAST_COMMIT_SEED", random.randrange(1 << 32)))
    epochs = int(os.environ.get("FAST_COMMIT_EPOCHS", rounds))
    print(f"FAST_COMMIT_SEED={seed}")
    gen = Gen(random.Random(seed))
    rng = gen.rng
    fast, general, clock = pair
    both = (fast, general)
    caplog.set_level(logging.DEBUG, logger=FAST_LOGGER)
    epoch, failures, applied = 0, 0, 0
    for i in range(epochs):
        where = f"seed {seed}, round {i}, epoch {epoch}"
        if rng.random() < 0.3:
            _write_committed(gen, both)
        clock.advance(rng.randint(0, 2 * TTL_MS))  # some committed TTL values expire before the commit
        winners = _stage(gen, both, epoch)
        clock.advance(rng.randint(0, TTL_MS))
        caplog.clear()
        got = _commit(fast, epoch, winners)
        ran_fast = any(r.name == FAST_LOGGER for r in caplog.records)
        want = _commit(general, epoch, winners)
        assert got == want, where
        assert fast.contents() == general.contents(), where
        if isinstance(got[0], str):  # failed on both, nothing applied: abort and stage the epoch again
            failures += 1
            for s in both:
                assert s.backend.committed_epoch() == epoch - 1, where
                s.epochs.abort(epoch)
            continue
        assert ran_fast, f"{where}: the fast path did not run"
        applied += int(got[1])
        for s in both:
            assert s.backend.get_meta(COMMITTED_EPOCH) == str(epoch).encode(), where
            store = s.epochs.store
            assert store is None or not store.read_chunk(*records.through_epoch(epoch), 1), where
        epoch += 1
    contents = fast.contents()
    assert all(contents[d.name] for d in STATES), f"seed {seed}: a state stayed empty: {contents.keys()}"
    assert epoch > epochs // 2 and failures, f"seed {seed}: {epoch} epochs committed, {failures} failed"
    print(f"{epoch} epochs committed ({applied} mutations), {failures} refused alike")
