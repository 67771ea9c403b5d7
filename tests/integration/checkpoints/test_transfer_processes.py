"""Checkpoint transfers in the TaskManager's low-priority transfer processes, against real daemons.

* The transfer process is SIGKILLed in the middle of a checkpoint's upload to S3 (moto behind a
  gated TCP proxy, so the upload is really in flight): the checkpoint is declined with the cause,
  no ``_metadata`` and no file of it remains, the next checkpoint (on a new transfer process)
  completes and restores to exactly the reference state.
* A TaskManager process SIGKILLed leaves no transfer process behind; the checkpoint transfer
  process of a running TaskManager runs at the configured niceness, the TaskManager and its
  restore transfer process at normal priority.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import psutil
import pytest

from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.config import Configuration
from keyedstate.common.minicluster import MiniCluster
from keyedstate.common.storage import open_storage
from keyedstate.taskmanager.snapshot.transfer_process import TransferProcessPool
from tests.fixtures.cluster import PATIENT
from tests.integration.checkpoints.conftest import (
    JOB,
    MAX_P,
    GatedProxy,
    Workload,
    assert_state_equals,
    key_names,
    operators,
    relative_files,
    s3_keys,
    wait_until,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transfer processes: Linux behaviour")

TOLERANT = {"execution.checkpointing.tolerable-failed-checkpoints": "10"}


def _running(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _transfer_children(pid: int) -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(pid).children()
        if "keyedstate.taskmanager.snapshot.transfer_worker" in " ".join(p.cmdline())
    ]


@pytest.mark.s3
def test_a_transfer_process_killed_mid_upload_declines_the_checkpoint_and_the_next_one_completes(
    gated_s3: tuple[GatedProxy, str, str], inprocess_cluster: Callable[..., Any]
) -> None:
    proxy, endpoint, bucket = gated_s3
    checkpoints_dir = f"s3://{bucket}/checkpoints"
    cluster = inprocess_cluster(
        taskmanagers=1,
        slots=2,
        jm={"state.checkpoints.dir": checkpoints_dir, **s3_keys(endpoint), **PATIENT},
        tm=s3_keys(f"http://127.0.0.1:{proxy.port}"),
    )
    tm = cluster.taskmanagers[0]
    transfers = tm.transfers
    assert isinstance(transfers, TransferProcessPool)
    (worker,) = transfers.pids()
    storage = open_storage(checkpoints_dir, Configuration(s3_keys(endpoint)))
    client = cluster.client(timeout_s=30.0)
    client.submit_job(
        JOB, operators(2), max_parallelism=MAX_P, config={"execution.checkpointing.incremental": "true", **TOLERANT}
    )
    work = Workload(client)
    work.write(key_names(800), "a")
    job_dir = f"{checkpoints_dir}/{JOB}"
    try:
        proxy.gate.clear()
        started = client.trigger_checkpoint(JOB, wait=False)
        assert started.checkpoint_id == 1
        # Mid-upload for real: the transfer process has connections open to the (closed) proxy.
        wait_until(
            lambda: any(c.raddr and c.raddr.port == proxy.port for c in psutil.Process(worker).net_connections()),
            "the transfer process to start uploading",
        )
        os.kill(worker, signal.SIGKILL)

        def failed() -> Any:
            (info,) = [c for c in client.list_checkpoints(JOB).checkpoints if c.checkpoint_id == 1]
            return info if info.status == jm_pb.CHECKPOINT_STATUS_FAILED else None

        wait_until(lambda: failed() is not None, "checkpoint 1 to be declined", timeout_s=30)
        reason = failed().failure_reason
        assert reason.startswith("CHECKPOINT_DECLINED"), reason
        assert f"transfer process (pid {worker}) was killed by SIGKILL" in reason, reason
    finally:
        proxy.gate.set()
    coordinator = cluster.jobmanager.dispatcher.job(JOB).coordinator

    def leftovers() -> list[str]:
        coordinator.cleaner.flush(timeout=30)
        return [f for f in relative_files(storage, job_dir) if f.startswith(("chk-1/", "shared/chk-1/"))]

    wait_until(
        lambda: not leftovers(), "the files of declined checkpoint 1 to be deleted", timeout_s=30, state=leftovers
    )
    assert not storage.exists(f"{job_dir}/chk-1/_metadata"), "a declined checkpoint must never have _metadata"

    second = client.trigger_checkpoint(JOB, timeout_s=60)
    assert second.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, second.failure_reason
    (replacement,) = transfers.pids()
    assert replacement != worker and not _running(worker)
    assert not leftovers()
    expected = work.reference.copy()
    client.cancel_job(JOB)
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P, restore_path=second.path)
    assert_state_equals(work.read(), expected)


def test_a_killed_taskmanager_leaves_no_transfer_process_and_transfers_run_niced(
    process_cluster: Callable[..., MiniCluster],
) -> None:
    cluster = process_cluster(taskmanagers=1, slots=1)
    daemon = cluster.taskmanagers[0]
    assert daemon.process is not None
    tm_pid = daemon.process.pid
    wait_until(lambda: len(_transfer_children(tm_pid)) == 2, "the TaskManager's transfer processes", timeout_s=30)
    workers = {p.cmdline()[-1]: p for p in _transfer_children(tm_pid)}
    assert set(workers) == {"checkpoint", "restore"}, workers
    assert psutil.Process(tm_pid).nice() == 0
    checkpoint_threads = workers["checkpoint"].threads()
    assert all(os.getpriority(os.PRIO_PROCESS, t.id) >= 10 for t in checkpoint_threads), "default niceness is 10"
    # Restores are on the recovery's critical path: their process keeps the TaskManager's priority.
    assert all(os.getpriority(os.PRIO_PROCESS, t.id) == 0 for t in workers["restore"].threads())

    daemon.kill()
    for role, worker in workers.items():
        wait_until(
            functools.partial(lambda pid: not _running(pid), worker.pid),
            f"the {role} transfer process to exit after its TaskManager died",
        )
