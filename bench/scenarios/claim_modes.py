"""Restore claim modes: bytes uploaded by the first and second checkpoint after a restore.

A real JobManager and one real TaskManager (one RocksDB slot, incremental checkpoints, local
``file://`` storage) fill a state of 200,000 keys (16 B keys, 100 B random values, about 23 MB;
20,000 in quick mode), take checkpoint 1 and cancel the job. The job is then restored from
checkpoint 1 twice, first with NO_CLAIM, then with CLAIM (which may delete checkpoint 1 once
subsumed, so it goes last). After each restore 1% of the keys are rewritten before each of two
checkpoints, and the scenario reports what each checkpoint uploaded (its incremental size).
NO_CLAIM's first checkpoint must be full (it references nothing the user may delete); CLAIM's
references checkpoint 1's SST files and uploads about what changed.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from bench.result import BenchContext, Measurement, Ratio, ScenarioResult
from bench.statefill import (
    CHUNK_KEYS,
    KEY_BYTES,
    OPERATOR,
    STATE,
    StateFiller,
    bench_client,
    single_slot_cluster,
    submit,
)
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.client import StateClient, ValueState

logger = logging.getLogger(__name__)

NAME = "claim_modes"
TITLE = "Restore claim modes: bytes of the first and second checkpoint after a restore"

JOB = "claims"
VALUE_BYTES = 100
REWRITE = CHUNK_KEYS // 100  # 1% of every chunk's keys, before each checkpoint
KB = 1 << 10


def _checkpoint(client: StateClient) -> jm_pb.CheckpointInfo:
    info = client.trigger_checkpoint(JOB, timeout_s=600)
    if info.status != jm_pb.CHECKPOINT_STATUS_COMPLETED:
        raise RuntimeError(f"checkpoint failed: {info.failure_reason}")
    return info


def _rewrite(state: ValueState[bytes, bytes], filler: StateFiller, version: int) -> None:
    for chunk in range(filler.chunks):
        state.put_many(filler.keys(chunk)[:REWRITE], filler.values(chunk, version, REWRITE))


def _verify(state: ValueState[bytes, bytes], filler: StateFiller, version: int) -> None:
    for chunk in sorted({0, filler.chunks - 1}):
        expected = filler.values(chunk, version, REWRITE) + filler.values(chunk)[REWRITE:]
        if state.get_many(filler.keys(chunk)) != expected:
            raise RuntimeError(f"state after the restore differs from what was written (chunk {chunk})")


def _after_restore(
    client: StateClient, source: str, mode: str, filler: StateFiller
) -> tuple[float, jm_pb.CheckpointInfo, jm_pb.CheckpointInfo]:
    """Restore ``source`` in ``mode``, then two checkpoints with 1% rewritten before each; (restore s, 1st, 2nd)."""
    t0 = time.perf_counter()
    client.restore_job(JOB, source, claim_mode=mode)
    restore_s = time.perf_counter() - t0
    state: ValueState[bytes, bytes] = ValueState(
        client, JOB, OPERATOR, STATE, key_serializer="bytes", value_serializer="bytes"
    )
    _rewrite(state, filler, 1)
    first = _checkpoint(client)
    _rewrite(state, filler, 2)
    second = _checkpoint(client)
    _verify(state, filler, 2)
    client.cancel_job(JOB)
    logger.info("%s: first checkpoint %d B, second %d B", mode, first.incremental_size, second.incremental_size)
    return restore_s, first, second


def run(ctx: BenchContext) -> ScenarioResult:
    chunks = 2 if ctx.quick else 20
    config = {
        "state.checkpoints.dir": (ctx.workdir / "checkpoints").as_uri(),
        "execution.checkpointing.incremental": "true",
        "execution.checkpointing.num-retained": "1",
        "taskmanager.memory.managed.size": "512mb",
    }
    results: dict[str, Any] = {}
    with single_slot_cluster(ctx.workdir / "cluster", config) as cluster:
        client = bench_client(cluster.jobmanager_address)
        try:
            state = submit(client, job_id=JOB)
            filler = StateFiller(ctx.seed, VALUE_BYTES)
            while filler.chunks < chunks:
                state.put_many(filler.keys(filler.chunks), filler.values(filler.chunks))
                filler.chunks += 1
            source = _checkpoint(client)
            client.cancel_job(JOB)
            for mode in ("NO_CLAIM", "CLAIM"):
                results[mode] = _after_restore(client, source.path, mode, filler)
        finally:
            client.close()
    full = source.incremental_size
    measurements = [
        Measurement(
            "state",
            filler.keys_written,
            "keys",
            f"{filler.bytes_written / (1 << 20):.1f} MB of keys and values; checkpoint 1 uploaded {full / KB:,.0f} KB",
        )
    ]
    for mode in ("NO_CLAIM", "CLAIM"):
        restore_s, first, second = results[mode]
        measurements += [
            Measurement(f"{mode}: restore (RestoreJob call)", restore_s, "s"),
            Measurement(
                f"{mode}: 1st checkpoint after the restore",
                first.incremental_size / KB,
                "KB",
                f"{first.incremental_size / KB:,.0f} KB uploaded in {first.duration_ms} ms; full size "
                f"{first.full_size / KB:,.0f} KB",
            ),
            Measurement(
                f"{mode}: 2nd checkpoint after the restore",
                second.incremental_size / KB,
                "KB",
                f"{second.incremental_size / KB:,.0f} KB uploaded in {second.duration_ms} ms",
            ),
        ]
    no_claim_first = results["NO_CLAIM"][1].incremental_size
    claim_first = results["CLAIM"][1].incremental_size
    return ScenarioResult(
        NAME,
        TITLE,
        params={
            "keys": filler.keys_written,
            "key_bytes": KEY_BYTES,
            "value_bytes": VALUE_BYTES,
            "rewritten_per_checkpoint": f"{REWRITE * filler.chunks} keys (1%)",
            "storage": "file://",
            "taskmanager": "1 process, 1 RocksDB slot, incremental checkpoints",
        },
        measurements=measurements,
        ratios=[
            Ratio(
                "CLAIM / NO_CLAIM bytes of the 1st checkpoint after a restore",
                claim_first / no_claim_first,
                0.05,
                "<=",
                "CLAIM references the restored SST files",
            ),
            Ratio(
                "NO_CLAIM 1st checkpoint / checkpoint 1",
                no_claim_first / full,
                0.95,
                ">=",
                "NO_CLAIM uploads the whole state again, so the user may delete checkpoint 1",
            ),
        ],
    )
