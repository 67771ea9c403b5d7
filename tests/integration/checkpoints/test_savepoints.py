"""Savepoints: self-contained, relocatable, owned by the user.

``statectl savepoint`` writes every file under the savepoint directory, even for a job with
incremental checkpoints. The directory is copied elsewhere (another bucket on S3), the job's
checkpoint directory and the original savepoint are deleted, and the copy restores exactly.
Checkpoint retention never touches a savepoint.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from keyedstate.cli.statectl import main as statectl
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.config import Configuration
from keyedstate.common.storage import FsspecStorage, open_storage
from tests.fixtures.s3 import boto3_client
from tests.integration.checkpoints.conftest import (
    JOB,
    MAX_P,
    CheckpointCluster,
    Workload,
    assert_state_equals,
    key_names,
    operators,
    read_metadata,
    relative_files,
)

CONFIG = {"execution.checkpointing.incremental": "true", "execution.checkpointing.num-retained": "1"}


def _checkpoint(client: Any) -> Any:
    info = client.trigger_checkpoint(JOB, timeout_s=60)
    assert info.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, info.failure_reason
    return info


def _copy_tree(cc: CheckpointCluster, source: str, target: str) -> None:
    """Copy a directory as an operator would: shutil on a file system, object by object on S3."""
    if source.startswith("file://"):
        shutil.copytree(source.removeprefix("file://"), target.removeprefix("file://"))
        return
    fs = cast(
        FsspecStorage, cc.storage
    ).fs  # the s3fs file system: copy through fsspec, as `aws s3 cp --recursive` would
    for path in fs.find(source.removeprefix("s3://")):
        fs.copy(path, target.removeprefix("s3://") + path[len(source.removeprefix("s3://")) :])


@pytest.mark.parametrize("storage", ["file", pytest.param("s3", marks=pytest.mark.s3)])
def test_savepoint_copied_elsewhere_restores_after_the_checkpoints_are_gone(
    checkpoint_cluster: Callable[..., CheckpointCluster],
    storage: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> None:
    cc = checkpoint_cluster(storage, "rocksdb")
    if storage == "s3":
        endpoint = cc.config["s3.endpoint"]
        bucket = cc.checkpoints_dir.split("/")[2]
        other = f"{bucket}-copy"
        s3 = boto3_client(endpoint)
        s3.create_bucket(Bucket=other)
        request.addfinalizer(
            lambda: (cc.storage.delete_dir(f"s3://{other}/restored-from"), s3.delete_bucket(Bucket=other))  # type: ignore[func-returns-value]  # a tuple runs both cleanups in one lambda
        )
        savepoints_dir, copy_dir = f"s3://{bucket}/savepoints", f"s3://{other}/restored-from"
    else:
        savepoints_dir, copy_dir = (tmp_path / "savepoints").as_uri(), (tmp_path / "elsewhere" / "sp").as_uri()
    client = cc.client()
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P, config=CONFIG)
    work = Workload(client)
    work.write(key_names(800), "a")
    _checkpoint(client)  # incremental: shared/ files exist that a savepoint must not reference
    work.write(key_names(800)[::3] + key_names(200, "b"), "b")
    at_savepoint = work.reference.copy()

    args = ["savepoint", JOB, "--dir", savepoints_dir, "--jobmanager", cc.cluster.address]
    assert statectl(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("savepoint 2 completed")
    savepoint = out.rsplit(": ", 1)[1].strip()
    assert savepoint == f"{savepoints_dir}/savepoint-{JOB[:8]}-2"

    meta = read_metadata(cc.storage, savepoint)
    assert meta.savepoint and meta.checkpoint_id == 2
    assert all(not f.shared and not f.path.startswith("..") for _, _, f in meta.files()), "self-contained"
    files = relative_files(cc.storage, savepoint)
    assert files == {"_metadata"} | {f.path for _, _, f in meta.files()}

    # Later checkpoints with num-retained 1 subsume each other, never the savepoint.
    work.write(key_names(100, "c"), "c")
    _checkpoint(client)
    assert statectl(["checkpoint", "trigger", JOB, "--jobmanager", cc.cluster.address]) == 0
    out = capsys.readouterr().out
    assert out.startswith("checkpoint 4 completed in ") and out.strip().endswith(f"{cc.job_dir()}/chk-4")
    cc.flush_deletions()
    assert statectl(["checkpoint", "list", JOB, "--json", "--jobmanager", cc.cluster.address]) == 0
    listed = {int(c["checkpoint_id"]): c for c in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert listed[2]["savepoint"] and listed[2]["status"] == "COMPLETED" and listed[2]["path"] == savepoint
    assert [listed[n]["status"] for n in (1, 3, 4)] == ["COMPLETED"] * 3
    assert relative_files(cc.storage, savepoint) == files
    assert {p.split("/")[0] for p in relative_files(cc.storage, cc.job_dir())} == {"chk-4", "shared"}

    # Relocate: copy, then delete the original savepoint and every checkpoint of the job.
    client.cancel_job(JOB)
    _copy_tree(cc, savepoint, copy_dir)
    cc.storage.delete_dir(savepoint)
    cc.storage.delete_dir(cc.job_dir())
    assert not relative_files(cc.storage, cc.job_dir()) and not relative_files(cc.storage, savepoint)

    assert statectl(["job", "restore", JOB, "--from", copy_dir, "--jobmanager", cc.cluster.address]) == 0
    assert capsys.readouterr().out.startswith(f"job {JOB} restored from {copy_dir}")
    assert_state_equals(work.read(), at_savepoint)
    # The restored job checkpoints on (ids after the savepoint's); the copy is not claimed.
    work.reference = at_savepoint
    work.write(key_names(50, "d"), "d")
    assert _checkpoint(client).checkpoint_id == 3
    _checkpoint(client)
    cc.flush_deletions()
    assert relative_files(cc.storage, copy_dir) == files


def test_savepoint_without_a_directory_is_refused(
    checkpoint_cluster: Callable[..., CheckpointCluster], capsys: pytest.CaptureFixture[str]
) -> None:
    cc = checkpoint_cluster("file", "hashmap", taskmanagers=1, slots=2)
    client = cc.client()
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P)
    assert statectl(["savepoint", JOB, "--jobmanager", cc.cluster.address]) == 2
    assert "state.savepoints.dir" in capsys.readouterr().err
    assert not relative_files(open_storage(cc.checkpoints_dir, Configuration()), cc.checkpoints_dir)
