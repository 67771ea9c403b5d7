"""Scenario 7: coordinator scale, simulated.

The real ``CheckpointCoordinator`` (real ``file://`` storage for ``_metadata``, real cleaner,
system clock and thread scheduler) coordinates jobs of 1,000, 10,000 and 20,000 slots, in
turn, three rounds (quick: 1,000 and 3,000, one round). The TaskManagers are simulated in this process: a gateway that, on the
barrier, acknowledges every subtask at once with a handle shaped like a real incremental
RocksDB snapshot (two shared SST files and three private files). Nothing is uploaded, so the
figure is the coordinator's own cost: trigger → every ack → ``_metadata`` written → completed.

Targets: under 1 s for 1,000 slots, and growth linear or better (the time per slot at
10,000 is at most the time per slot at 1,000). Reported beside them: the CPU seconds of this
process per checkpoint (less noisy than wall time on a shared machine), the 20,000-slot trend,
and the full garbage collections per checkpoint.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import shutil
import statistics
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.result import BenchContext, Measurement, Ratio, ScenarioResult, Series
from keyedstate.common import gc_policy
from keyedstate.jobmanager.checkpoint import EpochCut

logger = logging.getLogger(__name__)

NAME = "coordinator_scale"
TITLE = "Coordinator scale: trigger to completed _metadata for 1,000, 10,000 and 20,000 simulated slots"

MAX_PARALLELISM = 1 << 15
SLOTS_PER_OPERATOR = 250
REPEATS = 3
ROUNDS = 3


class ImmediateAckTaskManagers:
    """A CheckpointGateway whose TaskManagers acknowledge every subtask inside ``send_barrier``.

    The handles are built once, as the bytes a TaskManager sends (its snapshot work is not what
    is measured); each barrier re-acknowledges them the way the JobManager's gRPC servicer does:
    parse the message, convert it (``handle_from_proto``), call the coordinator's public
    ``acknowledge``. Parsing and converting are JobManager work. (Acknowledging ready-made
    domain handles instead kept the simulated TaskManagers' 8 objects per slot in the measured
    process's heap, where every full garbage collection scanned them; a real JobManager holds
    none of them.)
    """

    def __init__(self, operators: list[Any], max_parallelism: int) -> None:
        from keyedstate.common._proto.v1 import common_pb2 as pb
        from keyedstate.common.keygroups import key_group_range_for_subtask

        self.coordinator: Any = None
        self.handles: list[bytes] = []
        self.notified: list[tuple[int, bool]] = []
        for op in operators:
            for i in range(op.parallelism):
                kg = key_group_range_for_subtask(max_parallelism, op.parallelism, i)
                h = pb.SubtaskStateHandle(
                    operator_id=op.operator_id,
                    subtask_index=i,
                    backend="rocksdb",
                    key_groups=pb.KeyGroupRange(start=kg.start, end=kg.end),
                )
                tag = f"{op.operator_id}-{i}"
                for n in range(2):
                    h.files.add(
                        path=f"shared/{tag}-{n:06d}.sst",
                        size=64 << 20,
                        sha256=f"{n:064x}",
                        local_name=f"{n:06d}.sst",
                        shared=True,
                    )
                for name, size in (("MANIFEST-000005", 4096), ("CURRENT", 16), ("OPTIONS-000007", 7000)):
                    h.files.add(path=f"{tag}/{name}", size=size, sha256="f" * 64, local_name=name, shared=False)
                h.full_size = sum(f.size for f in h.files)
                h.incremental_size = sum(f.size for f in h.files if not f.shared)
                self.handles.append(h.SerializeToString())

    @contextlib.contextmanager
    def cut(self) -> Iterator[EpochCut]:
        yield EpochCut(0)  # the simulated snapshots all hold epoch 0

    def send_barrier(self, barrier: Any) -> None:
        from keyedstate.common._proto.v1 import common_pb2 as pb
        from keyedstate.common.rpc.convert import handle_from_proto

        ack, parse = self.coordinator.acknowledge, pb.SubtaskStateHandle.FromString
        for h in self.handles:
            ack(barrier.checkpoint_id, handle_from_proto(parse(h)))

    def notify(self, job_id: str, checkpoint_id: int, completed: bool) -> None:
        self.notified.append((checkpoint_id, completed))


def _coordinator(slots: int, job_dir: Path) -> tuple[Any, ImmediateAckTaskManagers]:
    from keyedstate.common.clock import SYSTEM_CLOCK, ThreadScheduler
    from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
    from keyedstate.common.ids import JobId
    from keyedstate.common.storage import open_storage
    from keyedstate.jobmanager.checkpoint import (
        CheckpointCoordinator,
        CheckpointingSettings,
        CoordinatorConfig,
        CoordinatorServices,
    )

    if slots % SLOTS_PER_OPERATOR:
        raise ValueError(f"slots must be a multiple of {SLOTS_PER_OPERATOR}, got {slots}")
    operators = [
        OperatorSpec(f"op{i}", SLOTS_PER_OPERATOR, (StateDescriptor("s", StateKind.VALUE),))
        for i in range(slots // SLOTS_PER_OPERATOR)
    ]
    gateway = ImmediateAckTaskManagers(operators, MAX_PARALLELISM)
    url = job_dir.as_uri()
    coordinator = CheckpointCoordinator(
        CoordinatorConfig(JobId(f"scale-{slots}"), url, MAX_PARALLELISM, CheckpointingSettings(incremental=True)),
        CoordinatorServices(open_storage(url), gateway, SYSTEM_CLOCK, ThreadScheduler()),
        operators=operators,
    )
    gateway.coordinator = coordinator
    return coordinator, gateway


def _checkpoint(coordinator: Any) -> tuple[float, float, int]:
    """One checkpoint: (seconds from trigger to completed, CPU seconds of this process, checkpoint id)."""
    cpu, start = time.process_time(), time.perf_counter()
    pending = coordinator.trigger()
    completed = coordinator.wait_for(pending.checkpoint_id, timeout=600)
    return time.perf_counter() - start, time.process_time() - cpu, completed.checkpoint_id


@contextlib.contextmanager
def _full_collections() -> Iterator[list[int]]:
    """Counts the garbage collector's full (generation 2) collections while the block runs."""
    count = [0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            count[0] += 1

    gc.callbacks.append(callback)
    try:
        yield count
    finally:
        gc.callbacks.remove(callback)


COLLECTORS = ("daemon", "default", "off")
"""How the garbage collector runs in a round: ``daemon``, under the daemons' policy
(``keyedstate.common.gc_policy``, what the jobmanager process runs with); ``default``, CPython's
default thresholds; ``off``, not at all (what the coordinator's own code costs, without the
collections its allocations trigger)."""


def measure(
    slots: int, workdir: Path, repeats: int = REPEATS, memory: bool = True, collector: str = "daemon"
) -> dict[str, Any]:
    """Timed checkpoints of one job size (and, with ``memory``, a traced one first for memory).

    ``collector``: one of :data:`COLLECTORS`.
    """
    if collector not in COLLECTORS:
        raise ValueError(f"collector must be one of {COLLECTORS}, got {collector!r}")
    job_dir = workdir / f"job-{slots}-{time.monotonic_ns()}"
    with _collector(collector):
        return _measure(slots, job_dir, repeats, memory)


@contextlib.contextmanager
def _collector(collector: str) -> Iterator[None]:
    """Runs the block under ``collector`` (:data:`COLLECTORS`); restores this process's collector after it."""
    gc.collect()
    thresholds = gc.get_threshold()
    if collector == "default":
        gc.set_threshold(700, 10, 10)  # CPython's defaults
    else:
        gc_policy.apply()  # as the jobmanager daemon runs after start-up
    if collector == "off":
        gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def _measure(slots: int, job_dir: Path, repeats: int, memory: bool) -> dict[str, Any]:
    tracemalloc.start()
    coordinator, gateway = _coordinator(slots, job_dir)
    setup_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    if memory:
        _checkpoint(coordinator)  # traced: slower, so only for memory
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    if not memory:
        _checkpoint(coordinator)  # every timed checkpoint comes after a first one
    times, cpus, last_id = [], [], 0
    with _full_collections() as full:
        for _ in range(repeats):
            seconds, cpu, last_id = _checkpoint(coordinator)
            times.append(seconds)
            cpus.append(cpu)
    meta = job_dir / f"chk-{last_id}" / "_metadata"
    if not meta.exists():
        raise AssertionError(f"checkpoint {last_id} completed but {meta} does not exist")
    if gateway.notified[-1] != (last_id, True):
        raise AssertionError(
            f"the TaskManagers were not told that checkpoint {last_id} completed: {gateway.notified[-3:]}"
        )
    metadata_bytes = meta.stat().st_size
    coordinator.shutdown()
    shutil.rmtree(job_dir, ignore_errors=True)
    out: dict[str, Any] = {"times": times, "cpus": cpus, "full_gcs": full[0], "metadata_bytes": metadata_bytes}
    if memory:
        out.update(peak_bytes=peak - setup_bytes, retained_bytes=current - setup_bytes, setup_bytes=setup_bytes)
    return out


def measure_rounds(
    sizes: tuple[int, ...], workdir: Path, rounds: int = ROUNDS, collector: str = "daemon"
) -> dict[int, dict[str, Any]]:
    """Every size in turn, ``rounds`` times (a shared machine's load then weighs on every size alike).

    Each round gives every size a fresh coordinator and ``REPEATS`` timed checkpoints; the
    medians are over all of them. Memory is traced in the first round only.
    """
    results: dict[int, dict[str, Any]] = {}
    for r in range(rounds):
        for s in sizes:
            m = measure(s, workdir, memory=r == 0, collector=collector)
            agg = results.setdefault(s, {"times": [], "cpus": [], "full_gcs": 0})
            agg["times"] += m.pop("times")
            agg["cpus"] += m.pop("cpus")
            agg["full_gcs"] += m.pop("full_gcs")
            agg.update(m)
    for agg in results.values():
        agg.update(
            median_s=statistics.median(agg["times"]),
            min_s=min(agg["times"]),
            max_s=max(agg["times"]),
            cpu_s=statistics.median(agg["cpus"]),
            full_gcs_per_checkpoint=agg["full_gcs"] / len(agg["times"]),
        )
    return results


def _per_slot(results: dict[int, dict[str, Any]], large: int, small: int, key: str) -> float:
    return float((results[large][key] / large) / (results[small][key] / small))


def _measurements(results: dict[int, dict[str, Any]]) -> list[Measurement]:
    out: list[Measurement] = []
    for s, r in results.items():
        n = len(r["times"])
        out += [
            Measurement(
                f"{s} slots: trigger -> _metadata",
                r["median_s"] * 1000,
                "ms",
                f"median of {n} ({r['min_s'] * 1000:.0f}-{r['max_s'] * 1000:.0f})",
            ),
            Measurement(f"{s} slots: CPU per checkpoint", r["cpu_s"] * 1000, "ms", f"this process, median of {n}"),
            Measurement(f"{s} slots: acks coordinated", s / r["median_s"], "acks/s"),
            Measurement(f"{s} slots: full garbage collections", r["full_gcs_per_checkpoint"], "per checkpoint"),
            Measurement(f"{s} slots: _metadata size", r["metadata_bytes"] / 1024, "KiB"),
            Measurement(
                f"{s} slots: memory peak during a checkpoint",
                r["peak_bytes"] / (1 << 20),
                "MiB",
                "tracemalloc, above the idle coordinator",
            ),
            Measurement(
                f"{s} slots: memory kept after it",
                r["retained_bytes"] / (1 << 20),
                "MiB",
                "the completed checkpoint retained",
            ),
        ]
    return out


def _ratios(results: dict[int, dict[str, Any]], sizes: tuple[int, ...]) -> list[Ratio]:
    small, large = sizes[0], sizes[1]
    ratios = [
        Ratio(f"{small} slots: time / 1 s", results[small]["median_s"] / 1.0, 1.0, "<=", "under 1 s for 1,000 slots"),
        Ratio(
            f"time per slot at {large} / at {small}",
            _per_slot(results, large, small, "median_s"),
            1.0,
            "<=",
            "linear or better",
        ),
    ]
    for s in sizes[1:]:
        ratios.append(
            Ratio(
                f"CPU per slot at {s} / at {small}", _per_slot(results, s, small, "cpu_s"), None, "<=", "this process"
            )
        )
    for s in sizes[2:]:
        ratios.append(
            Ratio(f"time per slot at {s} / at {small}", _per_slot(results, s, small, "median_s"), None, "<=", "trend")
        )
    for s in sizes[1:]:
        ratios.append(
            Ratio(
                f"memory per slot at {s} / at {small}",
                _per_slot(results, s, small, "peak_bytes"),
                None,
                "<=",
                "peak during a checkpoint",
            )
        )
    return ratios


NOTE = (
    "Where the growth was: the checkpoint statistics rebuilt a frozen history entry per ack, copying every earlier "
    "ack into a new tuple (quadratic in the subtasks); they now append to a list while the checkpoint is in progress "
    "and hand the entry a tuple once. Earlier fixes: a finished checkpoint is remembered without its metadata, an ack "
    "becomes its _metadata entry once, _metadata is encoded a subtask at a time, and the daemons' collector policy "
    "(keyedstate.common.gc_policy: thresholds 10,000/20/100, start-up objects frozen) keeps full collections off the "
    "checkpoint path (0 per checkpoint at every size). cProfile call counts grow exactly with the slots: the work is "
    "linear. What remains above 1.0 is the cost per call of the same work on a larger heap (a 10,000-slot checkpoint "
    "peaks at ~53 MiB, a 1,000-slot one at ~5.5 MiB, against 2 MiB of L2 cache per core). With the collector on, "
    "cProfile charges the young collections to whatever allocates when they start (file_path_problem's own time "
    "7.5 -> 21 us per slot); with it off, the growth spreads over every function that allocates (str.split "
    "2.5 -> 6.5, message parsing 4.1 -> 7.3, file_from_proto 11.7 -> 18.1 us per slot), and the 'collector off' "
    "rounds grow as much as the timed ones (1.14 against 1.02 in one run): the collector is not the cause. On this "
    "VM the ratio spreads more between runs than any code change moved it: 1.02, 1.07, 1.11, 1.18 and 1.20 in five "
    "runs of this scenario alone, 1.49 in the full run right after the 5 GB memory scenario (its 1,000-slot figure "
    "the same 95 ms). "
    "This VM exposes no hardware counters (perf: not supported), so the cache misses are inferred, not counted. What "
    "would close it: a smaller live heap per slot: a checkpoint's per-subtask files and statistics kept as packed "
    "columns (arrays of numbers, one blob of paths) instead of ~8 Python objects per slot, so that the working set "
    "of 10,000 slots is what 1,000 slots' is now."
)


def run(ctx: BenchContext) -> ScenarioResult:
    sizes = (1_000, 3_000) if ctx.quick else (1_000, 10_000, 20_000)
    results = measure_rounds(sizes, ctx.workdir, rounds=1 if ctx.quick else ROUNDS)
    # As many rounds as the timed ones: a single round's ratio swings by +-0.3 on this VM.
    rounds = 1 if ctx.quick else ROUNDS
    default_gc = measure_rounds(sizes[:2], ctx.workdir, rounds=rounds, collector="default")
    no_gc = measure_rounds(sizes[:2], ctx.workdir, rounds=rounds, collector="off")
    series = [
        Series(
            "coordinator_scale",
            "trigger -> _metadata (ms)",
            [float(s) for s in sizes],
            [results[s]["median_s"] * 1000 for s in sizes],
            "slots",
            "ms",
        ),
        Series(
            "coordinator_scale_memory",
            "peak memory during a checkpoint (MiB)",
            [float(s) for s in sizes],
            [results[s]["peak_bytes"] / (1 << 20) for s in sizes],
            "slots",
            "MiB",
        ),
    ]
    params = {
        "slots": list(sizes),
        "operators_of": SLOTS_PER_OPERATOR,
        "max_parallelism": MAX_PARALLELISM,
        "files_per_ack": "2 shared + 3 private",
        "storage": "file://",
        "repeats": f"{REPEATS} checkpoints x {1 if ctx.quick else ROUNDS} rounds, sizes alternating",
    }
    print("   " + "; ".join(f"{s} slots {results[s]['median_s'] * 1000:.0f} ms" for s in sizes), flush=True)
    small, large = sizes[0], sizes[1]
    ratios = _ratios(results, sizes) + [
        Ratio(
            f"time per slot at {large} / at {small}, CPython's default GC thresholds",
            _per_slot(default_gc, large, small, "median_s"),
            None,
            "<=",
            f"{rounds} round(s); the daemons do not run this way",
        ),
        Ratio(
            f"CPU per slot at {large} / at {small}, collector off",
            _per_slot(no_gc, large, small, "cpu_s"),
            None,
            "<=",
            f"{rounds} round(s): the coordinator's own code, without the collections its allocations trigger",
        ),
    ]
    return ScenarioResult(NAME, TITLE, params, _measurements(results), ratios, series, [NOTE])
