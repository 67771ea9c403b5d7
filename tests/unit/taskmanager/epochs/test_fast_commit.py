"""The reducing-state commit fast path against the general path: same bytes, same epoch, same counts.

The differential test stages the same random reducing records into two identical RocksDB slots
and commits one with the fast path and one without (``SlotEpochs(fast_commit=False)``), then
compares every stored byte. Its seed is printed (and taken from ``FAST_COMMIT_SEED`` when set).
"""

from __future__ import annotations

import logging
import os
import random
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import rocksdict

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
from keyedstate.common.errors import Reason
from keyedstate.common.ids import JobId, KeyGroupRange, OperatorId, SubtaskId, TaskManagerId
from keyedstate.taskmanager.epochs import EpochTransaction, records
from keyedstate.taskmanager.epochs.attempt import TaskAttempt
from keyedstate.taskmanager.epochs.slot import EpochCommitError, SlotEpochs
from keyedstate.taskmanager.slots import SlotTable
from keyedstate.taskmanager.state import KeyedStateBackend, StateLimits, create_backend
from keyedstate.taskmanager.state.metadata import COMMITTED_EPOCH
from tests.fakes.clock import ManualClock

MP = 128
SUBTASK = SubtaskId(JobId("job-fast"), OperatorId("op"), 0)
TTL_MS = 100
SUM2 = struct.Struct(">qq")
MINMAX = struct.Struct(">dqq")

REDUCING = (
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
WITH_VALUE = (*REDUCING, StateDescriptor("v", StateKind.VALUE))
FAST_LOGGER = "keyedstate.taskmanager.epochs.fast_commit"


@dataclass
class Twin:
    """One slot: its backend and its epoch state, on its own directory."""

    backend: KeyedStateBackend
    epochs: SlotEpochs

    def view(self, epoch: int, partition: int, attempt: int) -> EpochTransaction:
        return EpochTransaction(self.epochs, TaskAttempt(epoch, partition, attempt))

    def contents(self) -> dict[str, list[tuple[bytes, bytes]]]:
        """Every stored entry of every state's column family, in key order."""
        return {d.name: list(self.backend.validation.lookup(d.name).store.items()) for d in self.backend.descriptors()}

    def close(self) -> None:
        self.epochs.close()
        self.backend.close()


def make_twin(
    base: Path, clock: ManualClock, *, fast: bool, states: tuple[StateDescriptor, ...] = REDUCING, kind: str = "rocksdb"
) -> Twin:
    table = SlotTable(1, TaskManagerId("tm-fast"))
    slot = table.reserve(
        SUBTASK, OperatorSpec(SUBTASK.operator_id, 1, states), KeyGroupRange(0, MP - 1), MP, 0, 1, "", False
    )
    backend = create_backend(
        kind, SUBTASK, KeyGroupRange(0, MP - 1), MP, states, local_dir=base, limits=StateLimits(), clock=clock
    )
    table.activate(slot, backend)
    return Twin(backend, SlotEpochs(slot, backend, base / "staging", fast_commit=fast))


@pytest.fixture
def twins(tmp_path: Path) -> Iterator[tuple[Twin, Twin, ManualClock]]:
    clock = ManualClock()
    fast, general = make_twin(tmp_path / "fast", clock, fast=True), make_twin(tmp_path / "general", clock, fast=False)
    yield fast, general, clock
    fast.close()
    general.close()


def _operand(rng: random.Random, state: str) -> bytes:
    if state == "minmax":
        return MINMAX.pack(rng.uniform(-1e3, 1e3), rng.randint(-(1 << 63), (1 << 63) - 1), rng.randint(-5, 5))
    # Large int64 sums, so that some wrap around.
    return SUM2.pack(rng.randint(-3, 3), rng.choice([1, -1, (1 << 62) - 1, -(1 << 62)]) * rng.randint(1, 2))


def _stage_random(rng: random.Random, twins: tuple[Twin, ...], epoch: int) -> dict[int, Winner]:
    """Stage random reducing records of several attempts per partition into every twin; the winners to commit."""
    key_pool = [b"k%d" % i for i in range(rng.randint(3, 40))]
    namespaces = [b"", b"ns1", b"\x00" * 3]
    winners: dict[int, Winner] = {}
    for partition in rng.sample(range(8), rng.randint(1, 5)):
        attempts = rng.sample(range(1, 6), rng.randint(1, 3))
        for attempt in attempts:
            for _ in range(rng.randint(0, 6)):  # requests of the attempt
                state = rng.choice(REDUCING).name
                n = rng.randint(1, 25)
                keys = [rng.choice(key_pool) for _ in range(n)]
                ns = rng.choice(namespaces) if rng.random() < 0.7 else [rng.choice(namespaces) for _ in range(n)]
                ops = [_operand(rng, state) for _ in range(n)]
                clear = rng.random() < 0.25
                for t in twins:
                    view = t.view(epoch, partition, attempt)
                    if clear:
                        view.clear(state, keys, ns)
                    else:
                        view.reduce(state, keys, ops, ns, False)
        if rng.random() < 0.9:
            winners[partition] = Winner(partition, rng.choice(attempts))
    if rng.random() < 0.2:
        winners[99] = Winner(99, 1)  # a winner that staged nothing here
    return winners


def _write_committed(rng: random.Random, twins: tuple[Twin, ...]) -> None:
    """Plain (non-epoch) writes straight into the backends, so commits fold into existing values."""
    state = rng.choice(REDUCING).name
    keys = [b"k%d" % rng.randint(0, 40) for _ in range(rng.randint(1, 10))]
    ops = [_operand(rng, state) for _ in keys]
    for t in twins:
        t.backend.reduce(state, keys, ops, b"", False)


def test_fast_and_general_commits_store_the_same_bytes(
    twins: tuple[Twin, Twin, ManualClock], caplog: pytest.LogCaptureFixture
) -> None:
    seed = int(os.environ.get("FAST_COMMIT_SEED", random.randrange(1 << 32)))
    print(f"FAST_COMMIT_SEED={seed}")
    rng = random.Random(seed)
    fast, general, clock = twins
    caplog.set_level(logging.DEBUG, logger=FAST_LOGGER)
    for epoch in range(40):
        if rng.random() < 0.5:
            _write_committed(rng, (fast, general))
        clock.advance(rng.randint(0, 2 * TTL_MS))  # some committed TTL values expire before the commit
        winners = _stage_random(rng, (fast, general), epoch)
        clock.advance(rng.randint(0, TTL_MS))
        caplog.clear()
        got = fast.epochs.commit(epoch, winners, routing_version=1)
        assert any(r.name == FAST_LOGGER for r in caplog.records), f"seed {seed}: the fast path did not run"
        want = general.epochs.commit(epoch, winners, routing_version=1)
        assert got == want, f"seed {seed}, epoch {epoch}"
        assert fast.contents() == general.contents(), f"seed {seed}, epoch {epoch}"
        for t in (fast, general):
            assert t.backend.get_meta(COMMITTED_EPOCH) == str(epoch).encode()
            assert t.epochs.committed_epoch == epoch
            store = t.epochs.store
            assert store is None or not list(store.scan(*records.through_epoch(epoch)))
    assert fast.contents()["sum"], f"seed {seed}: nothing was committed"


def test_a_slot_with_another_state_kind_staged_takes_the_fast_path_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock()
    twin = make_twin(tmp_path, clock, fast=True, states=WITH_VALUE)
    caplog.set_level(logging.DEBUG, logger=FAST_LOGGER)
    try:
        # Only reducing records staged.
        twin.view(0, 0, 1).reduce("sum", [b"a", b"a"], [SUM2.pack(1, 2), SUM2.pack(1, 3)], b"", False)
        assert twin.epochs.commit(0, {0: Winner(0, 1)}, routing_version=1) == (0, 1)
        assert [r.name for r in caplog.records].count(FAST_LOGGER) == 1
        caplog.clear()
        # A value record among them: the fast path applies all of it (every kind has one).
        view = twin.view(1, 0, 1)
        view.reduce("sum", [b"a"], [SUM2.pack(1, 5)], b"", False)
        view.value_put("v", [b"a"], [b"x"], b"")
        assert twin.epochs.commit(1, {0: Winner(0, 1)}, routing_version=1) == (1, 2)
        assert [r.name for r in caplog.records].count(FAST_LOGGER) == 1
        assert twin.backend.value_get("sum", [b"a"], b"") == [SUM2.pack(3, 10)]
        assert twin.backend.value_get("v", [b"a"], b"") == [b"x"]
        assert twin.backend.committed_epoch() == 1
    finally:
        twin.close()


def test_the_hashmap_backend_takes_the_fast_path(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    twin = make_twin(tmp_path, ManualClock(), fast=True, kind="hashmap")
    caplog.set_level(logging.DEBUG, logger=FAST_LOGGER)
    try:
        twin.view(0, 0, 1).reduce("sum", [b"a"], [SUM2.pack(1, 2)], b"", False)
        assert twin.epochs.commit(0, {0: Winner(0, 1)}, routing_version=1) == (0, 1)
        assert FAST_LOGGER in [r.name for r in caplog.records]
        assert twin.backend.value_get("sum", [b"a"], b"") == [SUM2.pack(1, 2)]
    finally:
        twin.close()


def test_a_malformed_reducing_record_fails_the_commit_as_the_general_path_does(tmp_path: Path) -> None:
    twin = make_twin(tmp_path, ManualClock(), fast=True)
    try:
        view = twin.view(0, 0, 1)
        view.reduce("sum", [b"good"], [SUM2.pack(1, 2)], b"", False)
        store = twin.epochs.store
        assert store is not None
        # A DELTA operand one byte short, next to the good record.
        bad_key = records.state_prefix(view.attempt.prefix, 0) + b"\x00\x05\x03bad\x00"
        wb = rocksdict.WriteBatch(raw_mode=True)
        wb.put(bad_key, records.DELTA + SUM2.pack(1, 2)[:-1])
        store.write(wb)
        with pytest.raises(EpochCommitError, match="reduce operand") as info:
            twin.epochs.commit(0, {0: Winner(0, 1)}, routing_version=1)
        assert info.value.reason is Reason.INVALID_ARGUMENT
        assert twin.backend.value_get("sum", [b"good"], b"") == [None]
        assert twin.backend.committed_epoch() == -1
    finally:
        twin.close()
