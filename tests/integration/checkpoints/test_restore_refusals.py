"""Restores that must be refused, with an error naming the culprit, and leave the cluster clean.

Damaged checkpoints (a flipped byte in an SST or ``.kvs`` file, a deleted or truncated file,
garbage ``_metadata``) are refused with DATA_LOSS (CorruptCheckpointError); checkpoints that do
not fit the job (max parallelism, operators, state kinds) with FAILED_PRECONDITION
(IncompatibleCheckpointError). After each refusal every slot is free again, and once the damage
is repaired the same checkpoint restores exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import grpc
import pytest

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.client import StateClient
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.errors import (
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    InvalidArgumentError,
    KeyedStateError,
    Reason,
)
from tests.integration.checkpoints.conftest import (
    JOB,
    MAX_P,
    STATES,
    CheckpointCluster,
    Workload,
    assert_state_equals,
    key_names,
    operators,
    read_metadata,
)

TOTAL_SLOTS = 8  # two TaskManagers with four slots


def _prepare(cc: CheckpointCluster, incremental: bool) -> tuple[StateClient, Workload, str]:
    """A job with state of every kind, one completed checkpoint, then cancelled."""
    client = cc.client()
    client.submit_job(
        JOB,
        operators(2),
        max_parallelism=MAX_P,
        config={"execution.checkpointing.incremental": str(incremental).lower()},
    )
    work = Workload(client)
    work.write(key_names(800), "a")
    info = client.trigger_checkpoint(JOB, timeout_s=60)
    assert info.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, info.failure_reason
    client.cancel_job(JOB)
    return client, work, info.path


def _refused(
    client: StateClient,
    error: type[KeyedStateError],
    restore_path: str,
    *,
    ops: list[OperatorSpec] | None = None,
    max_parallelism: int = MAX_P,
) -> KeyedStateError:
    """Submit a restore that must fail with ``error``; check that it left no slot taken."""
    with pytest.raises(error) as caught:
        client.submit_job(JOB, ops or operators(2), max_parallelism=max_parallelism, restore_path=restore_path)
    overview = client.cluster()
    assert overview.free_slots == overview.total_slots == TOTAL_SLOTS, "a refused restore left slots taken"
    assert all(j.status != pb.JOB_STATUS_RUNNING for j in overview.jobs if j.job_id == JOB)
    return caught.value


def _grpc_code(error: BaseException) -> grpc.StatusCode | None:
    cause = error.__cause__
    return cast(grpc.Call, cause).code() if isinstance(cause, grpc.RpcError) else None


@pytest.mark.parametrize(
    "storage,backend",
    [
        pytest.param("file", "rocksdb", id="file-rocksdb"),
        pytest.param("file", "hashmap", id="file-hashmap"),
        pytest.param("s3", "rocksdb", id="s3-rocksdb", marks=pytest.mark.s3),
    ],
)
def test_damaged_checkpoint_is_refused_naming_the_file(
    checkpoint_cluster: Callable[..., CheckpointCluster], storage: str, backend: str
) -> None:
    cc = checkpoint_cluster(storage, backend)
    client, work, path = _prepare(cc, incremental=backend == "rocksdb")
    store = cc.storage
    meta = read_metadata(store, path)
    suffix = ".sst" if backend == "rocksdb" else ".kvs"
    victim_ref = max((f for _, _, f in meta.files() if f.path.endswith(suffix)), key=lambda f: f.size)
    victim = f"{path}/{victim_ref.path}".replace(f"{path}/../", f"{cc.job_dir()}/")
    original = store.read_bytes(victim)
    assert len(original) == victim_ref.size > 100

    # One flipped byte, same size: only the sha256 check on the TaskManager can see it.
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x01
    store.write_bytes(victim, bytes(flipped))
    err = _refused(client, CorruptCheckpointError, path)
    assert err.reason is Reason.CORRUPT_CHECKPOINT and _grpc_code(err) is grpc.StatusCode.DATA_LOSS
    assert victim in err.message and "sha256" in err.message

    # Deleted: the JobManager finds it missing before deploying anything.
    store.delete(victim)
    err = _refused(client, CorruptCheckpointError, path)
    assert _grpc_code(err) is grpc.StatusCode.DATA_LOSS
    assert victim in err.message and "missing" in err.message

    # Truncated.
    store.write_bytes(victim, original[:-10])
    err = _refused(client, CorruptCheckpointError, path)
    assert victim in err.message and f"{victim_ref.size - 10} bytes" in err.message
    store.write_bytes(victim, original)

    # Garbage _metadata.
    metadata_path = f"{path}/_metadata"
    good_metadata = store.read_bytes(metadata_path)
    store.write_bytes(metadata_path, b"\x00garbage{")
    err = _refused(client, CorruptCheckpointError, path)
    assert _grpc_code(err) is grpc.StatusCode.DATA_LOSS
    assert metadata_path in err.message and "not valid UTF-8 JSON" in err.message
    # Valid JSON, wrong content.
    store.write_bytes(metadata_path, good_metadata.replace(b'"max_parallelism":128', b'"max_parallelism":"128"'))
    err = _refused(client, CorruptCheckpointError, path)
    assert metadata_path in err.message and "max_parallelism" in err.message
    # No _metadata at all: not a completed checkpoint.
    store.delete(metadata_path)
    err = _refused(client, InvalidArgumentError, path)
    assert "_metadata" in err.message and path in err.message

    # Repaired: the same checkpoint restores exactly.
    store.write_bytes(metadata_path, good_metadata)
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P, restore_path=path)
    assert_state_equals(work.read(), work.reference)


def test_incompatible_restore_is_refused_naming_what_differs(
    checkpoint_cluster: Callable[..., CheckpointCluster],
) -> None:
    cc = checkpoint_cluster("file", "rocksdb")
    client, work, path = _prepare(cc, incremental=False)

    err = _refused(client, IncompatibleCheckpointError, path, max_parallelism=256)
    assert _grpc_code(err) is grpc.StatusCode.FAILED_PRECONDITION
    assert "max parallelism 128" in err.message and "256" in err.message and "fixed" in err.message

    err = _refused(client, IncompatibleCheckpointError, path, ops=operators(2, operator_id="visits"))
    assert "'sessions'" in err.message and "does not have" in err.message

    kinds = tuple(StateDescriptor(s.name, StateKind.VALUE) if s.name == "events" else s for s in STATES)
    err = _refused(client, IncompatibleCheckpointError, path, ops=[OperatorSpec("sessions", 2, kinds)])
    assert "'events'" in err.message and "list" in err.message and "value" in err.message

    fewer = tuple(s for s in STATES if s.name != "attrs")
    err = _refused(client, IncompatibleCheckpointError, path, ops=[OperatorSpec("sessions", 2, fewer)])
    assert "'attrs'" in err.message and "no longer declares" in err.message

    # Nothing was harmed: the checkpoint restores into the job it was taken from.
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P, restore_path=path)
    assert_state_equals(work.read(), work.reference)


def test_restore_from_a_path_that_does_not_exist_is_refused(
    checkpoint_cluster: Callable[..., CheckpointCluster],
) -> None:
    cc = checkpoint_cluster("file", "hashmap", taskmanagers=1, slots=2)
    client = cc.client()
    missing = f"{cc.job_dir()}/chk-7"
    with pytest.raises(InvalidArgumentError) as caught:
        client.submit_job(JOB, operators(2), max_parallelism=MAX_P, restore_path=missing)
    assert missing in caught.value.message and "nothing exists there" in caught.value.message
    assert client.cluster().free_slots == 2
