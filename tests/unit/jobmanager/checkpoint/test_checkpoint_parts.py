"""The coordinator's parts on their own: ids, reasons, pending acks, store, registry, cleaner, stats, settings."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common.config import Configuration
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.errors import CheckpointError, ConfigError, InvalidArgumentError
from keyedstate.common.handles import SubtaskStateHandle
from keyedstate.common.ids import CheckpointId, JobId, KeyGroupRange, SubtaskId
from keyedstate.common.rpc.convert import handle_from_proto
from keyedstate.jobmanager.checkpoint import (
    AckOutcome,
    CheckpointException,
    CheckpointingSettings,
    CheckpointMetadata,
    CheckpointsCleaner,
    CheckpointStatsTracker,
    CompletedCheckpoint,
    FileRef,
    InlineExecutor,
    OperatorSnapshot,
    PendingCheckpoint,
    SharedStateRegistry,
    StandaloneCheckpointIDCounter,
    StandaloneCompletedCheckpointStore,
    SubtaskSnapshot,
)
from keyedstate.jobmanager.checkpoint import (
    CheckpointFailureReason as R,
)
from keyedstate.jobmanager.rpc.checkpoint_wire import summary_to_proto
from tests.fakes.clock import ManualClock
from tests.fakes.scheduler import ManualScheduler

JOB = JobId("job-1")
BASE = "s3://bucket/ckpt/job-1"


# -- ids and reasons -----------------------------------------------------------------------------
def test_id_counter_strictly_increases_and_never_goes_back() -> None:
    counter = StandaloneCheckpointIDCounter()
    assert [counter.get_and_increment() for _ in range(3)] == [1, 2, 3]
    assert counter.get() == 4
    counter.set_count(10)
    assert counter.get_and_increment() == 10
    with pytest.raises(InvalidArgumentError, match="cannot move the checkpoint id counter back from 11 to 5"):
        counter.set_count(5)
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda _: counter.get_and_increment(), range(400)))
    assert len(set(ids)) == 400


def test_only_real_checkpoint_failures_count_toward_tolerable_failures() -> None:
    counted = {r for r in R if r.counts}
    assert counted == {
        R.CHECKPOINT_EXPIRED,
        R.CHECKPOINT_DECLINED,
        R.STATE_SIZE_LIMIT_EXCEEDED,  # a decline, with its own fix
        R.CHECKPOINT_ASYNC_EXCEPTION,
        R.FINALIZE_CHECKPOINT_FAILURE,
        R.IO_EXCEPTION,
    }
    assert all(not r.counts for r in R if r.pre_flight and r is not R.IO_EXCEPTION)
    # A lookup by value; mypy reads the call as the members' __new__.
    assert R("CHECKPOINT_EXPIRED") is R.CHECKPOINT_EXPIRED  # type: ignore[call-arg]
    exc = CheckpointException(R.CHECKPOINT_EXPIRED, "took too long")
    assert isinstance(exc, CheckpointError) and str(exc) == "CHECKPOINT_EXPIRED: took too long"
    assert exc.failure_reason is R.CHECKPOINT_EXPIRED


# -- settings ------------------------------------------------------------------------------------
def test_settings_from_flink_keys() -> None:
    conf = Configuration(
        {
            "execution.checkpointing.interval": "30 s",
            "execution.checkpointing.timeout": "2 min",
            "execution.checkpointing.max-concurrent-checkpoints": 2,
            "execution.checkpointing.min-pause": "500ms",
            "execution.checkpointing.tolerable-failed-checkpoints": 3,
            "state.checkpoints.num-retained": 4,
            "state.backend.incremental": "true",
        }
    )
    assert CheckpointingSettings.from_config(conf) == CheckpointingSettings(30_000, 120_000, 2, 500, 3, 4, True)
    defaults = CheckpointingSettings.from_config(Configuration())
    assert defaults.interval_ms is None and not defaults.periodic and defaults.timeout_ms == 600_000


def test_settings_reject_unusable_values_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="execution.checkpointing.interval: must be at least 10 ms"):
        CheckpointingSettings(interval_ms=5)
    with pytest.raises(ConfigError, match="num-retained: must be at least 1"):
        CheckpointingSettings(num_retained=0)


# -- pending -------------------------------------------------------------------------------------
def _pending(savepoint: bool = False, epoch: int = -1) -> PendingCheckpoint:
    ops = [OperatorSpec("counts", 2, (StateDescriptor("total", StateKind.VALUE),))]
    target = f"{BASE}/chk-3" if not savepoint else "s3://bucket/sp/savepoint-job-1-3"
    return PendingCheckpoint(
        job_id=JOB,
        checkpoint_id=CheckpointId(3),
        trigger_timestamp_ms=1,
        trigger_monotonic_ms=1,
        operators=ops,
        max_parallelism=8,
        target_path=target,
        shared_dir=f"{BASE}/shared",
        savepoint=savepoint,
        epoch=epoch,
    )


def _handle(index: int, *paths: tuple[str, bool]) -> SubtaskStateHandle:
    start, end = (0, 3) if index == 0 else (4, 7)
    handle = pb.SubtaskStateHandle(
        operator_id="counts",
        subtask_index=index,
        backend="rocksdb",
        key_groups=pb.KeyGroupRange(start=start, end=end),
        committed_epoch=-1,
    )
    for path, shared in paths:
        handle.files.add(path=path, size=10, shared=shared)
    return handle_from_proto(handle)


def test_pending_outcomes() -> None:
    p = _pending()
    s0, s1 = SubtaskId(JOB, "counts", 0), SubtaskId(JOB, "counts", 1)
    assert p.acknowledge(s0, _handle(0)) is AckOutcome.SUCCESS
    assert p.acknowledge(s0, _handle(0)) is AckOutcome.DUPLICATE
    assert p.acknowledge(SubtaskId(JOB, "counts", 5), _handle(0)) is AckOutcome.UNKNOWN
    assert not p.is_fully_acknowledged and p.not_yet_acknowledged() == {s1}
    p.mark_aborted(R.CHECKPOINT_EXPIRED, "late")
    assert p.acknowledge(s1, _handle(1)) is AckOutcome.DISCARDED
    assert p.is_discarded


def test_pending_normalizes_every_accepted_path_form() -> None:
    p = _pending()
    s0 = SubtaskId(JOB, "counts", 0)
    handle = _handle(
        0,
        ("shared/a.sst", True),
        ("../shared/b.sst", True),
        (f"{BASE}/shared/c.sst", True),
        (f"{BASE}/chk-3/counts-0/MANIFEST", False),
        ("counts-0/OPTIONS", False),
        (f"{BASE}/taskowned/log", False),
    )
    p.acknowledge(s0, handle)
    stored = p.acknowledged()[s0]
    assert [f.path for f in stored.files] == [
        "../shared/a.sst",
        "../shared/b.sst",
        "../shared/c.sst",
        "counts-0/MANIFEST",
        "counts-0/OPTIONS",
        "../taskowned/log",
    ]
    assert p.shared_files() == {f"{BASE}/shared/{n}.sst" for n in "abc"}
    assert handle.files[0].path == "shared/a.sst", "the caller's message is not modified"


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ([("s3://other-bucket/x.sst", False)], "must be inside the checkpoint directory"),
        ([("../chk-2/counts-0/MANIFEST", False)], "must be inside the checkpoint directory"),
        ([("counts-0/../../x", False)], "must be inside the checkpoint directory"),
        ([("counts-0/MANIFEST", True)], "must be ../shared/<name>"),
    ],
)
def test_pending_rejects_paths_that_escape(files: list[tuple[str, bool]], message: str) -> None:
    with pytest.raises(CheckpointException, match=message) as info:
        _pending().acknowledge(SubtaskId(JOB, "counts", 0), _handle(0, *files))
    assert info.value.failure_reason is R.CHECKPOINT_DECLINED
    assert "subtask job-1/counts/0 sent an unusable acknowledgement for checkpoint 3" in str(info.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sha256": "ABC"}, "sha256 is not 64 lowercase hex digits"),
        ({"local_name": "../escape"}, "which is not a plain file name"),
        ({"size": -1}, "has negative size -1"),
    ],
)
def test_pending_declines_an_unusable_file_when_it_is_acknowledged(change: dict[str, Any], message: str) -> None:
    # Checked at the ack, naming the subtask, not at _metadata time (which no longer looks at every file again).
    fields = {"path": "counts-0/MANIFEST", "size": 10, "sha256": "0" * 64, "local_name": "MANIFEST", **change}
    bad = handle_from_proto(
        pb.SubtaskStateHandle(
            operator_id="counts",
            subtask_index=0,
            backend="rocksdb",
            key_groups=pb.KeyGroupRange(start=0, end=3),
            committed_epoch=-1,
            files=[pb.StateFileHandle(**fields)],
        )
    )
    p = _pending()
    with pytest.raises(CheckpointException, match=message) as info:
        p.acknowledge(SubtaskId(JOB, "counts", 0), bad)
    assert info.value.failure_reason is R.CHECKPOINT_DECLINED
    assert "subtask job-1/counts/0 sent an unusable acknowledgement for checkpoint 3" in str(info.value)
    assert p.acknowledged() == {}


def test_metadata_written_without_the_file_pass_still_checks_it_when_read() -> None:
    p = _pending()
    p.acknowledge(SubtaskId(JOB, "counts", 0), _handle(0, ("counts-0/MANIFEST", False)))
    p.acknowledge(SubtaskId(JOB, "counts", 1), _handle(1, ("counts-1/MANIFEST", False)))
    meta = p.build_metadata()
    sub = meta.operators[0].subtasks[0]
    broken = dataclasses.replace(sub, files=(sub.files[0]._replace(sha256="nothex"),))
    op = dataclasses.replace(meta.operators[0], subtasks=(broken, meta.operators[0].subtasks[1]))
    tampered = dataclasses.replace(meta, operators=(op,))
    assert tampered.structure_problems() == []
    assert tampered.problems() == [
        "operator 'counts' subtask 0: file 'counts-0/MANIFEST' sha256 is not 64 lowercase hex digits"
    ]


def test_pending_builds_metadata_in_operator_and_subtask_order() -> None:
    p = _pending()
    p.acknowledge(SubtaskId(JOB, "counts", 1), _handle(1, ("counts-1/a", False)))
    p.acknowledge(SubtaskId(JOB, "counts", 0), _handle(0, ("shared/x", True)))
    meta = p.build_metadata()
    assert [s.subtask_index for s in meta.operators[0].subtasks] == [0, 1]
    assert meta.problems() == [] and meta.epoch == -1  # the epoch of the cut


# -- store ---------------------------------------------------------------------------------------
def _completed(cid: int, savepoint: bool = False, shared: tuple[str, ...] = ()) -> CompletedCheckpoint:
    files = tuple(FileRef(f"../shared/{n}", 1, "", n, True) for n in shared)
    meta = CheckpointMetadata(
        JOB,
        cid,
        savepoint,
        0,
        -1,
        8,
        (OperatorSnapshot("op", 1, (), (SubtaskSnapshot(0, KeyGroupRange(0, 7), "rocksdb", 0, 1, 1, files),)),),
    )
    path = f"s3://bucket/sp/savepoint-job-1-{cid}" if savepoint else f"{BASE}/chk-{cid}"
    return CompletedCheckpoint(meta, path)


def _latest(store: StandaloneCompletedCheckpointStore) -> CompletedCheckpoint:
    latest = store.latest()
    assert latest is not None
    return latest


def test_store_retains_the_latest_checkpoints_and_returns_the_subsumed() -> None:
    store = StandaloneCompletedCheckpointStore(2)
    assert store.add_checkpoint(_completed(1)) == []
    assert store.add_checkpoint(_completed(2)) == []
    assert [c.checkpoint_id for c in store.add_checkpoint(_completed(3))] == [1]
    assert [c.checkpoint_id for c in store.all()] == [2, 3]
    assert (
        _latest(store).checkpoint_id == 3
        and store.get(CheckpointId(2)) is not None
        and store.get(CheckpointId(1)) is None
    )
    with pytest.raises(CheckpointError, match="older than the retained checkpoint 3"):
        store.add_checkpoint(_completed(1))


def test_store_never_subsumes_savepoints() -> None:
    store = StandaloneCompletedCheckpointStore(1)
    store.add_checkpoint(_completed(1))
    assert store.add_checkpoint(_completed(2, savepoint=True)) == []
    assert _latest(store).savepoint, "a savepoint newer than every checkpoint is what a failover restores"
    subsumed = store.add_checkpoint(_completed(3))
    assert [c.checkpoint_id for c in subsumed] == [1], "the savepoint leaves the store but is not returned for deletion"
    assert [c.checkpoint_id for c in store.all()] == [3]
    # A savepoint finishing after a newer checkpoint stays where it is and is not a restore point.
    assert store.add_checkpoint(_completed(2, savepoint=True)) == [] and _latest(store).checkpoint_id == 3
    with pytest.raises(InvalidArgumentError):
        StandaloneCompletedCheckpointStore(0)


# -- shared registry -----------------------------------------------------------------------------
def test_registry_counts_references_and_releases_at_zero() -> None:
    registry = SharedStateRegistry()
    c1, c2 = _completed(1, shared=("a", "b")), _completed(2, shared=("b", "c"))
    registry.register(c1)
    registry.register(c2)
    registry.register(c2)  # idempotent
    assert registry.reference_count(f"{BASE}/shared/b") == 2
    assert registry.unregister(c1) == [f"{BASE}/shared/a"]
    assert registry.is_referenced(f"{BASE}/shared/b") and not registry.is_referenced(f"{BASE}/shared/a")
    assert registry.unreferenced([f"{BASE}/shared/c", f"{BASE}/shared/z", f"{BASE}/chk-9/../shared/z"]) == [
        f"{BASE}/shared/z"
    ]
    assert registry.unregister(c1) == []
    assert registry.unregister(c2) == [f"{BASE}/shared/b", f"{BASE}/shared/c"] and len(registry) == 0


# -- cleaner -------------------------------------------------------------------------------------
def test_cleaner_deletes_dirs_then_files_and_respects_keep(storage: Any, tmp_path: Any) -> None:
    root = tmp_path.as_uri()
    for rel in ("job/chk-1/_metadata", "job/chk-1/a", "job/shared/x", "job/shared/y"):
        storage.write_bytes(f"{root}/{rel}", b"1")
    cleaner = CheckpointsCleaner(storage, InlineExecutor())
    done = cleaner.discard(
        directories=[f"{root}/job/chk-1"],
        files=[f"{root}/job/shared/x", f"{root}/job/shared/y"],
        keep=lambda p: p.endswith("/y"),
    )
    assert done.result() == [f"{root}/job/chk-1", f"{root}/job/shared/x"]
    assert not storage.exists(f"{root}/job/chk-1/_metadata") and storage.exists(f"{root}/job/shared/y")
    assert cleaner.discard().result() == []


def test_cleaner_failures_are_counted_not_raised(storage: Any, tmp_path: Any) -> None:
    cleaner = CheckpointsCleaner(storage)  # its own worker thread
    try:
        future = cleaner.discard(directories=["file:///"])  # the storage refuses to delete a root
        assert future.result(timeout=30) == []
        assert cleaner.flush(timeout=30) and cleaner.failures == 1
    finally:
        cleaner.close()


# -- stats ---------------------------------------------------------------------------------------
def test_stats_gauges_are_flink_named_and_shared_across_jobs() -> None:
    registry = CollectorRegistry()
    a = CheckpointStatsTracker(JobId("a"), registry, history_size=2)
    CheckpointStatsTracker(JobId("b"), registry)  # a second job on the same registry

    def value(name: str, job: str) -> float | None:
        return registry.get_sample_value(f"flink_jobmanager_job_{name}", {"job_id": job})

    for cid in (1, 2, 3):
        a.report_pending(CheckpointId(cid), 1000 * cid, savepoint=False, num_subtasks=4, path=f"p{cid}", epoch=-1)
    a.report_completed(CheckpointId(1), duration_ms=50, full_size=1000, incremental_size=10, path="p1", epoch=3)
    a.report_failed(CheckpointId(2), R.CHECKPOINT_EXPIRED, "slow", duration_ms=70)
    a.report_rejected(R.TOO_MANY_CHECKPOINT_REQUESTS, "busy")
    a.report_restored(CheckpointId(1), 12345)
    assert value("numberOfCompletedCheckpoints", "a") == 1 and value("numberOfFailedCheckpoints", "a") == 2
    assert value("numberOfInProgressCheckpoints", "a") == 1 and value("totalNumberOfCheckpoints", "a") == 4
    assert value("lastCheckpointDuration", "a") == 50 and value("lastCheckpointSize", "a") == 10
    assert value("lastCheckpointFullSize", "a") == 1000 and value("lastCompletedCheckpointId", "a") == 1
    assert value("lastCheckpointRestoreTimestamp", "a") == 12345
    assert value("numberOfCompletedCheckpoints", "b") == 0 and value("lastCheckpointRestoreTimestamp", "b") == -1
    assert (
        registry.get_sample_value(
            "keyedstate_jobmanager_job_checkpoint_failures_total", {"job_id": "a", "reason": "CHECKPOINT_EXPIRED"}
        )
        == 1
    )
    history = a.history()
    assert [(e.checkpoint_id, e.status) for e in history] == [(3, "IN_PROGRESS"), (2, "FAILED")]
    assert summary_to_proto(history[1].summary()).failure_reason == "CHECKPOINT_EXPIRED: slow"
    a.close()
    assert value("numberOfCompletedCheckpoints", "a") is None and value("numberOfCompletedCheckpoints", "b") == 0


# -- manual scheduler ----------------------------------------------------------------------------
def test_manual_scheduler_runs_due_callbacks_in_order_without_threads() -> None:
    clock = ManualClock()
    scheduler = ManualScheduler(clock)
    ran: list[tuple[str, int]] = []
    start = clock.monotonic_ms()

    def record(name: str) -> Callable[[], None]:
        return lambda: ran.append((name, clock.monotonic_ms() - start))

    scheduler.schedule(30, record("c"))
    scheduler.schedule(10, record("a"))

    def b_then_nested() -> None:
        record("b")()
        scheduler.schedule(5, record("nested"))

    scheduler.schedule(10, b_then_nested)
    scheduler.schedule(100, record("late")).cancel()
    assert scheduler.advance(29) == 3
    assert ran == [("a", 10), ("b", 10), ("nested", 15)] and clock.monotonic_ms() - start == 29
    assert scheduler.pending() == [1] and len(scheduler) == 1
    clock.advance(10)  # moving the clock alone runs nothing
    assert len(ran) == 3
    assert scheduler.run_due() == 1 and ran[-1] == ("c", 39)
    assert scheduler.advance(1000) == 0
    with pytest.raises(ValueError):
        scheduler.advance(-1)
