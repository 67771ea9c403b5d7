"""Restore claim modes with real JobManager and TaskManager processes (RocksDB, incremental checkpoints).

A job writes 20,000 keys of 400 random bytes (about 8 MB), takes checkpoint 1 and is cancelled;
it is then restored from checkpoint 1 in each of Flink's claim modes, and the test reads the
bytes the checkpoints after the restore uploaded and which files survive:

* CLAIM: the first checkpoint references checkpoint 1's SST files (it uploads kilobytes), and
  checkpoint 1 is deleted once subsumed, apart from the files a retained checkpoint still uses.
* NO_CLAIM: the first checkpoint uploads the whole state again and references nothing of
  checkpoint 1, whose files all stay, even when the job's own checkpoints subsume it and a new
  JobManager sweeps the job directory.
* A savepoint restored under CLAIM is the job's: its first checkpoint uploads the state (a savepoint
  has no shared/ files to reference), and the savepoint is deleted once subsumed; under NO_CLAIM it stays.
* After a TaskManager is killed or the JobManager replaced, the job recovers its own (or claimed)
  checkpoint and the next checkpoint is incremental again, in either mode.

The TaskManagers get memtables large enough that nothing flushes or compacts between checkpoints,
so "referenced instead of uploaded" is decided by ownership alone.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.client import ClientSettings, StateClient, ValueState
from keyedstate.common.config import Configuration
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.minicluster import MiniCluster
from keyedstate.common.storage import CheckpointStorage, open_storage
from tests.integration.checkpoints.conftest import read_metadata, referenced_files, relative_files, wait_until

JOB = "claims"
OPS = [OperatorSpec("agg", 2, (StateDescriptor("v", StateKind.VALUE),))]
N_KEYS = 20_000
VALUE_BYTES = 400


class Run:
    """A process cluster with HA (so a JobManager can be killed and replaced) and the job's data."""

    def __init__(self, process_cluster: Callable[..., MiniCluster], tmp_path: Path) -> None:
        self.cluster = process_cluster(
            taskmanagers=1,
            slots=2,
            config={
                "execution.checkpointing.incremental": "true",
                "execution.checkpointing.num-retained": "1",
                "high-availability.type": "filesystem",
                "high-availability.storageDir": (tmp_path / "ha").as_uri(),
                "high-availability.filesystem.lease-check-interval": "1 s",
                "state.backend.rocksdb.writebuffer.size": "64mb",
                "taskmanager.memory.managed.size": "512mb",
            },
        )
        self.job_dir = f"{self.cluster.config['state.checkpoints.dir']}/{JOB}"
        self.storage: CheckpointStorage = open_storage(self.job_dir, Configuration())
        rnd = random.Random(5)
        self.keys = [f"user-{i:06d}".encode() for i in range(N_KEYS)]
        self.values = [rnd.randbytes(VALUE_BYTES) for _ in range(N_KEYS)]
        self.rnd = rnd
        self.client = self.connect()

    def connect(self) -> StateClient:
        return StateClient(self.cluster.jobmanager_address, ClientSettings(timeout_s=30, max_attempts=8, backoff_s=0.2))

    def state(self) -> ValueState[bytes, bytes]:
        return ValueState(self.client, JOB, "agg", "v", key_serializer="bytes", value_serializer="bytes")

    def write(self, indexes: range | list[int]) -> None:
        for i in indexes:
            self.values[i] = self.rnd.randbytes(VALUE_BYTES)
        chosen = list(indexes)
        for start in range(0, len(chosen), 5_000):
            part = chosen[start : start + 5_000]
            self.state().put_many([self.keys[i] for i in part], [self.values[i] for i in part])

    def checkpoint(self) -> jm_pb.CheckpointInfo:
        info = self.client.trigger_checkpoint(JOB, timeout_s=120)
        assert info.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, info.failure_reason
        return info

    def assert_state(self) -> None:
        for start in range(0, N_KEYS, 5_000):
            got = self.state().get_many(self.keys[start : start + 5_000])
            assert got == self.values[start : start + 5_000], f"keys {start}.. differ"

    def files(self) -> set[str]:
        return relative_files(self.storage, self.job_dir)

    def source(self) -> tuple[jm_pb.CheckpointInfo, set[str], set[str]]:
        """Checkpoint 1 of a cancelled run: its info, its files and its shared files (relative to the job dir)."""
        self.client.submit_job(JOB, OPS, max_parallelism=128)
        self.write(range(N_KEYS))
        first = self.checkpoint()
        assert first.checkpoint_id == 1 and first.incremental_size > N_KEYS * VALUE_BYTES
        self.client.cancel_job(JOB)
        meta = read_metadata(self.storage, first.path)
        files = referenced_files(meta, "chk-1") | {"chk-1/_metadata"}
        shared = {f.path[3:] for _, _, f in meta.files() if f.shared}
        assert shared and files <= self.files()
        return first, files, shared

    def restart_jobmanager(self) -> None:
        self.client.close()
        assert self.cluster.jobmanager is not None
        self.cluster.jobmanager.kill()  # SIGKILL: a crash, nothing cleaned up
        self.cluster.restart_jobmanager()
        self.client = self.connect()
        wait_until(self._running, "the job running under the new JobManager", timeout_s=90)

    def _running(self) -> bool:
        try:
            return self.client.job_info(JOB).status == pb.JOB_STATUS_RUNNING
        except Exception:
            return False


def _shared(run: Run, info: jm_pb.CheckpointInfo) -> set[str]:
    return {f.path[3:] for _, _, f in read_metadata(run.storage, info.path).files() if f.shared}


@pytest.fixture
def run(process_cluster: Callable[..., MiniCluster], tmp_path: Path) -> Any:
    r = Run(process_cluster, tmp_path)
    yield r
    r.client.close()


def test_claim_keeps_the_first_checkpoint_incremental_and_deletes_the_source_once_subsumed(run: Run) -> None:
    first, _, source_shared = run.source()
    run.client.restore_job(JOB, first.path, claim_mode="CLAIM")
    run.assert_state()

    run.write(range(0, N_KEYS, 100))  # 1% of the keys
    after = run.checkpoint()
    assert after.incremental_size < 0.05 * first.full_size, (after.incremental_size, first.full_size)
    assert source_shared <= _shared(run, after), "checkpoint 1's SST files are referenced, not uploaded again"
    second = run.checkpoint()
    assert second.incremental_size < 0.05 * first.full_size

    # Checkpoint 1 is the job's now: subsumed, it goes, apart from the SST files checkpoint 3 still uses.
    latest = read_metadata(run.storage, second.path)
    expected = referenced_files(latest, f"chk-{second.checkpoint_id}") | {f"chk-{second.checkpoint_id}/_metadata"}
    wait_until(lambda: run.files() == expected, "only the retained checkpoint's files", 30, run.files)
    assert not any(f.startswith("chk-1/") for f in run.files())
    run.assert_state()


def test_no_claim_makes_the_first_checkpoint_full_and_never_deletes_the_source(run: Run) -> None:
    first, source_files, source_shared = run.source()
    run.client.restore_job(JOB, first.path, claim_mode="NO_CLAIM")
    run.assert_state()

    run.write(range(0, N_KEYS, 100))
    after = run.checkpoint()
    assert after.incremental_size > 0.95 * first.incremental_size, (after.incremental_size, first.incremental_size)
    assert not source_shared & _shared(run, after), "nothing of the restored checkpoint is referenced"
    second = run.checkpoint()  # subsumes the first one after the restore; incremental again
    assert second.incremental_size < 0.05 * first.full_size, (second.incremental_size, first.full_size)

    gone = f"chk-{after.checkpoint_id}/_metadata"
    wait_until(lambda: gone not in run.files(), "the subsumed checkpoint deleted", 30, run.files)
    assert source_files <= run.files(), "NO_CLAIM: the job never deletes the restored checkpoint"
    run.assert_state()


@pytest.mark.parametrize("mode", ["CLAIM", "NO_CLAIM"])
def test_a_new_jobmanager_keeps_the_claim_mode_and_recovers_incrementally(run: Run, mode: str) -> None:
    first, source_files, source_shared = run.source()
    run.client.restore_job(JOB, first.path, claim_mode=mode)
    if mode == "NO_CLAIM":
        # A checkpoint of the job's own subsumes (by id) the source, so the new leader's sweep of the
        # job directory would delete the source, were it not recorded as restored under NO_CLAIM.
        run.write(range(0, N_KEYS, 100))
        own = run.checkpoint()
        assert own.incremental_size > 0.95 * first.incremental_size
    run.restart_jobmanager()
    run.assert_state()

    run.write(range(1, N_KEYS, 100))
    after = run.checkpoint()
    # Recovering its own (or claimed) checkpoint, the job owns its files: nothing is uploaded twice.
    assert after.incremental_size < 0.05 * first.full_size, (after.incremental_size, first.full_size)
    if mode == "CLAIM":
        assert source_shared <= _shared(run, after)
    else:
        assert not source_shared & _shared(run, after)
        time.sleep(1.0)  # a late deletion would show now
        assert source_files <= run.files(), "NO_CLAIM: no JobManager of the job deletes the restored checkpoint"
    assert run.client.job_info(JOB).status == pb.JOB_STATUS_RUNNING
    run.assert_state()


def test_a_failover_after_a_no_claim_restore_recovers_incrementally_from_the_jobs_own_checkpoint(run: Run) -> None:
    first, source_files, source_shared = run.source()
    run.client.restore_job(JOB, first.path)  # the job's default claim mode: NO_CLAIM
    run.write(range(0, N_KEYS, 100))
    own = run.checkpoint()
    assert own.incremental_size > 0.95 * first.incremental_size
    own_shared = _shared(run, own)  # read now: the next checkpoint subsumes it
    before = run.client.job_info(JOB).restarts

    run.cluster.taskmanagers[0].kill()  # SIGKILL: its slots and their RocksDB go with it
    run.cluster.restart_taskmanager(0)
    wait_until(lambda: run.client.job_info(JOB).restarts > before and run._running(), "the failover", 90)
    run.assert_state()
    run.write(range(2, N_KEYS, 100))
    after = run.checkpoint()
    assert after.incremental_size < 0.05 * first.full_size, (after.incremental_size, first.full_size)
    assert own_shared & _shared(run, after), "the job's own checkpoint is referenced, not uploaded again"
    assert not source_shared & _shared(run, after)
    assert source_files <= run.files()


def test_claim_takes_a_savepoint_over_and_deletes_it_once_subsumed(run: Run, tmp_path: Path) -> None:
    run.client.submit_job(JOB, OPS, max_parallelism=128)
    run.write(range(N_KEYS))
    target = (tmp_path / "savepoints").as_uri()
    savepoint = run.client.trigger_checkpoint(JOB, savepoint=True, target_directory=target, timeout_s=60)
    assert savepoint.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, savepoint.failure_reason
    with pytest.raises(InvalidArgumentError, match="removed in Flink 2.0"):
        run.client.restore_job(JOB, savepoint.path, claim_mode="LEGACY")
    saved = relative_files(run.storage, savepoint.path)
    assert saved

    run.client.restore_job(JOB, savepoint.path, claim_mode="CLAIM")
    run.assert_state()
    run.write(range(0, N_KEYS, 100))
    after = run.checkpoint()
    # A savepoint is self-contained (no shared/ files): nothing of it can be referenced, so the first
    # checkpoint uploads the state; but the job owns it now, and deletes it once subsumed.
    assert after.incremental_size > 0.95 * savepoint.full_size, (after.incremental_size, savepoint.full_size)
    wait_until(lambda: not relative_files(run.storage, savepoint.path), "the claimed savepoint deleted", 30)
    run.write(range(1, N_KEYS, 100))
    assert run.checkpoint().incremental_size < 0.05 * savepoint.full_size
    run.assert_state()


def test_no_claim_never_deletes_a_savepoint(run: Run, tmp_path: Path) -> None:
    run.client.submit_job(JOB, OPS, max_parallelism=128)
    run.write(range(N_KEYS))
    target = (tmp_path / "savepoints").as_uri()
    savepoint = run.client.trigger_checkpoint(JOB, savepoint=True, target_directory=target, timeout_s=60)
    assert savepoint.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, savepoint.failure_reason
    saved = relative_files(run.storage, savepoint.path)
    assert saved
    run.client.restore_job(JOB, savepoint.path, claim_mode="NO_CLAIM")
    for start in range(3):
        run.write(range(start, N_KEYS, 100))
        run.checkpoint()
    time.sleep(1.0)  # a late deletion would show now
    assert relative_files(run.storage, savepoint.path) == saved
    run.assert_state()
