"""Epoch commits and aborts: winners only, idempotence, fencing of stale attempts, atomicity, scale, races."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import rocksdict

from keyedstate.common._proto.v1 import taskmanager_pb2 as tm_pb
from keyedstate.common.errors import EpochConflictError, InvalidArgumentError, NotFoundError, Reason
from keyedstate.common.ids import JobId, KeyGroupRange
from keyedstate.common.keygroups import key_group
from keyedstate.taskmanager.epochs import EpochCommitError, EpochTransaction, records
from keyedstate.taskmanager.rpc.task_executor import commit_epoch
from keyedstate.taskmanager.state import StateLimits
from tests.unit.taskmanager.epochs.conftest import MP, VEC, EpochHarness, vec


def _stage_everything(h: EpochHarness, epoch: int, partition: int, attempt: int, tag: bytes) -> None:
    v = h.view(epoch, partition, attempt)
    v.value_put("v", [b"p%d" % partition, b"shared"], [tag, tag], b"")
    v.list_append("l", [b"p%d" % partition], [tag], b"")
    v.map_put("m", [b"p%d" % partition], [b"who"], [tag], b"")
    v.reduce("r", [b"total"], [vec(1, float(attempt), attempt)], b"", False)


def test_commit_applies_only_the_winning_attempt_of_each_named_partition(harness: EpochHarness) -> None:
    _stage_everything(harness, 3, 0, 1, b"p0-failed")
    _stage_everything(harness, 3, 0, 2, b"p0-winner")
    _stage_everything(harness, 3, 1, 3, b"p1-winner")
    _stage_everything(harness, 3, 1, 4, b"p1-speculative-loser")
    _stage_everything(harness, 3, 2, 5, b"p2-not-named")

    response = harness.commit(3, {0: 2, 1: 3})

    assert response.committed_epoch == 3
    assert response.applied_entries == 10  # 5 mutations per winner: 2 puts, an append, a map put, a reduce
    b = harness.backend()
    assert b.value_get("v", [b"p0", b"p1", b"p2"], b"") == [b"p0-winner", b"p1-winner", None]
    # Both partitions wrote the same key: applied in partition order.
    assert b.value_get("v", [b"shared"], b"") == [b"p1-winner"]
    assert b.list_get("l", [b"p0", b"p1", b"p2"], b"") == [[b"p0-winner"], [b"p1-winner"], []]
    assert b.map_get("m", [b"p0", b"p1", b"p2"], [b"who"] * 3, b"") == [b"p0-winner", b"p1-winner", None]
    # Reduce deltas of the two winners accumulate.
    assert [VEC.unpack(x) for x in b.value_get("r", [b"total"], b"")] == [(2, 3.0, 2)]  # type: ignore[arg-type]
    assert harness.committed_epoch() == 3
    store = harness.manager.slot_epochs(harness.slot()).store
    assert store is not None and store.is_empty()


def test_recommitting_an_epoch_applies_nothing_twice(harness: EpochHarness) -> None:
    v = harness.view(5, 0, 1)
    v.reduce("r", [b"k"], [vec(1, 1.0, 1)], b"", False)
    v.list_append("l", [b"k"], [b"once"], b"")
    assert harness.commit(5, {0: 1}).committed_epoch == 5

    again = harness.commit(5, {0: 1})
    assert (again.committed_epoch, again.applied_entries) == (5, 0)
    # An epoch older than the one the slot holds is stale: refused, never applied again.
    with pytest.raises(EpochConflictError, match="already holds epoch 5; epoch 4 is stale"):
        harness.commit(4, {0: 1})
    b = harness.backend()
    assert [VEC.unpack(x) for x in b.value_get("r", [b"k"], b"")] == [(1, 1.0, 1)]  # type: ignore[arg-type]
    assert b.list_get("l", [b"k"], b"") == [[b"once"]]


def test_a_commit_keeps_later_epochs_and_discards_earlier_ones(harness: EpochHarness) -> None:
    harness.view(2, 0, 1).value_put("v", [b"old"], [b"epoch-2-never-committed"], b"")
    harness.view(4, 0, 9).value_put("v", [b"next"], [b"epoch-4"], b"")
    harness.view(3, 0, 1).value_put("v", [b"now"], [b"epoch-3"], b"")

    harness.commit(3, {0: 1})
    assert harness.backend().value_get("v", [b"old", b"now", b"next"], b"") == [None, b"epoch-3", None]
    assert harness.view(4, 0, 9).value_get("v", [b"next"], b"") == [b"epoch-4"]

    # Epoch 2's writes were dropped, and naming them later is refused.
    with pytest.raises(EpochConflictError):
        harness.commit(2, {0: 1})
    harness.commit(4, {0: 9})
    assert harness.backend().value_get("v", [b"old", b"now", b"next"], b"") == [None, b"epoch-3", b"epoch-4"]
    assert harness.committed_epoch() == 4


def test_an_epoch_with_no_staged_writes_still_advances_the_committed_epoch(harness: EpochHarness) -> None:
    assert harness.committed_epoch() == -1
    response = harness.commit(0, {})
    assert (response.committed_epoch, response.applied_entries) == (0, 0)
    assert harness.committed_epoch() == 0
    # No write was staged, so no staging database was created.
    assert not harness.staging_dir().exists()


def test_abort_discards_the_epoch_and_lets_it_run_again(harness: EpochHarness) -> None:
    harness.backend().value_put("v", [b"a"], [b"committed"], b"")
    harness.view(1, 0, 1).value_put("v", [b"a", b"b"], [b"aborted", b"aborted"], b"")
    harness.view(1, 1, 2).list_append("l", [b"a"], [b"aborted"], b"")

    response = harness.commit(1, {}, abort=True)

    assert response.committed_epoch == -1
    assert harness.committed_epoch() == -1
    assert harness.backend().value_get("v", [b"a", b"b"], b"") == [b"committed", None]
    assert harness.view(1, 0, 1).value_get("v", [b"a", b"b"], b"") == [b"committed", None]
    assert harness.view(1, 1, 2).list_get("l", [b"a"], b"") == [[]]
    # The micro-batch runs again with new attempts and commits.
    harness.view(1, 0, 3).value_put("v", [b"b"], [b"rerun"], b"")
    assert harness.commit(1, {0: 3}).committed_epoch == 1
    assert harness.backend().value_get("v", [b"a", b"b"], b"") == [b"committed", b"rerun"]


def test_writes_for_a_committed_epoch_are_refused_and_stage_nothing(harness: EpochHarness) -> None:
    harness.view(5, 0, 1).value_put("v", [b"a"], [b"winner"], b"")
    harness.commit(5, {0: 1})
    zombie = harness.view(5, 0, 2)
    stale = harness.view(4, 3, 7)
    calls: list[Callable[[EpochTransaction], object]] = [
        lambda v: v.value_put("v", [b"a"], [b"late"], b""),
        lambda v: v.clear("v", [b"a"], b""),
        lambda v: v.reduce("r", [b"a"], [vec(1, 1.0, 1)], b"", True),
        lambda v: v.list_append("l", [b"a"], [b"late"], b""),
        lambda v: v.list_update("l", [b"a"], [b"late"], b""),
        lambda v: v.map_put("m", [b"a"], [b"u"], [b"late"], b""),
        lambda v: v.map_remove("m", [b"a"], [b"u"], b""),
    ]
    for view in (zombie, stale):
        for call in calls:
            with pytest.raises(EpochConflictError, match="already committed epoch 5") as info:
                call(view)
            assert info.value.reason is Reason.EPOCH_CONFLICT
    store = harness.manager.slot_epochs(harness.slot()).store
    assert store is not None and store.is_empty()
    # Reads of a stale attempt are allowed: they see committed state.
    assert zombie.value_get("v", [b"a"], b"") == [b"winner"]
    # The next epoch is open.
    harness.view(6, 0, 3).value_put("v", [b"a"], [b"next"], b"")
    harness.commit(6, {0: 3})
    assert harness.backend().value_get("v", [b"a"], b"") == [b"next"]


def test_a_failing_mutation_fails_the_commit_with_nothing_applied(make_harness) -> None:  # type: ignore[no-untyped-def]
    h: EpochHarness = make_harness(limits=StateLimits(max_list_elements=3))
    b = h.backend()
    b.list_append("l", [b"full", b"full"], [b"1", b"2"], b"")
    v = h.view(1, 0, 1)
    v.value_put("v", [b"k%d" % i for i in range(100)], [b"x"] * 100, b"")
    v.reduce("r", [b"sum"], [vec(1, 1.0, 1)], b"", False)
    # Two staged elements fit the limit on their own, but not on top of the committed two.
    v.list_append("l", [b"full", b"full"], [b"3", b"4"], b"")

    with pytest.raises(EpochCommitError, match="state.limits.list.max-elements") as info:
        h.commit(1, {0: 1})

    assert info.value.reason is Reason.SIZE_LIMIT
    assert b.value_get("v", [b"k0", b"k99"], b"") == [None, None]
    assert b.value_get("r", [b"sum"], b"") == [None]
    assert b.list_get("l", [b"full"], b"") == [[b"1", b"2"]]
    assert h.committed_epoch() == 0  # still the epoch before it
    # The staged writes are kept (the commit can be retried) until the epoch is aborted.
    assert v.value_get("v", [b"k0"], b"") == [b"x"]
    h.commit(1, {}, abort=True)
    assert v.value_get("v", [b"k0"], b"") == [None]
    h.view(1, 0, 2).value_put("v", [b"k0"], [b"retried"], b"")
    assert h.commit(1, {0: 2}).committed_epoch == 1
    assert b.value_get("v", [b"k0"], b"") == [b"retried"]


def test_a_corrupt_staged_record_fails_the_commit_cleanly(harness: EpochHarness) -> None:
    v = harness.view(1, 0, 1)
    v.value_put("v", [b"good"], [b"x"], b"")
    store = harness.manager.slot_epochs(harness.slot()).store
    assert store is not None
    # A value record with an unknown tag, next to the good one.
    bad_key = records.state_prefix(v.attempt.prefix, 0) + b"\x00\x05\x03bad\x00"
    wb = rocksdict.WriteBatch(raw_mode=True)
    wb.put(bad_key, b"Zjunk")
    store.write(wb)

    with pytest.raises(EpochCommitError, match="malformed record") as info:
        harness.commit(1, {0: 1})
    assert info.value.reason is Reason.INTERNAL
    assert harness.backend().value_get("v", [b"good"], b"") == [None]
    assert harness.committed_epoch() == 0  # still the epoch before it


def test_commit_reaches_every_slot_of_the_job(make_harness) -> None:  # type: ignore[no-untyped-def]
    h: EpochHarness = make_harness(deploy=False)
    h.deploy(0, KeyGroupRange(0, MP // 2 - 1), parallelism=2)
    h.deploy(1, KeyGroupRange(MP // 2, MP - 1), parallelism=2)
    keys = [b"key-%d" % i for i in range(200)]
    by_subtask: dict[int, list[bytes]] = {0: [], 1: []}
    for k in keys:
        by_subtask[0 if key_group(k, MP) < MP // 2 else 1].append(k)
    assert by_subtask[0] and by_subtask[1]
    for subtask, ks in by_subtask.items():
        h.view(7, 0, 1, subtask).value_put("v", ks, ks, b"")
        h.view(7, 0, 2, subtask).value_put("v", ks, [b"loser"] * len(ks), b"")

    response = h.commit(7, {0: 1})

    assert (response.committed_epoch, response.applied_entries) == (7, 200)
    for subtask, ks in by_subtask.items():
        assert h.backend(subtask).value_get("v", ks, b"") == ks
        assert h.committed_epoch(subtask) == 7


def test_large_partition_is_staged_on_disk_and_committed_completely(harness: EpochHarness) -> None:
    n, batch = 200_000, 1000
    v = harness.view(1, 0, 1)
    for start in range(0, n, batch):
        keys = [b"user-%06d" % i for i in range(start, start + batch)]
        v.value_put("v", keys, keys, b"")
    v.reduce("r", [b"user-%06d" % i for i in range(1000)], [vec(1, 1.0, 1)] * 1000, b"", False)
    # Staged in the RocksDB staging database whatever the backend: committed state is empty.
    assert (harness.staging_dir() / "CURRENT").exists()
    assert harness.backend().value_get("v", [b"user-000000"], b"") == [None]

    response = harness.commit(1, {0: 1})

    assert response.applied_entries == n + 1000
    b = harness.backend()
    for start in range(0, n, 20 * batch):
        keys = [b"user-%06d" % i for i in range(start, start + batch)]
        assert b.value_get("v", keys, b"") == keys
    assert sum(1 for _ in b.scan_keys("v")) == n
    assert sum(1 for _ in b.scan_keys("r")) == 1000


def test_bad_commit_requests_are_refused(harness: EpochHarness) -> None:
    harness.view(1, 0, 1).value_put("v", [b"a"], [b"x"], b"")
    duplicate = tm_pb.EpochCommitRequest(job_id="job-1", epoch=1)
    duplicate.winners.add(partition=0, attempt=1)
    duplicate.winners.add(partition=0, attempt=2)
    with pytest.raises(InvalidArgumentError, match="partition 0 has two winning attempts"):
        commit_epoch(harness.manager, duplicate)
    negative = tm_pb.EpochCommitRequest(job_id="job-1", epoch=1)
    negative.winners.add(partition=-1, attempt=1)
    with pytest.raises(InvalidArgumentError, match="must be >= 0"):
        commit_epoch(harness.manager, negative)
    with pytest.raises(InvalidArgumentError, match="epoch must be >= 0"):
        harness.manager.commit_epoch(JobId("job-1"), -1, {})
    with pytest.raises(InvalidArgumentError, match="invalid job id"):
        harness.manager.commit_epoch(JobId("../etc"), 1, {})
    with pytest.raises(NotFoundError, match="hosts no slot of job 'other'") as info:
        harness.manager.commit_epoch(JobId("other"), 1, {})
    assert info.value.reason is Reason.UNKNOWN_JOB
    # Nothing of that reached the state.
    assert harness.committed_epoch() == -1
    assert harness.view(1, 0, 1).value_get("v", [b"a"], b"") == [b"x"]


def test_losing_attempts_racing_the_commit_never_reach_committed_state(harness: EpochHarness) -> None:
    winner = harness.view(1, 0, 1)
    keys = [b"k%03d" % i for i in range(100)]
    winner.value_put("v", keys, [b"winner"] * 100, b"")
    winner.reduce("r", [b"sum"], [vec(1, 1.0, 1)], b"", False)
    writing = [threading.Event() for _ in range(4)]

    def loser(n: int) -> tuple[int, int]:
        view = harness.view(1, 0, 2 + n)
        accepted = refused = 0
        for i in range(5_000):
            try:
                view.value_put("v", keys, [b"loser"] * 100, b"")
                view.reduce("r", [b"sum"], [vec(1000, 1000.0, -1000)], b"", False)
                view.list_append("l", [b"k%03d" % (i % 100)], [b"loser"], b"")
                accepted += 1
                writing[n].set()
            except EpochConflictError:
                refused += 1
                break
        return accepted, refused

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(loser, n) for n in range(4)]
        # Commit while every loser is in the middle of writing.
        assert all(e.wait(timeout=30) for e in writing)
        response = harness.commit(1, {0: 1})
        outcomes = [f.result(timeout=60) for f in futures]

    assert response.committed_epoch == 1
    # Every loser had writes staged before the commit and was fenced off by it.
    assert all(accepted >= 1 and refused == 1 for accepted, refused in outcomes), outcomes
    b = harness.backend()
    assert b.value_get("v", keys, b"") == [b"winner"] * 100
    assert [VEC.unpack(x) for x in b.value_get("r", [b"sum"], b"")] == [(1, 1.0, 1)]  # type: ignore[arg-type]
    assert b.list_get("l", keys, b"") == [[] for _ in keys]
    store = harness.manager.slot_epochs(harness.slot()).store
    assert store is not None and store.is_empty()


def test_staging_the_next_epoch_during_a_commit_is_kept(harness: EpochHarness) -> None:
    harness.view(1, 0, 1).value_put("v", [b"a"], [b"one"], b"")
    errors: list[BaseException] = []
    go = threading.Event()

    def next_epoch() -> None:
        view = harness.view(2, 0, 2)
        go.wait(timeout=10)
        try:
            for i in range(200):
                view.list_append("l", [b"a"], [b"%d" % i], b"")
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=next_epoch)
    t.start()
    go.set()
    harness.commit(1, {0: 1})
    t.join(timeout=60)
    assert not t.is_alive() and not errors
    harness.commit(2, {0: 2})
    assert harness.backend().list_get("l", [b"a"], b"") == [[b"%d" % i for i in range(200)]]
    assert harness.backend().value_get("v", [b"a"], b"") == [b"one"]


def test_keys_namespaces_and_user_keys_of_any_length_round_trip(harness: EpochHarness) -> None:
    long_key, long_ns = b"K" * 300, b"N" * 200  # multi-byte length varints in the staged keys
    keys = [b"", b"short", long_key]
    v = harness.view(1, 0, 1)
    v.value_put("v", keys, [b"v0", b"v1", b"v2"], [b"", long_ns, b"ns"])
    v.clear("m", [long_key], long_ns)
    # An empty user key must not be mistaken for the map's clear marker.
    v.map_put("m", [long_key, long_key], [b"", b"\x00"], [b"empty", b"zero"], long_ns)
    v.list_append("l", [long_key, b""], [b"e1", b"e2"], long_ns)
    assert v.map_get("m", [long_key, long_key, long_key], [b"", b"\x00", b"x"], long_ns) == [b"empty", b"zero", None]

    harness.commit(1, {0: 1})

    b = harness.backend()
    assert b.value_get("v", keys, [b"", long_ns, b"ns"]) == [b"v0", b"v1", b"v2"]
    assert list(b.map_scan("m", long_key, long_ns)) == [(b"", b"empty"), (b"\x00", b"zero")]
    assert b.list_get("l", [long_key, b""], long_ns) == [[b"e1"], [b"e2"]]


def test_concurrent_attempts_and_pipelined_calls_lose_no_staged_update(harness: EpochHarness) -> None:
    keys = [b"hot-%d" % i for i in range(20)]
    rounds = 40

    def work(partition: int, attempt: int) -> None:
        view = harness.view(1, partition, attempt)
        for i in range(rounds):
            view.reduce("r", keys, [vec(1, float(i), -i)] * len(keys), b"", False)
            view.list_append("l", keys, [b"%d-%d" % (partition, i)] * len(keys), b"")

    # Partitions 0-3 each have one attempt; partition 4's attempt is two threads at once, as a
    # client pipelining the requests of one batch would be.
    jobs = [(p, 10 + p) for p in range(4)] + [(4, 99), (4, 99)]
    with ThreadPoolExecutor(6) as pool:
        for f in [pool.submit(work, p, a) for p, a in jobs]:
            f.result(timeout=120)

    harness.commit(1, {0: 10, 1: 11, 2: 12, 3: 13, 4: 99})

    b = harness.backend()
    n = rounds * len(jobs)
    assert [VEC.unpack(x) for x in b.value_get("r", keys, b"")] == [(n, rounds - 1.0, -(rounds - 1))] * len(keys)  # type: ignore[arg-type]
    lists = b.list_get("l", keys, b"")
    assert all(len(lst) == n for lst in lists)
    # Partitions apply in order, and each attempt's appends keep their order.
    first = lists[0]
    assert first[: 4 * rounds] == [b"%d-%d" % (p, i) for p in range(4) for i in range(rounds)]
