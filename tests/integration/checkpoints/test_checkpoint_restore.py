"""Checkpoint, cancel, restore, through the whole system, on file:// and S3, for both backends.

The reference dict is the oracle: after every restore each state holds exactly what it held when
the checkpoint was taken (writes made after the checkpoint are gone, cleared keys stay gone),
also when the restore changes the parallelism (2 -> 2, 2 -> 1, 2 -> 3, then 3 -> 1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.client import ValueState
from tests.integration.checkpoints.conftest import (
    JOB,
    MAX_P,
    CheckpointCluster,
    Workload,
    assert_state_equals,
    key_names,
    operators,
    read_metadata,
    referenced_files,
    relative_files,
)

N_KEYS = 1500

CASES = [
    pytest.param("file", "rocksdb", True, id="file-rocksdb-incremental"),
    pytest.param("file", "rocksdb", False, id="file-rocksdb-full"),
    pytest.param("file", "hashmap", False, id="file-hashmap"),
    pytest.param("s3", "rocksdb", True, id="s3-rocksdb-incremental", marks=pytest.mark.s3),
    pytest.param("s3", "hashmap", False, id="s3-hashmap", marks=pytest.mark.s3),
]


def _checkpoint(client: Any, job_id: str = JOB) -> Any:
    info = client.trigger_checkpoint(job_id, timeout_s=60)
    assert info.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, info.failure_reason
    return info


@pytest.mark.parametrize("storage,backend,incremental", CASES)
def test_checkpoint_then_restore_at_parallelism_2_3_and_1(
    checkpoint_cluster: Callable[..., CheckpointCluster], storage: str, backend: str, incremental: bool
) -> None:
    cc = checkpoint_cluster(storage, backend)
    client = cc.client()
    config = {"execution.checkpointing.incremental": str(incremental).lower()}
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P, config=config)
    work = Workload(client)
    keys = key_names(N_KEYS)
    work.write(keys, "a")
    work.write(keys[::2], "b")
    at_checkpoint = work.reference.copy()

    info = _checkpoint(client)
    job_dir = cc.job_dir()
    assert info.path == f"{job_dir}/chk-{info.checkpoint_id}"
    meta = read_metadata(cc.storage, info.path)
    assert (meta.job_id, meta.checkpoint_id, meta.max_parallelism) == (JOB, info.checkpoint_id, MAX_P)
    assert [(op.operator_id, op.parallelism) for op in meta.operators] == [("sessions", 2)]
    assert {s.backend for op in meta.operators for s in op.subtasks} == {backend}
    assert info.full_size == meta.full_size > 0
    # Storage holds exactly _metadata and the files it references: nothing stray, nothing missing.
    chk = f"chk-{info.checkpoint_id}"
    assert relative_files(cc.storage, job_dir) == {f"{chk}/_metadata"} | referenced_files(meta, chk)
    shared = [f for _, _, f in meta.files() if f.shared]
    if incremental:
        assert shared and all(f.path.startswith("../shared/") and f.path.endswith(".sst") for f in shared)
        assert info.incremental_size == info.full_size, "a first incremental checkpoint uploads everything"
    else:
        assert not shared and not any(p.startswith("shared/") for p in relative_files(cc.storage, job_dir))
    if backend == "hashmap":
        assert any(f.path.endswith(".kvs") for _, _, f in meta.files())

    # Writes after the checkpoint must not survive the restore.
    work.write(keys[:300] + key_names(200, "late"), "after")
    client.cancel_job(JOB)

    # Same parallelism, then scale in to 1.
    for parallelism in (2, 1):
        client.submit_job(JOB, operators(parallelism), max_parallelism=MAX_P, restore_path=info.path, config=config)
        assert client.routing(JOB).operator("sessions").parallelism == parallelism
        assert_state_equals(work.read(), at_checkpoint)
        client.cancel_job(JOB)

    # Scale out to 3 from the same checkpoint, change state, checkpoint again at 3.
    client.submit_job(JOB, operators(3), max_parallelism=MAX_P, restore_path=info.path, config=config)
    assert client.routing(JOB).operator("sessions").parallelism == 3
    assert_state_equals(work.read(), at_checkpoint)
    work.reference = at_checkpoint.copy()
    work.write(keys[1000:] + key_names(100, "new"), "c")
    at_second = work.reference.copy()
    second = _checkpoint(client)
    assert second.checkpoint_id > info.checkpoint_id, "checkpoint ids continue after the restored one"
    assert [op.parallelism for op in read_metadata(cc.storage, second.path).operators] == [3]
    client.cancel_job(JOB)

    # Scale in to 1 from the checkpoint taken at parallelism 3.
    client.submit_job(JOB, operators(1), max_parallelism=MAX_P, restore_path=second.path, config=config)
    assert_state_equals(work.read(), at_second)
    # The restored job keeps working: writes land and a further checkpoint completes.
    ValueState[str, int](client, JOB, "sessions", "last", value_serializer="int").put("after-restore", 7)
    assert _checkpoint(client).checkpoint_id > second.checkpoint_id
