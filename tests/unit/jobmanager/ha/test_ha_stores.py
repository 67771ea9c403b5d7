"""The durable pieces of JobManager high availability, on real file:// storage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keyedstate.common.config import Configuration
from keyedstate.common.errors import ConfigError, CorruptCheckpointError, InvalidArgumentError
from keyedstate.common.ids import KeyGroupRange
from keyedstate.common.storage import CheckpointStorage, open_storage
from keyedstate.jobmanager.checkpoint.completed import CompletedCheckpoint
from keyedstate.jobmanager.checkpoint.metadata import CheckpointMetadata, FileRef, OperatorSnapshot, SubtaskSnapshot
from keyedstate.jobmanager.ha import create_ha_services
from keyedstate.jobmanager.ha.checkpoint_store import DurableCompletedCheckpointStore
from keyedstate.jobmanager.ha.id_counter import DurableCheckpointIDCounter
from keyedstate.jobmanager.ha.job_store import JobRecord, JobStore
from keyedstate.jobmanager.ha.leader import LeadershipLease, LeadershipLostError


def _no_fence() -> None:
    pass


@pytest.fixture
def storage(tmp_path: Path) -> CheckpointStorage:
    return open_storage(tmp_path.as_uri())


def _completed(tmp_path: Path, cid: int, savepoint: bool = False) -> CompletedCheckpoint:
    files = (FileRef(f"../shared/f{cid}", 1, "", f"f{cid}", True),) if not savepoint else ()
    meta = CheckpointMetadata(
        "job-1",
        cid,
        savepoint,
        0,
        -1,
        8,
        (OperatorSnapshot("op", 1, (), (SubtaskSnapshot(0, KeyGroupRange(0, 7), "rocksdb", 0, 1, 1, files),)),),
    )
    where = f"savepoints/sp-{cid}" if savepoint else f"checkpoints/job-1/chk-{cid}"
    return CompletedCheckpoint(meta, (tmp_path / where).as_uri())


# -- checkpoint id counter ------------------------------------------------------------------------
def test_counter_survives_a_restart_and_never_hands_out_an_id_twice(storage: CheckpointStorage, tmp_path: Path) -> None:
    path = (tmp_path / "ha" / "counter").as_uri()
    first = DurableCheckpointIDCounter(storage, path, _no_fence)
    assert [first.get_and_increment() for _ in range(3)] == [1, 2, 3]
    # The next id is durable before an id is handed out: a JobManager killed right after
    # taking id 3 restarts at 4, never at 3.
    assert json.loads(Path(path[len("file://") :]).read_text()) == {"next": 4}
    second = DurableCheckpointIDCounter(storage, path, _no_fence)
    assert second.get_and_increment() == 4


def test_counter_respects_the_floor_from_existing_checkpoint_directories(
    storage: CheckpointStorage, tmp_path: Path
) -> None:
    path = (tmp_path / "ha" / "counter").as_uri()
    DurableCheckpointIDCounter(storage, path, _no_fence).get_and_increment()
    counter = DurableCheckpointIDCounter(storage, path, _no_fence, floor=17)
    assert counter.get() == 17
    assert DurableCheckpointIDCounter(storage, path, _no_fence).get() == 17  # the floor was persisted


def test_counter_refuses_to_go_backwards(storage: CheckpointStorage, tmp_path: Path) -> None:
    counter = DurableCheckpointIDCounter(storage, (tmp_path / "c").as_uri(), _no_fence, floor=10)
    with pytest.raises(InvalidArgumentError, match="cannot move the checkpoint id counter back from 10 to 5"):
        counter.set_count(5)
    counter.set_count(12)
    assert counter.get_and_increment() == 12


def test_corrupt_counter_names_the_fix(storage: CheckpointStorage, tmp_path: Path) -> None:
    (tmp_path / "c").write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match="delete it"):
        DurableCheckpointIDCounter(storage, (tmp_path / "c").as_uri(), _no_fence)


def test_counter_is_fenced(storage: CheckpointStorage, tmp_path: Path) -> None:
    def fenced() -> None:
        raise LeadershipLostError("replaced")

    counter = DurableCheckpointIDCounter(storage, (tmp_path / "c").as_uri(), _no_fence)
    counter._fence = fenced  # a newer JobManager took over after this one started
    with pytest.raises(LeadershipLostError):
        counter.get_and_increment()
    assert counter.get() == 1  # nothing was handed out


# -- completed-checkpoint pointers ----------------------------------------------------------------
def test_pointers_follow_retention(storage: CheckpointStorage, tmp_path: Path) -> None:
    pointers = (tmp_path / "ha" / "checkpoints").as_uri()
    store = DurableCompletedCheckpointStore(storage, pointers, 2, _no_fence)
    for cid in (1, 2, 3):
        store.add_checkpoint(_completed(tmp_path, cid))
    assert [p.checkpoint_id for p in store.pointers()] == [2, 3]
    assert store.pointers()[-1].external_path.endswith("/checkpoints/job-1/chk-3")
    # A savepoint is a restore point until a newer checkpoint overtakes it; then its pointer goes.
    store.add_checkpoint(_completed(tmp_path, 4, savepoint=True))
    assert [(p.checkpoint_id, p.savepoint) for p in store.pointers()] == [(2, False), (3, False), (4, True)]
    store.add_checkpoint(_completed(tmp_path, 5))
    assert [p.checkpoint_id for p in store.pointers()] == [3, 5]


def test_re_adding_a_recovered_checkpoint_is_idempotent_but_a_different_path_is_not(
    storage: CheckpointStorage, tmp_path: Path
) -> None:
    pointers = (tmp_path / "ha" / "checkpoints").as_uri()
    DurableCompletedCheckpointStore(storage, pointers, 1, _no_fence).add_checkpoint(_completed(tmp_path, 1))
    again = DurableCompletedCheckpointStore(storage, pointers, 1, _no_fence)
    again.add_checkpoint(_completed(tmp_path, 1))
    assert [p.checkpoint_id for p in again.pointers()] == [1]
    other = CompletedCheckpoint(_completed(tmp_path, 1).metadata, (tmp_path / "elsewhere").as_uri())
    with pytest.raises(FileExistsError):
        DurableCompletedCheckpointStore(storage, pointers, 1, _no_fence).add_checkpoint(other)


def test_unreadable_pointer_is_skipped(storage: CheckpointStorage, tmp_path: Path) -> None:
    pointers = tmp_path / "ha" / "checkpoints"
    store = DurableCompletedCheckpointStore(storage, pointers.as_uri(), 2, _no_fence)
    store.add_checkpoint(_completed(tmp_path, 1))
    (pointers / f"{2:020d}.json").write_text("garbage")
    assert [p.checkpoint_id for p in store.pointers()] == [1]


# -- job records --------------------------------------------------------------------------------
def test_job_records_round_trip_and_a_corrupt_one_does_not_hide_the_others(
    storage: CheckpointStorage, tmp_path: Path
) -> None:
    jobs = JobStore(storage, (tmp_path / "jobs").as_uri(), _no_fence)
    spec = {"job_id": "a", "max_parallelism": 8, "config": {}, "operators": []}
    jobs.put(JobRecord(spec=spec, status="RUNNING", routing_version=3, restore_path="file:///sp"))
    (tmp_path / "jobs" / "b").mkdir()
    (tmp_path / "jobs" / "b" / "job.json").write_text('{"format_version": 99}')
    records = jobs.records()
    assert [(r.job_id, r.status, r.routing_version, r.restore_path) for r in records] == [
        ("a", "RUNNING", 3, "file:///sp")
    ]
    with pytest.raises(CorruptCheckpointError, match="format_version 99"):
        JobRecord.from_bytes((tmp_path / "jobs" / "b" / "job.json").read_bytes(), "b")


# -- leadership ---------------------------------------------------------------------------------
def test_a_newer_jobmanager_fences_the_older_one(storage: CheckpointStorage, tmp_path: Path) -> None:
    directory = (tmp_path / "leader").as_uri()
    old = LeadershipLease(storage, directory, "127.0.0.1:1")
    assert old.acquire() == 1
    old.check()
    new = LeadershipLease(storage, directory, "127.0.0.1:2")
    assert new.acquire() == 2
    new.check()
    with pytest.raises(LeadershipLostError, match="replaced by session 2"):
        old.check()
    # Older sessions are cleaned up, a few kept for post-mortems.
    for _ in range(6):
        LeadershipLease(storage, directory, "x").acquire()
    assert len(list(storage.list(directory))) <= 4


def test_jobs_store_writes_are_fenced(storage: CheckpointStorage, tmp_path: Path) -> None:
    directory = (tmp_path / "leader").as_uri()
    old = LeadershipLease(storage, directory, "a")
    old.acquire()
    jobs = JobStore(storage, (tmp_path / "jobs").as_uri(), old.check)
    LeadershipLease(storage, directory, "b").acquire()
    with pytest.raises(LeadershipLostError):
        jobs.put(JobRecord(spec={"job_id": "a"}, status="RUNNING", routing_version=1))
    assert jobs.records() == []


# -- configuration ------------------------------------------------------------------------------
def test_filesystem_ha_needs_a_storage_dir() -> None:
    with pytest.raises(ConfigError, match="high-availability.storageDir is not set"):
        create_ha_services(Configuration({"high-availability.type": "filesystem"}), open_storage)


def test_bad_cluster_id_is_a_config_error(tmp_path: Path) -> None:
    conf = Configuration(
        {
            "high-availability.type": "filesystem",
            "high-availability.storageDir": tmp_path.as_uri(),
            "high-availability.cluster-id": "a/../b",
        }
    )
    with pytest.raises(ConfigError, match="cluster-id"):
        create_ha_services(conf, open_storage)


def test_none_keeps_nothing(tmp_path: Path) -> None:
    ha = create_ha_services(Configuration({}), open_storage)
    assert not ha.enabled and ha.job_records() == [] and ha.checkpoint_id_counter("j").get() == 1
