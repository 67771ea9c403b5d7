"""A TaskManager dies (SIGKILL) while it uploads its part of a checkpoint.

The checkpoint must never count as completed, and nothing it wrote may survive: the files of
the TaskManagers that did acknowledge, and the shared SST files the dead one uploaded without
ever acknowledging them (orphaned shared files are a known Flink pain). Shared files are grouped
as ``shared/chk-<n>/``, and the JobManager deletes that group when it aborts checkpoint ``n``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable

import pytest

from keyedstate.common._proto.v1 import common_pb2 as pb
from tests.integration.failover._support import (
    BackgroundWriter,
    EpochWriter,
    assert_no_orphans,
    assert_state_equals,
    key_names,
    operators,
    record_figure,
    relative_files,
    wait_for_job,
    wait_until,
)
from tests.integration.failover.conftest import FailoverCluster

pytestmark = pytest.mark.s3

_UPLOAD_STARTED = r"checkpoint (\d+) of (\S+): async upload of (\d+) files \((\d+) bytes\) started"


def test_kill_of_a_taskmanager_during_a_checkpoint_upload_leaves_no_orphans(
    failover_cluster: Callable[..., FailoverCluster],
) -> None:
    cluster = failover_cluster(taskmanagers=3, slots=2)
    job = "kill-upload"
    client = cluster.client()
    client.submit_job(job, operators(4))
    job_dir = cluster.job_dir(job)
    # Epoch 2 writes 16 KiB of incompressible bytes per key: about 13 MB of SST files.
    writer = EpochWriter(cluster.client(), job, key_names(1200), blob_bytes=16 << 10, blob_epochs=frozenset({2}))
    writer.run(1)
    before = client.job_info(job)

    placement = cluster.placement(client, job)
    victim = placement[0]
    owners = tuple(f"counts-{s}-" for s, tm in placement.items() if tm == victim)
    # The victim's uploads crawl (per connection), so the kill lands in the middle of them.
    cluster.proxies[victim].upload_rate = 128 << 10
    log_offset = cluster.log_size(victim)
    background = BackgroundWriter(writer, through=3)

    started = cluster.wait_for_log(victim, _UPLOAD_STARTED, log_offset, timeout_s=60)
    checkpoint_id = int(started.group(1))
    assert checkpoint_id == before.latest_checkpoint_id + 1
    group = f"shared/chk-{checkpoint_id}/"

    def victim_uploads() -> set[str]:
        return {
            p
            for p in relative_files(cluster.storage, job_dir)
            if p.startswith(group) and p[len(group) :].startswith(owners)
        }

    wait_until(
        lambda: bool(victim_uploads()),
        f"tm-{victim} to upload a first shared file of checkpoint {checkpoint_id}",
        timeout_s=30,
    )
    killed_at = cluster.kill_taskmanager(victim)
    # What the dead process had sent reaches the server at once, not trickling in after the abort.
    cluster.proxies[victim].upload_rate = None
    orphans_at_kill = victim_uploads()
    assert not cluster.storage.exists(f"{job_dir}/chk-{checkpoint_id}/_metadata"), "the upload was still running"

    info = wait_for_job(client, job, {"RUNNING"}, min_restarts=1, timeout_s=60)
    running_at = time.monotonic()
    background.join()
    assert f"TaskManager tm-{victim} lost" in info.failure_cause

    # The checkpoint failed and never completed; the job restored the one before it.
    listing = cluster.statectl("checkpoint", "list", job, "--json")
    assert listing.returncode == 0, listing.stderr
    history = {int(c["checkpoint_id"]): c for c in json.loads(listing.stdout)["checkpoints"]}
    failed = history[checkpoint_id]
    assert failed["status"] == "FAILED" and "TASK_FAILURE" in failed["failure_reason"], failed
    for i in range(3):
        if i != victim:
            restored = re.findall(r"restored \S+ from checkpoint (\d+)", cluster.log_since(i, 0))
            assert restored and int(restored[0]) == before.latest_checkpoint_id, (i, restored)

    # Nothing of it is left, the dead TaskManager's unacknowledged shared files included.
    final = client.job_info(job)
    assert (final.status, final.committed_epoch) == (pb.JOB_STATUS_RUNNING, 3)
    assert_state_equals(writer.read(), writer.expected(3))
    assert_no_orphans(cluster.storage, job_dir, [final.latest_checkpoint_path])
    assert not orphans_at_kill & relative_files(cluster.storage, job_dir)

    first = writer.first_success_after(killed_at)
    assert first is not None
    record_figure("TaskManager kill during checkpoint upload -> job RUNNING again", running_at - killed_at)
    record_figure("TaskManager kill during checkpoint upload -> first committed epoch", first.finished - killed_at)
    print(
        f"killed tm-{victim} during the upload of checkpoint {checkpoint_id} ({started.group(3)} files, "
        f"{started.group(4)} bytes in its first slot); {len(orphans_at_kill)} of its shared files were in storage"
    )
