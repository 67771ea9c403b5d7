"""End to end on S3 (a real moto server): finalize, retention and abort through the S3 storage."""

from __future__ import annotations

from typing import Any

import pytest

from keyedstate.common.storage import open_storage
from keyedstate.jobmanager.checkpoint import CheckpointException, load_checkpoint, verify_files_exist
from tests.fixtures.s3 import boto3_client, s3_bucket, s3_config, s3_endpoint, s3_server  # noqa: F401 (fixtures)

pytestmark = pytest.mark.s3


def test_checkpoints_on_s3(make_harness: Any, s3_bucket: tuple[str, str], s3_config: Any) -> None:  # noqa: F811
    endpoint, bucket = s3_bucket
    storage = open_storage(f"s3://{bucket}/ckpt", s3_config)
    job_dir = f"s3://{bucket}/ckpt/job-1"
    h = make_harness(storage_override=storage, job_dir_override=job_dir, num_retained=1)

    for _ in range(2):
        h.coordinator.trigger()
    latest = h.coordinator.wait_for(2, timeout=0)
    assert latest.external_path == f"{job_dir}/chk-2"
    meta = load_checkpoint(storage, latest.external_path)
    assert meta == latest.metadata
    verify_files_exist(storage, meta, latest.external_path)

    h.cluster.mode = "decline"
    with pytest.raises(CheckpointException):
        h.coordinator.trigger()
        h.coordinator.wait_for(3, timeout=0)

    keys = set()
    for page in boto3_client(endpoint).get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys |= {o["Key"] for o in page.get("Contents", [])}
    expected = {"ckpt/job-1/chk-2/_metadata"}
    for _, _, f in meta.files():
        expected.add(("ckpt/job-1/" + f.path[3:]) if f.path.startswith("../") else f"ckpt/job-1/chk-2/{f.path}")
    assert keys == expected, "chk-1 (subsumed) and chk-3 (aborted) left nothing behind"
