"""``statectl job restore`` on a running job never leaves it worse off than before.

The JobManager verifies the source in full before it touches the job: a path that does not
exist, a truncated ``_metadata``, a damaged file (same size, other bytes) or a checkpoint that
does not fit the job are refused, and the job keeps running with every write it took since its
last checkpoint. A verified source replaces the job's state in place; if deploying it still
fails, the job comes back as it was (from the checkpoint the restore takes first).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import pytest

from keyedstate.cli import statectl
from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.client import StateClient
from keyedstate.common.errors import IncompatibleCheckpointError, InvalidArgumentError, KeyedStateError
from tests.integration.checkpoints.conftest import (
    JOB,
    MAX_P,
    CheckpointCluster,
    Workload,
    assert_state_equals,
    key_names,
    operators,
    read_metadata,
)


def _running_with_unsaved_writes(cc: CheckpointCluster) -> tuple[StateClient, Workload, str, Any]:
    """A running job with a completed checkpoint, and writes taken after it (in no checkpoint)."""
    client = cc.client()
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P)
    work = Workload(client)
    work.write(key_names(300), "a")
    info = client.trigger_checkpoint(JOB, timeout_s=60)
    assert info.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, info.failure_reason
    checkpointed = work.reference.copy()
    work.write(key_names(300, prefix="late"), "b")  # since the last checkpoint
    return client, work, info.path, checkpointed


def _statectl(cc: CheckpointCluster, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = statectl.main([*argv, "--jobmanager", cc.cluster.address])
    return code, capsys.readouterr().err


def _assert_untouched(client: StateClient, work: Workload, version: int) -> None:
    info = client.job_info(JOB)
    assert info.status == pb.JOB_STATUS_RUNNING and info.routing_version == version, info
    assert_state_equals(work.read(), work.reference)  # the writes since the last checkpoint included


def _damage(cc: CheckpointCluster, path: str, case: str) -> tuple[str, str, list[str]]:
    """Damage the checkpoint at ``path``; the path to restore from, the typed error expected, and what it must name."""
    store = cc.storage
    metadata_path = f"{path}/_metadata"
    if case == "missing path":
        missing = f"{cc.job_dir()}/chk-99"
        return missing, "InvalidArgumentError", [missing, "nothing exists there"]
    if case == "truncated _metadata":
        good_metadata = store.read_bytes(metadata_path)
        store.write_bytes(metadata_path, good_metadata[: len(good_metadata) // 2])
        return path, "CorruptCheckpointError", [metadata_path, "unusable"]
    meta = read_metadata(store, path)
    victim_ref = max((f for _, _, f in meta.files() if f.path.endswith(".sst")), key=lambda f: f.size)
    victim = f"{path}/{victim_ref.path}".replace(f"{path}/../", f"{cc.job_dir()}/")
    if case == "deleted sst":
        store.delete(victim)
        return path, "CorruptCheckpointError", [victim, "missing"]
    assert case == "damaged sst"
    # One flipped byte, same size: only its SHA-256 tells, and the JobManager reads it before touching the job.
    flipped = bytearray(store.read_bytes(victim))
    flipped[len(flipped) // 2] ^= 0x01
    store.write_bytes(victim, bytes(flipped))
    return path, "CorruptCheckpointError", [victim, "sha256", "damaged"]


@pytest.mark.parametrize(
    "storage,case",
    [
        *(
            pytest.param("file", case, id=f"file-{case}")
            for case in ("missing path", "truncated _metadata", "deleted sst", "damaged sst")
        ),
        # On S3 the case that reads every file back (loading _metadata there is covered by test_restore_refusals).
        pytest.param("s3", "damaged sst", id="s3-damaged sst", marks=pytest.mark.s3),
    ],
)
def test_a_refused_restore_leaves_the_running_job_and_its_unsaved_writes_alone(
    checkpoint_cluster: Callable[..., CheckpointCluster],
    capsys: pytest.CaptureFixture[str],
    storage: str,
    case: str,
) -> None:
    cc = checkpoint_cluster(storage, "rocksdb")
    client, work, path, _ = _running_with_unsaved_writes(cc)
    version = client.job_info(JOB).routing_version
    source, error, fragments = _damage(cc, path, case)

    code, err = _statectl(cc, capsys, "job", "restore", JOB, "--from", source)
    assert code == (2 if error == "InvalidArgumentError" else 1), err
    assert all(f in err for f in fragments), err
    _assert_untouched(client, work, version)
    # The same through the client, typed.
    with pytest.raises(KeyedStateError) as info:
        client.restore_job(JOB, source)
    assert type(info.value).__name__ == error and all(f in info.value.message for f in fragments)
    _assert_untouched(client, work, version)


def test_a_restore_that_does_not_fit_the_job_is_refused_and_leaves_it_alone(
    checkpoint_cluster: Callable[..., CheckpointCluster],
    capsys: pytest.CaptureFixture[str],
) -> None:
    cc = checkpoint_cluster("file", "hashmap")
    client, work, path, _ = _running_with_unsaved_writes(cc)
    version = client.job_info(JOB).routing_version
    # Another job's checkpoint, of another max parallelism.
    client.submit_job("other", operators(1), max_parallelism=64)
    other = client.trigger_checkpoint("other", timeout_s=60)
    assert other.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, other.failure_reason
    code, err = _statectl(cc, capsys, "job", "restore", JOB, "--from", other.path)
    assert code == 1 and "max parallelism 64 but the job has 128" in err, err
    _assert_untouched(client, work, version)

    metadata_path = f"{path}/_metadata"
    good = json.loads(cc.storage.read_bytes(metadata_path))
    renamed = json.loads(json.dumps(good))
    renamed["operators"][0]["operator_id"] = "visits"
    rekinded = json.loads(json.dumps(good))
    next(s for s in rekinded["operators"][0]["states"] if s["name"] == "last")["kind"] = "list"
    for edited, fragments in ((renamed, ["'visits'", "does not have"]), (rekinded, ["'last'", "was list state"])):
        cc.storage.write_bytes(metadata_path, json.dumps(edited).encode())
        with pytest.raises(IncompatibleCheckpointError) as info:
            client.restore_job(JOB, path)
        assert all(f in info.value.message for f in fragments), info.value.message
        _assert_untouched(client, work, version)


def test_restoring_an_unknown_job_says_how_to_start_one_from_the_checkpoint(
    checkpoint_cluster: Callable[..., CheckpointCluster],
    capsys: pytest.CaptureFixture[str],
) -> None:
    cc = checkpoint_cluster("file", "hashmap", taskmanagers=1, slots=2)
    path = f"{cc.job_dir()}/chk-1"
    code, err = _statectl(cc, capsys, "job", "restore", "ghost", "--from", path)
    assert code == 1 and "unknown to the JobManager" in err and "execution.state-recovery.path" in err, err


@pytest.mark.parametrize("storage", ["file", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_verified_restore_replaces_the_running_jobs_state(
    checkpoint_cluster: Callable[..., CheckpointCluster],
    capsys: pytest.CaptureFixture[str],
    storage: str,
) -> None:
    cc = checkpoint_cluster(storage, "rocksdb")
    client, work, path, checkpointed = _running_with_unsaved_writes(cc)
    # CLAIM: the job takes its own checkpoint back, so it is the job's latest again (NO_CLAIM would leave it out).
    code, err = _statectl(cc, capsys, "job", "restore", JOB, "--from", path, "--claim-mode", "CLAIM")
    assert code == 0, err
    info = client.job_info(JOB)
    assert info.status == pb.JOB_STATUS_RUNNING and info.latest_checkpoint_path == path, info
    work.reference = checkpointed
    assert_state_equals(work.read(), checkpointed)

    # The job goes on from the restored state, and its checkpoints build on it.
    work.write(key_names(50, prefix="after"), "c")
    again = client.trigger_checkpoint(JOB, timeout_s=60)
    assert again.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, again.failure_reason
    assert_state_equals(work.read(), work.reference)


@pytest.mark.parametrize("backend,suffix", [("rocksdb", ".sst"), ("hashmap", ".kvs")])
def test_a_restore_whose_deploy_fails_brings_the_job_back_as_it_was(
    checkpoint_cluster: Callable[..., CheckpointCluster],
    capsys: pytest.CaptureFixture[str],
    backend: str,
    suffix: str,
) -> None:
    cc = checkpoint_cluster("file", backend)
    client, work, path, _ = _running_with_unsaved_writes(cc)
    # A checkpoint that verifies (its _metadata records the file's new size and SHA-256) but cannot be
    # deployed: the file holds garbage.
    store = cc.storage
    metadata_path = f"{path}/_metadata"
    data = json.loads(store.read_bytes(metadata_path))
    entry = max(
        (f for op in data["operators"] for sub in op["subtasks"] for f in sub["files"] if f["path"].endswith(suffix)),
        key=lambda f: f["size"],
    )
    victim = f"{path}/{entry['path']}".replace(f"{path}/../", f"{cc.job_dir()}/")
    garbage = b"not a state file " * (entry["size"] // 17 + 1)
    store.write_bytes(victim, garbage)
    entry["size"], entry["sha256"] = len(garbage), hashlib.sha256(garbage).hexdigest()
    store.write_bytes(metadata_path, json.dumps(data, separators=(",", ":")).encode())
    before = client.job_info(JOB)

    code, message = _statectl(cc, capsys, "job", "restore", JOB, "--from", path)
    assert code == 1, message
    assert f"restoring job {JOB!r} from {path} failed" in message, message
    assert "runs again as it was before the restore" in message, message
    after = client.job_info(JOB)
    assert after.status == pb.JOB_STATUS_RUNNING and after.routing_version > before.routing_version, after
    assert after.latest_checkpoint_id > before.latest_checkpoint_id  # the checkpoint the restore took first
    assert_state_equals(work.read(), work.reference)  # the writes since the last checkpoint included


def test_restoring_a_cancelled_job_resubmits_it_with_its_own_definition(
    checkpoint_cluster: Callable[..., CheckpointCluster],
    capsys: pytest.CaptureFixture[str],
) -> None:
    cc = checkpoint_cluster("file", "hashmap", taskmanagers=1, slots=2)
    client = cc.client()
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P, config={"execution.checkpointing.num-retained": "2"})
    work = Workload(client)
    work.write(key_names(100), "a")
    info = client.trigger_checkpoint(JOB, timeout_s=60)
    assert info.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, info.failure_reason
    client.cancel_job(JOB)
    with pytest.raises(InvalidArgumentError, match="nothing exists there"):
        client.restore_job(JOB, f"{cc.job_dir()}/chk-99")
    assert client.job_info(JOB).status == pb.JOB_STATUS_CANCELED
    code, err = _statectl(cc, capsys, "job", "restore", JOB, "--from", info.path)
    assert code == 0, err
    assert client.job_info(JOB).status == pb.JOB_STATUS_RUNNING
    job = cc.cluster.jobmanager.dispatcher.job(JOB)
    assert dict(job.spec.config) == {"execution.checkpointing.num-retained": "2"}  # its config came along
    assert_state_equals(work.read(), work.reference)
