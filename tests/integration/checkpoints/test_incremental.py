"""Incremental RocksDB checkpoints upload only what changed: 1M keys, then 1% of them rewritten.

Why the second checkpoint is small, for real: a RocksDB native checkpoint flushes the memtable
and hard-links the live SST files. Checkpoint 1 therefore turns all 1M keys into SST files
(uploaded to ``shared/``); the 1% rewritten afterwards sit in the memtable until checkpoint 2
flushes them into one new small SST per subtask, the only SST it uploads. The old files are
reused only if nothing rewrote them in between: a background flush or compaction would. The
TaskManagers here get memtables large enough (256 MB, within a 1 GB budget) that nothing
flushes before the checkpoints do, so no compaction can run between the two checkpoints.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.client import ValueState
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.ids import JobId
from tests.integration.checkpoints.conftest import (
    CheckpointCluster,
    read_metadata,
    referenced_files,
    relative_files,
)

JOB = JobId("clicks")
N_KEYS = 1_000_000
BATCH = 100_000
TM = {"state.backend.rocksdb.writebuffer.size": "256mb", "taskmanager.memory.managed.size": "1gb"}


def test_second_checkpoint_uploads_only_the_changed_one_percent(
    checkpoint_cluster: Callable[..., CheckpointCluster],
) -> None:
    cc = checkpoint_cluster(
        "file", "rocksdb", taskmanagers=1, slots=2, tm=TM, jm={"execution.checkpointing.incremental": True}
    )
    client = cc.client()
    ops = [OperatorSpec("clicks", 2, (StateDescriptor("v", StateKind.VALUE),))]
    client.submit_job(JOB, ops, max_parallelism=128)
    state = ValueState[bytes, bytes](client, JOB, "clicks", "v", key_serializer="bytes", value_serializer="bytes")
    rnd = random.Random(42)
    keys = [rnd.randbytes(16) for _ in range(N_KEYS)]
    blob = rnd.randbytes(100 * N_KEYS)
    values = [blob[i * 100 : (i + 1) * 100] for i in range(N_KEYS)]
    for start in range(0, N_KEYS, BATCH):
        state.put_many(keys[start : start + BATCH], values[start : start + BATCH])

    first = client.trigger_checkpoint(JOB, timeout_s=120)
    assert first.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, first.failure_reason
    # 1M x (16 B key + 100 B random value) is about 116 MB of incompressible data.
    assert first.incremental_size == first.full_size > 100 * N_KEYS
    assert first.duration_ms > 0, "flushing and uploading ~116 MB takes measurable time"
    meta1 = read_metadata(cc.storage, first.path)  # read now: checkpoint 2 subsumes it

    changed = list(range(0, N_KEYS, 100))
    for i in changed:
        values[i] = rnd.randbytes(100)
    state.put_many([keys[i] for i in changed], [values[i] for i in changed])
    second = client.trigger_checkpoint(JOB, timeout_s=120)
    assert second.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, second.failure_reason

    assert second.full_size > first.full_size, "checkpoint 2 references all the data plus the new SSTs"
    assert second.incremental_size < 0.10 * first.incremental_size, (
        f"checkpoint 2 uploaded {second.incremental_size} B, checkpoint 1 {first.incremental_size} B"
    )
    # The big SST files of checkpoint 1 are referenced again, under the same shared/ paths.
    meta2 = read_metadata(cc.storage, second.path)
    shared1 = {f.path: f for _, _, f in meta1.files() if f.shared}
    shared2 = {f.path: f for _, _, f in meta2.files() if f.shared}
    reused = set(shared1) & set(shared2)
    assert sum(shared1[p].size for p in reused) > 0.95 * first.full_size
    new = set(shared2) - reused
    assert new and sum(shared2[p].size for p in new) < 0.02 * first.full_size
    # The subsumed checkpoint 1 is gone; checkpoint 2 and every file it references remain.
    cc.flush_deletions(JOB)
    assert relative_files(cc.storage, cc.job_dir(JOB)) == {"chk-2/_metadata"} | referenced_files(meta2, "chk-2")

    # Restoring from checkpoint 2 gives back all 1M keys with their latest values.
    client.cancel_job(JOB)
    client.submit_job(JOB, ops, max_parallelism=128, restore_path=second.path)
    for start in range(0, N_KEYS, BATCH):
        got = state.get_many(keys[start : start + BATCH])
        assert got == values[start : start + BATCH], f"keys {start}..{start + BATCH} differ after the restore"
