"""What the changelog costs an epoch commit, and how fast a changelog tail replays.

One in-process RocksDB slot (no network: the commit itself is measured) commits the same epochs
three ways: the default fast path, the general path that folds staged records into mutations,
and the fast path with ``state.changelog.enabled``'s log in front (the staged records folded into
the change set's mutations, encoded, CRC-framed, appended and fsynced to a local segment before
the epoch applies). Each epoch puts
``KEYS_PER_EPOCH`` values and reduces as many counters over a key space ten times larger. The
logged segments are then replayed into an empty slot, whose contents must equal the committed
slot's, and the replay rate is what a restore with a changelog tail adds per mutation.

This measures the commit path only; what the checkpoints of a changelog job cost against the
state size, and a restore with a segment tail, are ``changelog_checkpoint``'s figures.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from pathlib import Path

from bench.result import BenchContext, Measurement, Ratio, ScenarioResult
from keyedstate.common.batches import Winner
from keyedstate.common.clock import SystemClock
from keyedstate.common.descriptors import OperatorSpec, ReduceField, StateDescriptor, StateKind
from keyedstate.common.ids import JobId, KeyGroupRange, OperatorId, SubtaskId, TaskManagerId
from keyedstate.taskmanager.changelog import ReplaySource, SlotChangelog, replay
from keyedstate.taskmanager.epochs import EpochTransaction, TaskAttempt
from keyedstate.taskmanager.epochs.slot import SlotEpochs
from keyedstate.taskmanager.slots import SlotTable
from keyedstate.taskmanager.state import KeyedStateBackend, StateLimits, create_backend

logger = logging.getLogger(__name__)

NAME = "changelog_commit"
TITLE = "Changelog: epoch commit cost of logging the change set, and replay rate"

MP = 128
SUBTASK = SubtaskId(JobId("changelog-bench"), OperatorId("op"), 0)
STATES = (
    StateDescriptor("v", StateKind.VALUE),
    StateDescriptor("r", StateKind.REDUCING, reduce_fields=(ReduceField("count"), ReduceField("total"))),
)
REQUEST = 1000


def _slot(work: Path, *, fast: bool, changelog: bool) -> tuple[KeyedStateBackend, SlotEpochs, SlotChangelog | None]:
    table = SlotTable(1, TaskManagerId("tm-bench"))
    full = KeyGroupRange(0, MP - 1)
    slot = table.reserve(SUBTASK, OperatorSpec(SUBTASK.operator_id, 1, STATES), full, MP, 0, 1, "", False)
    clock = SystemClock()
    backend = create_backend(
        "rocksdb", SUBTASK, full, MP, STATES, local_dir=work / "db", limits=StateLimits(), clock=clock
    )
    table.activate(slot, backend)
    log = SlotChangelog(work / "changelog", SUBTASK, clock) if changelog else None
    return backend, SlotEpochs(slot, backend, work / "staging", fast_commit=fast, changelog=log), log


def _run(
    work: Path, seed: int, epochs: int, keys_per_epoch: int, *, fast: bool, changelog: bool
) -> tuple[list[float], KeyedStateBackend, SlotEpochs, SlotChangelog | None]:
    backend, slot_epochs, log = _slot(work, fast=fast, changelog=changelog)
    rng = random.Random(seed)
    space = keys_per_epoch * 10
    operand = (1).to_bytes(8, "big") + (7).to_bytes(8, "big")
    commit_ms = []
    for epoch in range(epochs):
        view = EpochTransaction(slot_epochs, TaskAttempt(epoch, 0, 1))
        keys = [b"user-%09d" % rng.randrange(space) for _ in range(keys_per_epoch)]
        for a in range(0, keys_per_epoch, REQUEST):
            chunk = list(dict.fromkeys(keys[a : a + REQUEST]))
            view.value_put("v", chunk, [rng.randbytes(100) for _ in chunk], b"")
            view.reduce("r", chunk, [operand] * len(chunk), b"", False)
        t0 = time.perf_counter()
        slot_epochs.commit(epoch, {0: Winner(0, 1)}, routing_version=1)
        commit_ms.append((time.perf_counter() - t0) * 1000.0)
    return commit_ms, backend, slot_epochs, log


def _contents(backend: KeyedStateBackend) -> dict[str, list[tuple[bytes, bytes]]]:
    return {d.name: list(backend.validation.lookup(d.name).store.items()) for d in STATES}


def run(ctx: BenchContext) -> ScenarioResult:
    epochs = 10 if ctx.quick else 40
    keys_per_epoch = 5_000 if ctx.quick else 50_000
    medians: dict[str, float] = {}
    logged_bytes, replay_s = 0, 0.0
    for name, fast, changelog in (("fast", True, False), ("general", False, False), ("changelog", True, True)):
        times, backend, slot_epochs, log = _run(
            ctx.workdir / name, ctx.seed, epochs, keys_per_epoch, fast=fast, changelog=changelog
        )
        medians[name] = statistics.median(times[1:])  # the first epoch opens the staging store
        if log is None:
            slot_epochs.close()
            backend.close()
            continue
        segments = [(str(s.path), s.path.read_bytes()) for s in log.seal()]
        logged_bytes = sum(len(data) for _, data in segments)
        restored = create_backend(
            "rocksdb",
            SUBTASK,
            KeyGroupRange(0, MP - 1),
            MP,
            STATES,
            local_dir=ctx.workdir / "restored",
            limits=StateLimits(),
            clock=SystemClock(),
        )
        t0 = time.perf_counter()
        replay(restored, [ReplaySource(-1, segments)])
        replay_s = time.perf_counter() - t0
        if _contents(restored) != _contents(backend):
            raise RuntimeError("the slot rebuilt from the changelog differs from the committed slot")
        restored.close()
        slot_epochs.close()
        backend.close()
    mutations = epochs * keys_per_epoch * 2  # a put and a reduce per key (duplicates within a request merge)
    return ScenarioResult(
        NAME,
        TITLE,
        params={"epochs": epochs, "keys_per_epoch": keys_per_epoch, "value_bytes": 100, "backend": "rocksdb"},
        measurements=[
            Measurement("median commit, fast path", medians["fast"], "ms"),
            Measurement("median commit, general path", medians["general"], "ms"),
            Measurement(
                "median commit, fast path + changelog",
                medians["changelog"],
                "ms",
                "fold + encode + append + fsync first",
            ),
            Measurement("changelog written per epoch", logged_bytes / epochs / (1 << 20), "MB"),
            Measurement("replay of the whole changelog", replay_s, "s", f"{epochs} epochs"),
            Measurement("replay rate", mutations / replay_s, "mutations/s", "about; duplicate keys merge"),
        ],
        ratios=[
            Ratio("changelog commit / fast commit", medians["changelog"] / medians["fast"]),
            Ratio("changelog commit / general commit", medians["changelog"] / medians["general"]),
        ],
    )
