"""cProfile of one W1 micro-batch on one TaskManager slot, in-process: staged reduces, then the commit.

``python -m bench.w1.profile_tm --w2 [users]`` times instead the commit of W2-shaped epochs
(list clears and appends, value puts) with the general path and the fast path, alternating.

``python -m bench.w1.profile_tm [keys]`` prints where the slot's CPU goes for
about ``keys`` distinct users per epoch (a W1 micro-batch puts about 63k on each of two slots).
The classes are the real TaskManager ones (SlotTable, EpochManager, RocksDB backend in a
temporary directory); only the gRPC layer is left out, so the figures are the TaskManager's own
Python work, and the committed state is checked against the operands. The commit is the one
the TaskManager runs: all-reducing epochs take the fast path of ``taskmanager/epochs/fast_commit.py``.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
import struct
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from keyedstate.common._proto.v1 import common_pb2
from keyedstate.common._proto.v1 import taskmanager_pb2 as tm_pb
from keyedstate.common.batches import Winner
from keyedstate.common.clock import SystemClock
from keyedstate.common.descriptors import OperatorSpec, ReduceField, StateDescriptor, StateKind
from keyedstate.common.ids import KeyGroupRange, SubtaskId, TaskManagerId
from keyedstate.taskmanager.epochs import EpochManager, EpochTransaction, SlotEpochs
from keyedstate.taskmanager.epochs.attempt import TaskAttempt
from keyedstate.taskmanager.rpc.task_executor import commit_epoch
from keyedstate.taskmanager.slots import SlotTable
from keyedstate.taskmanager.state import StateLimits, create_backend

MP = 128
STATES = (StateDescriptor("totals", StateKind.REDUCING, reduce_fields=(ReduceField("count"), ReduceField("sum"))),)
VECTOR = struct.Struct(">qq")
REQUEST_KEYS = 2000  # the client's batch size


@dataclass(frozen=True)
class SlotProfile:
    """Per-key CPU of one slot's W1 micro-batch, and the functions that take it (own-time shares)."""

    keys_per_epoch: int
    stage_us_per_key: float
    commit_us_per_key: float
    stage_top: list[tuple[str, float]]
    commit_top: list[tuple[str, float]]
    report: str  # the pstats text, when profiled

    def summary(self, top: int = 6) -> str:
        def fmt(items: list[tuple[str, float]]) -> str:
            return ", ".join(f"{name} {share:.0%}" for name, share in items[:top])

        return (
            f"staging {self.stage_us_per_key:.1f} us/key [{fmt(self.stage_top)}]; "
            f"commit {self.commit_us_per_key:.1f} us/key [{fmt(self.commit_top)}]"
        )


def measure(keys: int, epochs: int = 3, profiled: bool = True, top: int = 18) -> SlotProfile:
    """Stage ``epochs`` micro-batches of about ``keys`` reduce operands on one RocksDB slot and commit each."""
    with tempfile.TemporaryDirectory(prefix="w1-tm-profile-") as tmp:
        work = Path(tmp)
        table = SlotTable(1, TaskManagerId("tm-profile"))
        subtask = SubtaskId("w1", "w1", 0)
        manager = EpochManager(table, lambda s: work / s.instance_dir_name())
        slot = table.reserve(subtask, OperatorSpec("w1", 1, STATES), KeyGroupRange(0, MP - 1), MP, 0, 1, "", False)
        backend = create_backend(
            "rocksdb",
            subtask,
            KeyGroupRange(0, MP - 1),
            MP,
            STATES,
            local_dir=work,
            limits=StateLimits(),
            clock=SystemClock(),
        )
        table.activate(slot, backend)
        rng = np.random.default_rng(1)
        stage = cProfile.Profile()
        commit = cProfile.Profile()
        times = {"stage": 0.0, "commit": 0.0}
        staged_keys = 0
        expected: dict[bytes, tuple[int, int]] = {}
        try:
            for epoch in range(epochs):  # epochs are contiguous from 0
                users = np.sort(rng.choice(keys * 3, size=keys, replace=False)).astype(np.int64)
                raw = users.astype(">i8").tobytes()
                kb = [raw[i : i + 8] for i in range(0, len(raw), 8)]
                staged_keys += len(kb)
                ops = [VECTOR.pack(1, int(u)) for u in users.tolist()]
                for k, u in zip(kb, users.tolist()):
                    c, t = expected.get(k, (0, 0))
                    expected[k] = (c + 1, t + u)
                view = manager.view(slot, common_pb2.EpochContext(epoch=epoch, partition=0, attempt=1))
                request = tm_pb.EpochCommitRequest(job_id="w1", epoch=epoch, routing_version=1)
                request.winners.add(partition=0, attempt=1)
                t0 = time.perf_counter()
                with _maybe(stage, profiled):
                    for a in range(0, len(kb), REQUEST_KEYS):
                        view.reduce("totals", kb[a : a + REQUEST_KEYS], ops[a : a + REQUEST_KEYS], b"", False)
                t1 = time.perf_counter()
                with _maybe(commit, profiled):
                    commit_epoch(manager, request)
                times["stage"] += t1 - t0
                times["commit"] += time.perf_counter() - t1
            keys_all = list(expected)
            got = [VECTOR.unpack(v) if v is not None else None for v in backend.value_get("totals", keys_all, b"")]
            if got != [expected[k] for k in keys_all]:
                raise AssertionError("the committed state differs from the staged operands")
        finally:
            manager.close()
            backend.close()
    out = io.StringIO()
    if profiled:
        for label, prof in (("staging (EpochTransaction.reduce)", stage), ("commit (EpochManager.commit)", commit)):
            out.write(f"\n== {label}: top {top} by own time\n")
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return SlotProfile(
        staged_keys // epochs,
        times["stage"] / staged_keys * 1e6,
        times["commit"] / staged_keys * 1e6,
        _shares(stage) if profiled else [],
        _shares(commit) if profiled else [],
        out.getvalue(),
    )


@contextlib.contextmanager
def _maybe(prof: cProfile.Profile, enabled: bool) -> Iterator[None]:
    if enabled:
        prof.enable()
    try:
        yield
    finally:
        if enabled:
            prof.disable()


def _shares(prof: cProfile.Profile) -> list[tuple[str, float]]:
    """(function, share of the profiled own time), largest first."""
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = [
        ((Path(f).stem + "." + fn) if f != "~" else fn.strip("<>").replace("method ", ""), tt)
        for (f, _, fn), (_, _, tt, _, _) in stats.items()
    ]
    total = sum(tt for _, tt in rows) or 1.0
    merged: dict[str, float] = {}
    for name, tt in rows:
        merged[name] = merged.get(name, 0.0) + tt / total
    return sorted(merged.items(), key=lambda kv: -kv[1])


W2_STATES = (StateDescriptor("session", StateKind.VALUE), StateDescriptor("times", StateKind.LIST))


@dataclass(frozen=True)
class CommitTiming:
    """Commit CPU of W2-shaped epochs (ListState appends and clears, ValueState puts) on one slot."""

    fast: bool
    events_per_epoch: int
    users_per_epoch: int
    stage_us_per_event: float
    commit_us_per_event: float


def measure_w2(users: int, events_per_user: int, fast: bool, epochs: int = 3, seed: int = 1) -> CommitTiming:
    """Stage ``epochs`` W2-shaped micro-batches on one RocksDB slot and commit each, with the fast path or not.

    Per epoch: the lists of a tenth of the users are cleared (their sessions closed), every user
    gets ``events_per_user`` appended times and one session put, in requests of
    ``REQUEST_KEYS`` keys, as ``bench/w2/executor.sessionize_partition`` sends them. The
    committed state is checked against the staged writes. Times are the calling thread's CPU
    time (staging and the commit run in it), which other processes on a shared machine barely move.
    """
    with tempfile.TemporaryDirectory(prefix="w2-tm-profile-") as tmp:
        work = Path(tmp)
        table = SlotTable(1, TaskManagerId("tm-profile"))
        subtask = SubtaskId("w2", "w2", 0)
        spec = OperatorSpec("w2", 1, W2_STATES)
        slot = table.reserve(subtask, spec, KeyGroupRange(0, MP - 1), MP, 0, 1, "", False)
        backend = create_backend(
            "rocksdb",
            subtask,
            KeyGroupRange(0, MP - 1),
            MP,
            W2_STATES,
            local_dir=work,
            limits=StateLimits(),
            clock=SystemClock(),
        )
        table.activate(slot, backend)
        slot_epochs = SlotEpochs(slot, backend, work / "staging", fast_commit=fast)
        rng = np.random.default_rng(seed)
        keys = [int(u).to_bytes(8, "big") for u in range(users)]
        expected: dict[bytes, list[bytes]] = {}
        times = {"stage": 0.0, "commit": 0.0}
        try:
            for epoch in range(epochs):
                closed = [keys[i] for i in rng.choice(users, size=users // 10, replace=False).tolist()]
                append_keys = [k for k in keys for _ in range(events_per_user)]
                stamps = rng.integers(0, 1 << 40, size=len(append_keys)).astype(">i8").tobytes()
                append_values = [stamps[i : i + 8] for i in range(0, len(stamps), 8)]
                for k in closed:
                    expected[k] = []
                for k, v in zip(append_keys, append_values):
                    expected.setdefault(k, []).append(v)
                view = EpochTransaction(slot_epochs, TaskAttempt(epoch, 0, 1))
                t0 = time.thread_time()
                for a in range(0, len(closed), REQUEST_KEYS):
                    view.clear("times", closed[a : a + REQUEST_KEYS], b"")
                for a in range(0, len(append_keys), REQUEST_KEYS):
                    view.list_append(
                        "times", append_keys[a : a + REQUEST_KEYS], append_values[a : a + REQUEST_KEYS], b""
                    )
                for a in range(0, users, REQUEST_KEYS):
                    view.value_put(
                        "session", keys[a : a + REQUEST_KEYS], [b"s%d" % epoch] * len(keys[a : a + REQUEST_KEYS]), b""
                    )
                t1 = time.thread_time()
                slot_epochs.commit(epoch, {0: Winner(0, 1)}, routing_version=1)
                times["stage"] += t1 - t0
                times["commit"] += time.thread_time() - t1
            if backend.list_get("times", keys, b"") != [expected[k] for k in keys]:
                raise AssertionError("the committed lists differ from the staged appends")
        finally:
            slot_epochs.close()
            backend.close()
    events = users * events_per_user
    return CommitTiming(
        fast, events, users, times["stage"] / (events * epochs) * 1e6, times["commit"] / (events * epochs) * 1e6
    )


def compare_w2(users: int, events_per_user: int, pairs: int = 2) -> list[CommitTiming]:
    """General and fast commits of W2-shaped epochs, alternating ``pairs`` times (the machine may be shared)."""
    out: list[CommitTiming] = []
    for _ in range(pairs):
        out.append(measure_w2(users, events_per_user, fast=False))
        out.append(measure_w2(users, events_per_user, fast=True))
    return out


def _main_w2(users: int) -> None:
    runs = compare_w2(users, events_per_user=4)
    for t in runs:
        print(
            f"{'fast   ' if t.fast else 'general'} commit: {t.commit_us_per_event:.2f} us/event (thread CPU) "
            f"({t.events_per_epoch} events, {t.users_per_epoch} users per epoch); staging {t.stage_us_per_event:.2f} us/event"
        )
    ratios = [g.commit_us_per_event / f.commit_us_per_event for g, f in zip(runs[::2], runs[1::2])]
    print("general / fast commit CPU per event, per pair: " + ", ".join(f"{x:.2f}" for x in ratios))


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--w2" in sys.argv:
        _main_w2(int(args[0]) if args else 25_000)
        sys.exit(0)
    keys = int(args[0]) if args else 63_000
    plain = measure(keys, profiled=False)
    print(
        f"~{plain.keys_per_epoch} keys per epoch: staging {plain.stage_us_per_key:.1f} us/key, "
        f"commit {plain.commit_us_per_key:.1f} us/key (no profiler)"
    )
    profiled = measure(keys)
    print(profiled.summary())
    print(profiled.report)
