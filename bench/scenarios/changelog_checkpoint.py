"""Changelog checkpoints: per-micro-batch checkpoint duration against state size, and restore with a tail.

Real processes: a JobManager and one TaskManager with one RocksDB slot, ``file://`` checkpoint
storage on the local disk. For each state size a job is filled with 16 B random keys and 1,000 B
random values by direct writes (a changelog job takes only epoch commits), checkpointed and
cancelled; then two jobs are restored from that checkpoint (claim mode NO_CLAIM), one with
``state.changelog.enabled`` and one with plain incremental checkpoints. Each runs the same
micro-batches: an epoch rewriting ``BATCH_KEYS`` keys through the epoch protocol, committed with
a checkpoint, as ``foreachBatch`` does. The figure is the median checkpoint duration (the
JobManager's, trigger to completed ``_metadata``); the median of the whole commit call with its
checkpoint, what the driver waits for, is reported beside it.

The changelog checkpoint seals and uploads one small segment per batch whatever the state size,
so its duration should not grow with the state (target: the large state's at most 1.2x the
small one's); an incremental checkpoint flushes the memtable and uploads a new SST file every time.
Background materialization is set to 10 minutes so none runs during the batches (its cost is
off the commit path, and it is what the restore figures then depend on).

Restore: the changelog job is restored from its last checkpoint (the first checkpoint's
materialization plus ``BATCHES`` segments to replay) and the incremental job from its own (no
tail); the figure is the whole ``RestoreJob`` call, which checkpoints the running job first.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from typing import Any

from bench.result import BenchContext, Measurement, Ratio, ScenarioResult
from bench.statefill import (
    OPERATOR,
    STATE,
    StateFiller,
    TaskManagerMetrics,
    bench_client,
    single_slot_cluster,
    submit,
)
from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.client import StateClient, ValueState

logger = logging.getLogger(__name__)

NAME = "changelog_checkpoint"
TITLE = "Changelog checkpoints: per-micro-batch checkpoint duration against state size, restore with a tail"

VALUE_BYTES = 1000
BATCH_KEYS = 2000
MB = 1 << 20
TARGET_RATIO = 1.2


def _batches(
    client: StateClient, job: str, filler: StateFiller, batches: int, first_epoch: int, metrics: TaskManagerMetrics
) -> tuple[list[float], list[float]]:
    """Run ``batches`` epochs, each rewriting BATCH_KEYS keys and committed with a checkpoint; (wall ms, checkpoint ms).

    After the first (a full checkpoint) the slot's RocksDB is left to finish its flushes and
    compactions, so the batches measured at each size run on a settled disk, not behind the
    compaction of a freshly restored gigabyte.
    """
    wall, durations = [], []
    attempts = itertools.count(1)
    for i in range(batches):
        if i == 1:
            metrics.wait_quiet()
        epoch = first_epoch + i
        chunk = i % filler.chunks
        keys = filler.keys(chunk)[:BATCH_KEYS]
        attempt = next(attempts)
        state: ValueState[bytes, bytes] = ValueState(
            client,
            job,
            OPERATOR,
            STATE,
            key_serializer="bytes",
            value_serializer="bytes",
            epoch=pb.EpochContext(epoch=epoch, partition=0, attempt=attempt),
        )
        version = client.routing(job, refresh=True).version
        state.put_many(keys, filler.values(chunk, epoch + 1, BATCH_KEYS))
        t0 = time.perf_counter()
        answer = client.commit_epoch(job, epoch, {0: attempt}, expected_routing_version=version, timeout_s=600)
        wall.append((time.perf_counter() - t0) * 1000.0)
        if answer.checkpoint is None:
            raise RuntimeError(f"the commit of epoch {epoch} of {job} came back without its checkpoint")
        durations.append(float(answer.checkpoint.duration_ms))
    return wall, durations


def _fill(client: StateClient, job: str, filler: StateFiller, size: int) -> tuple[str, float]:
    """A plain job filled to ``size`` bytes and checkpointed, then cancelled; (checkpoint path, fill seconds)."""
    state = submit(client, job_id=job, config={"execution.checkpointing.incremental": "true"})
    fill_s = filler.fill_to(state, size)
    info = client.trigger_checkpoint(job, timeout_s=1800)
    if info.status != jm_pb.CHECKPOINT_STATUS_COMPLETED:
        raise RuntimeError(f"the fill checkpoint of {job} failed: {info.failure_reason}")
    client.cancel_job(job)
    return info.path, fill_s


def _restored(client: StateClient, job: str, source: str, changelog: bool) -> None:
    config: dict[str, Any] = {
        "execution.checkpointing.incremental": "true",
        "execution.state-recovery.claim-mode": "NO_CLAIM",
    }
    if changelog:
        config |= {"state.changelog.enabled": "true", "state.changelog.periodic-materialize.interval": "10 min"}
    submit(client, job_id=job, restore_path=source, config=config)


def run(ctx: BenchContext) -> ScenarioResult:
    sizes = (10 * MB, 100 * MB) if ctx.quick else (10 * MB, 1024 * MB)
    batches = 8 if ctx.quick else 20
    measurements: list[Measurement] = []
    medians: dict[tuple[str, int], float] = {}
    """(kind, size) -> median checkpoint duration (the JobManager's, trigger to completed _metadata)."""
    walls: dict[tuple[str, int], float] = {}
    """(kind, size) -> median time of the commit call with its checkpoint, as the driver waits for it."""
    restores: dict[str, float] = {}
    storage = (ctx.workdir / "checkpoints").as_uri()
    first_port, port_range = TaskManagerMetrics.port_range()
    config = {"state.checkpoints.dir": storage, "metrics.reporter.prom.port": port_range}
    with single_slot_cluster(ctx.workdir / "cluster", config) as cluster:
        metrics = TaskManagerMetrics(first_port)
        client = bench_client(cluster.jobmanager_address)
        for n, size in enumerate(sizes):
            filler = StateFiller(ctx.seed + n, VALUE_BYTES)
            source, fill_s = _fill(client, f"fill-{n}", filler, size)
            logger.info("filled %d MB in %.1f s", size // MB, fill_s)
            for kind in ("changelog", "incremental"):
                job = f"{kind}-{n}"
                _restored(client, job, source, kind == "changelog")
                first = client.job_info(job).committed_epoch + 1
                # The first batch's checkpoint is a full one (NO_CLAIM: the source stays the fill job's;
                # for the changelog job it is its first materialization): not a per-batch figure.
                wall, durations = _batches(client, job, filler, batches + 1, first, metrics)
                medians[(kind, size)] = statistics.median(durations[1:])
                walls[(kind, size)] = statistics.median(wall[1:])
                measurements += [
                    Measurement(
                        f"{kind}: median checkpoint per micro-batch, {size // MB} MB state",
                        medians[(kind, size)],
                        "ms",
                        f"the JobManager's duration, trigger to _metadata; {BATCH_KEYS} keys rewritten per batch",
                    ),
                    Measurement(
                        f"{kind}: median commit + checkpoint call per micro-batch, {size // MB} MB state",
                        walls[(kind, size)],
                        "ms",
                        "what foreachBatch waits for: the epoch commit, then the checkpoint",
                    ),
                ]
                if size == sizes[-1]:
                    latest = client.job_info(job).latest_checkpoint_path
                    t0 = time.perf_counter()
                    client.restore_job(job, latest)
                    restores[kind] = time.perf_counter() - t0
                    measurements.append(
                        Measurement(
                            f"{kind}: restore of the last checkpoint, {size // MB} MB state",
                            restores[kind],
                            "s",
                            f"with {batches} segments to replay" if kind == "changelog" else "no tail",
                        )
                    )
                client.cancel_job(job)
        client.close()
    small, large = sizes
    return ScenarioResult(
        NAME,
        TITLE,
        params={
            "state_sizes_mb": [s // MB for s in sizes],
            "batches": batches,
            "batch_keys": BATCH_KEYS,
            "value_bytes": VALUE_BYTES,
            "storage": "file:// (local disk)",
            "backend": "rocksdb",
        },
        measurements=measurements,
        ratios=[
            Ratio(
                f"changelog checkpoint per batch, {large // MB} MB / {small // MB} MB state",
                medians[("changelog", large)] / medians[("changelog", small)],
                TARGET_RATIO,
                "<=",
            ),
            Ratio(
                f"incremental checkpoint per batch, {large // MB} MB / {small // MB} MB state",
                medians[("incremental", large)] / medians[("incremental", small)],
                None,
                "<=",
                "for comparison",
            ),
            Ratio(
                f"changelog commit + checkpoint call per batch, {large // MB} MB / {small // MB} MB state",
                walls[("changelog", large)] / walls[("changelog", small)],
                None,
                "<=",
                "the commit (log fsync, apply) included",
            ),
            Ratio(
                f"changelog / incremental checkpoint per batch, {large // MB} MB state",
                medians[("changelog", large)] / medians[("incremental", large)],
                None,
                "<=",
            ),
            Ratio(
                f"restore with a {batches}-segment tail / without, {large // MB} MB state",
                restores["changelog"] / restores["incremental"],
                None,
                "<=",
            ),
        ],
    )
