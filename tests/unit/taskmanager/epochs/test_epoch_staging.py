"""The staging database's lifecycle and the refusals that must stage nothing."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import rocksdict

from keyedstate.common._proto.v1 import common_pb2
from keyedstate.common.errors import (
    InvalidArgumentError,
    NotFoundError,
    Reason,
    SizeLimitError,
    StaleRoutingError,
    StorageError,
    UnavailableError,
    WrongStateKindError,
)
from keyedstate.common.ids import KeyGroupRange
from keyedstate.common.keygroups import key_group
from keyedstate.taskmanager.epochs import EpochTransaction, StagingStore, TaskAttempt
from keyedstate.taskmanager.epochs.locks import SharedExclusiveLock
from keyedstate.taskmanager.state import StateLimits
from tests.unit.taskmanager.epochs.conftest import MP, EpochHarness


def test_staging_is_a_rocksdb_under_the_slot_instance_dir_created_by_the_first_write(harness: EpochHarness) -> None:
    v = harness.view(1, 0, 1)
    v.value_get("v", [b"a"], b"")
    v.list_get("l", [b"a"], b"")
    assert list(v.map_scan("m", b"a", b"")) == []
    assert not harness.staging_dir().exists()

    v.value_put("v", [b"a"], [b"x"], b"")

    # HashMap slots stage in RocksDB too, so a large partition never has to fit on the heap.
    assert (harness.staging_dir() / "CURRENT").is_file()
    assert harness.staging_dir().parent == harness.instance_dir(harness.slot().subtask)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda v: v.value_put("l", [b"a"], [b"x"], b""), WrongStateKindError, "ValuePut does not apply to state 'l'"),
        (lambda v: v.reduce("v", [b"a"], [b"x"], b"", False), WrongStateKindError, "Reduce does not apply"),
        (lambda v: v.map_put("nope", [b"a"], [b"u"], [b"x"], b""), NotFoundError, "unknown state 'nope'"),
        (lambda v: v.value_put("v", [b"a", b"b"], [b"x"], b""), InvalidArgumentError, "1 values for 2 keys"),
        (lambda v: v.value_put("v", [b"a"], [b"x" * 101], b""), SizeLimitError, "max-value-bytes"),
        (lambda v: v.list_append("l", [b"a"], [b"x" * 101], b""), SizeLimitError, "max-value-bytes"),
        (lambda v: v.map_put("m", [b"a"], [b"u" * 65], [b"x"], b""), SizeLimitError, "user key #0"),
        (lambda v: v.reduce("r", [b"a"], [b"short"], b"", True), InvalidArgumentError, "reduce operand 0"),
        (lambda v: v.clear("v", [b"a", b"b"], [b"ns"]), InvalidArgumentError, "1 namespaces for 2 keys"),
        (lambda v: v.list_update("l", [b"a"] * 4, [b"1", b"2", b"3", b"4"], b""), SizeLimitError, "max-elements"),
    ],
)
def test_refused_batches_stage_nothing(
    make_harness: Callable[..., EpochHarness], call: Callable[[EpochTransaction], object], error: type, match: str
) -> None:
    h = make_harness(limits=StateLimits(max_key_bytes=64, max_value_bytes=100, max_list_elements=3))
    v = h.view(1, 0, 1)
    v.value_put("v", [b"a"], [b"before"], b"")  # the staging DB exists, so "nothing staged" is checkable
    with pytest.raises(error, match=match):
        call(v)
    assert v.value_get("v", [b"a", b"b"], b"") == [b"before", None]
    assert v.list_get("l", [b"a"], b"") == [[]]
    assert v.map_get("m", [b"a"], [b"u"], b"") == [None]
    assert v.value_get("r", [b"a"], b"") == [None]
    assert h.commit(1, {0: 1}).applied_entries == 1


def test_staged_list_appends_are_limited_by_the_list_size_limit(make_harness: Callable[..., EpochHarness]) -> None:
    h = make_harness(limits=StateLimits(max_list_elements=3))
    v = h.view(1, 0, 1)
    v.list_append("l", [b"a", b"a"], [b"1", b"2"], b"")
    with pytest.raises(SizeLimitError, match="grow to 4 elements"):
        v.list_append("l", [b"a", b"a"], [b"3", b"4"], b"")
    assert v.list_get("l", [b"a"], b"") == [[b"1", b"2"]]


def test_keys_of_another_subtask_are_refused_as_stale_routing(make_harness: Callable[..., EpochHarness]) -> None:
    h = make_harness(deploy=False)
    h.deploy(0, KeyGroupRange(0, MP // 2 - 1), parallelism=2)
    foreign = next(b"k%d" % i for i in range(1000) if key_group(b"k%d" % i, MP) >= MP // 2)
    v = h.view(1, 0, 1)
    with pytest.raises(StaleRoutingError, match="does not own"):
        v.value_put("v", [foreign], [b"x"], b"")
    with pytest.raises(StaleRoutingError):
        v.value_get("v", [foreign], b"")
    assert not h.staging_dir().exists()


@pytest.mark.parametrize(
    "context",
    [
        common_pb2.EpochContext(epoch=-1, partition=0, attempt=0),
        common_pb2.EpochContext(epoch=0, partition=-1, attempt=0),
        common_pb2.EpochContext(epoch=0, partition=0, attempt=-5),
    ],
)
def test_a_negative_epoch_context_is_refused(harness: EpochHarness, context: common_pb2.EpochContext) -> None:
    with pytest.raises(InvalidArgumentError, match="EpochContext"):
        harness.manager.view(harness.slot(), context)


def test_task_attempt_prefixes_order_by_epoch_partition_attempt() -> None:
    attempts = [
        TaskAttempt(2, 0, 0),
        TaskAttempt(1, 5, 9),
        TaskAttempt(1, 5, 1),
        TaskAttempt(1, 0, 1 << 40),
        TaskAttempt(0, 7, 7),
    ]
    ordered = sorted(attempts, key=lambda a: a.prefix)
    assert ordered == sorted(attempts, key=lambda a: (a.epoch, a.partition, a.attempt))
    assert len({a.prefix for a in attempts}) == len(attempts)


def test_release_drops_the_slot_staging(harness: EpochHarness) -> None:
    old = harness.view(1, 0, 1)
    old.value_put("v", [b"a"], [b"staged"], b"")
    assert harness.staging_dir().exists()

    harness.release()
    assert harness.manager.sweep() == 1

    assert not harness.staging_dir().exists()
    with pytest.raises(UnavailableError) as info:
        old.value_put("v", [b"a"], [b"late"], b"")
    assert info.value.reason is Reason.SHUTTING_DOWN
    with pytest.raises(UnavailableError):
        old.value_get("v", [b"a"], b"")


def test_a_redeployed_slot_starts_with_empty_staging(harness: EpochHarness) -> None:
    old = harness.view(1, 0, 1)
    old.value_put("v", [b"a"], [b"staged-before-redeploy"], b"")
    old.list_append("l", [b"a"], [b"x"], b"")
    harness.release()
    harness.deploy()  # same subtask, new deployment (a restore or a restart of the job)

    fresh = harness.view(1, 0, 1)

    assert fresh.value_get("v", [b"a"], b"") == [None]
    assert fresh.list_get("l", [b"a"], b"") == [[]]
    with pytest.raises(UnavailableError):
        old.value_put("v", [b"a"], [b"late"], b"")
    fresh.value_put("v", [b"b"], [b"after"], b"")
    assert harness.commit(1, {0: 1}).applied_entries == 1
    assert harness.backend().value_get("v", [b"a", b"b"], b"") == [None, b"after"]


def test_a_commit_sweeps_the_staging_of_released_slots(make_harness: Callable[..., EpochHarness]) -> None:
    h = make_harness(deploy=False)
    h.deploy(0, KeyGroupRange(0, MP // 2 - 1), parallelism=2)
    h.deploy(1, KeyGroupRange(MP // 2, MP - 1), parallelism=2)
    k1 = next(b"k%d" % i for i in range(1000) if key_group(b"k%d" % i, MP) >= MP // 2)
    h.view(1, 0, 1, subtask_index=1).value_put("v", [k1], [b"x"], b"")
    h.release(1)

    h.commit(1, {0: 1})

    assert not h.staging_dir(1).exists()
    assert h.committed_epoch(0) == 1


def test_closing_the_manager_drops_every_staging(harness: EpochHarness) -> None:
    v = harness.view(1, 0, 1)
    v.value_put("v", [b"a"], [b"x"], b"")
    harness.manager.close()
    assert not harness.staging_dir().exists()
    with pytest.raises(UnavailableError):
        v.value_put("v", [b"a"], [b"x"], b"")
    with pytest.raises(UnavailableError, match="shutting down"):
        harness.view(1, 0, 2)


def test_a_restoring_slot_refuses_epoch_calls_and_commits_as_unavailable(harness: EpochHarness) -> None:
    slot = harness.slot()
    harness.release()
    restoring = harness.table.reserve(slot.subtask, slot.operator, slot.key_groups, MP, 0, 2, "", False)
    with pytest.raises(UnavailableError, match="RESTORING"):
        harness.manager.view(restoring, TaskAttempt(1, 0, 1))
    with pytest.raises(UnavailableError, match="RESTORING"):
        harness.commit(1, {0: 1})


def test_staging_store_reopens_empty_and_scans_in_chunks(tmp_path: Path) -> None:
    store = StagingStore(tmp_path / "s", "test")
    wb = rocksdict.WriteBatch(raw_mode=True)
    for i in range(2500):
        wb.put(b"%05d" % i, b"v")
    store.write(wb)
    assert [k for k, _ in store.scan(b"00100", b"02200")] == [b"%05d" % i for i in range(100, 2200)]
    store.delete_range(b"00000", b"01000")
    assert store.get([b"00999", b"01000"]) == [None, b"v"]
    store.close(drop=False)
    assert (tmp_path / "s" / "CURRENT").exists()
    with pytest.raises(UnavailableError):
        store.get([b"x"])
    # Staging never outlives a deployment: opening the same path starts empty.
    again = StagingStore(tmp_path / "s", "test")
    assert again.is_empty()
    again.close()
    assert not (tmp_path / "s").exists()


def test_an_unwritable_staging_directory_fails_with_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    with pytest.raises(StorageError, match="cannot open the epoch staging database of job/op/0") as info:
        StagingStore(blocker / "staging", "job/op/0")
    assert info.value.reason is Reason.STORAGE


def _wait_until(predicate: Callable[[], bool]) -> bool:
    # Bounded polling on observable state, never a fixed sleep.
    done = threading.Event()
    for _ in range(10_000):
        if predicate():
            return True
        done.wait(0.001)
    return False


def test_exclusive_holder_waits_for_shared_holders_and_blocks_new_ones() -> None:
    lock = SharedExclusiveLock()
    order: list[str] = []
    exclusive_in = threading.Event()

    def exclusive() -> None:
        with lock.exclusive():
            order.append("exclusive")
            exclusive_in.set()

    def late_reader() -> None:
        with lock.shared():
            order.append("late shared")

    with lock.shared():
        writer = threading.Thread(target=exclusive)
        writer.start()
        assert _wait_until(lambda: lock._waiting == 1)
        reader = threading.Thread(target=late_reader)
        reader.start()
        assert not exclusive_in.is_set()
        order.append("first shared done")
    writer.join(timeout=10)
    reader.join(timeout=10)
    assert order == ["first shared done", "exclusive", "late shared"]
