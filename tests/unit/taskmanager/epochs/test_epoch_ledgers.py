"""Numbered write requests: a slot stages each sequence number once, and commits check the winners' ledgers.

Every commit refusal (routing version, gap, stale epoch, ledger) must apply nothing on any slot of
the job on this TaskManager, and leave the staged writes for a corrected commit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from keyedstate.common._proto.v1 import common_pb2
from keyedstate.common._proto.v1 import taskmanager_pb2 as tm_pb
from keyedstate.common.batches import Winner
from keyedstate.common.descriptors import OperatorSpec
from keyedstate.common.errors import (
    EpochConflictError,
    EpochGapError,
    InvalidArgumentError,
    Reason,
    WrongStateKindError,
)
from keyedstate.common.ids import KeyGroupRange, SubtaskId
from keyedstate.common.keygroups import key_group
from keyedstate.taskmanager.epochs import EpochTransaction
from keyedstate.taskmanager.rpc.task_executor import commit_epoch
from keyedstate.taskmanager.slots import Slot
from keyedstate.taskmanager.state import create_backend
from tests.unit.taskmanager.epochs.conftest import JOB, MP, OP, ROUTING_VERSION, STATES, VEC, EpochHarness, vec

EPOCH = 0
HALF = MP // 2


def numbered(
    h: EpochHarness, sequence: int, *, epoch: int = EPOCH, partition: int = 0, attempt: int = 1, subtask: int = 0
) -> EpochTransaction:
    """The view of one write request numbered ``sequence`` (0: unnumbered)."""
    ctx = common_pb2.EpochContext(epoch=epoch, partition=partition, attempt=attempt, sequence=sequence)
    return h.manager.view(h.slot(subtask), ctx)


def winner(partition: int, attempt: int, ledger: dict[tuple[str, int], int] | None) -> common_pb2.PartitionAttempt:
    w = common_pb2.PartitionAttempt(partition=partition, attempt=attempt, has_ledger=ledger is not None)
    for (op, index), n in sorted((ledger or {}).items()):
        w.writes.add(operator_id=op, subtask_index=index, requests=n)
    return w


def commit(
    h: EpochHarness,
    *winners: common_pb2.PartitionAttempt,
    epoch: int = EPOCH,
    prepare: bool = False,
    routing_version: int = ROUTING_VERSION,
) -> tm_pb.EpochCommitResponse:
    return commit_epoch(
        h.manager,
        tm_pb.EpochCommitRequest(
            job_id=JOB,
            epoch=epoch,
            winners=list(winners),
            routing_version=routing_version,
            prepare=prepare,
        ),
    )


def two_slots(h: EpochHarness) -> dict[int, list[bytes]]:
    """Subtasks 0 and 1 of the job (half the key groups each); a few keys of each."""
    h.deploy(0, KeyGroupRange(0, HALF - 1), parallelism=2)
    h.deploy(1, KeyGroupRange(HALF, MP - 1), parallelism=2)
    keys: dict[int, list[bytes]] = {0: [], 1: []}
    for i in range(100):
        k = b"key-%d" % i
        keys[0 if key_group(k, MP) < HALF else 1].append(k)
    return {s: ks[:3] for s, ks in keys.items()}


def staged(h: EpochHarness, subtask: int = 0, *, epoch: int = EPOCH, partition: int = 0, attempt: int = 1) -> int:
    return h.manager.slot_epochs(h.slot(subtask)).staged_requests(epoch, partition, attempt)


def reduced(values: list[bytes | None]) -> list[tuple[Any, ...] | None]:
    return [VEC.unpack(v) if v is not None else None for v in values]


# -- one request staged once ------------------------------------------------------------------
# Each case: the requests in order (sequence, write), then a late retry of an earlier sequence
# number (same payload, as a client retries), then what reads must show (in the view and, after
# the commit, in committed state).
def _value_put(v: EpochTransaction, value: bytes) -> None:
    v.value_put("v", [b"k"], [value], b"")


def _value(r: Any) -> Any:
    return r.value_get("v", [b"k"], b"")


def _list(r: Any) -> Any:
    return r.list_get("l", [b"k"], b"")


def _map(r: Any) -> Any:
    return r.map_get("m", [b"k"], [b"uk"], b"")


def _reduced(r: Any) -> Any:
    return reduced(r.value_get("r", [b"k"], b""))


Request = tuple[int, Callable[[EpochTransaction], Any]]
CASES: dict[str, tuple[list[Request], Request, Callable[[Any], Any], Any]] = {
    "ValuePut": (
        [(1, lambda v: _value_put(v, b"first")), (2, lambda v: _value_put(v, b"second"))],
        (1, lambda v: _value_put(v, b"first")),
        _value,
        [b"second"],
    ),
    "Clear": (
        [
            (1, lambda v: _value_put(v, b"a")),
            (2, lambda v: v.clear("v", [b"k"], b"")),
            (3, lambda v: _value_put(v, b"c")),
        ],
        (2, lambda v: v.clear("v", [b"k"], b"")),
        _value,
        [b"c"],
    ),
    "Reduce": (
        [(1, lambda v: v.reduce("r", [b"k"], [vec(1, 2.0, 3)], b"", False))],
        (1, lambda v: v.reduce("r", [b"k"], [vec(1, 2.0, 3)], b"", False)),
        _reduced,
        [(1, 2.0, 3)],
    ),
    "ListAppend": (
        [
            (1, lambda v: v.list_append("l", [b"k"], [b"a"], b"")),
            (2, lambda v: v.list_append("l", [b"k"], [b"b"], b"")),
        ],
        (1, lambda v: v.list_append("l", [b"k"], [b"a"], b"")),
        _list,
        [[b"a", b"b"]],
    ),
    "ListUpdate": (
        [
            (1, lambda v: v.list_update("l", [b"k", b"k"], [b"x", b"y"], b"")),
            (2, lambda v: v.list_append("l", [b"k"], [b"z"], b"")),
        ],
        (1, lambda v: v.list_update("l", [b"k", b"k"], [b"x", b"y"], b"")),
        _list,
        [[b"x", b"y", b"z"]],
    ),
    "MapPut": (
        [
            (1, lambda v: v.map_put("m", [b"k"], [b"uk"], [b"1"], b"")),
            (2, lambda v: v.map_put("m", [b"k"], [b"uk"], [b"2"], b"")),
        ],
        (1, lambda v: v.map_put("m", [b"k"], [b"uk"], [b"1"], b"")),
        _map,
        [b"2"],
    ),
    "MapRemove": (
        [
            (1, lambda v: v.map_put("m", [b"k"], [b"uk"], [b"1"], b"")),
            (2, lambda v: v.map_remove("m", [b"k"], [b"uk"], b"")),
            (3, lambda v: v.map_put("m", [b"k"], [b"uk"], [b"3"], b"")),
        ],
        (2, lambda v: v.map_remove("m", [b"k"], [b"uk"], b"")),
        _map,
        [b"3"],
    ),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_a_retried_request_is_staged_once_and_counted_once(harness: EpochHarness, kind: str) -> None:
    requests, (retry_seq, retry), read, expected = CASES[kind]
    for seq, write in requests:
        write(numbered(harness, seq))
    retry(numbered(harness, retry_seq))  # its first answer was lost; the client sends it again

    assert staged(harness) == len(requests)
    assert read(numbered(harness, 0)) == expected
    # The ledger counts each request once: exactly len(requests) were acknowledged.
    response = commit(harness, winner(0, 1, {(OP, 0): len(requests)}))
    assert response.committed_epoch == EPOCH
    assert read(harness.backend()) == expected


def test_a_retried_reduce_answers_the_value_as_it_is_and_applies_once(harness: EpochHarness) -> None:
    harness.fill_to(EPOCH)
    harness.backend().reduce("r", [b"k"], [vec(10, 1.0, 1)], b"", False)  # committed before the epoch
    epoch = EPOCH + 1
    first = numbered(harness, 1, epoch=epoch).reduce("r", [b"k"], [vec(1, 5.0, 0)], b"", True)
    assert reduced(first) == [(11, 5.0, 0)]  # type: ignore[arg-type]
    again = numbered(harness, 1, epoch=epoch).reduce("r", [b"k"], [vec(1, 5.0, 0)], b"", True)
    assert reduced(again) == [(11, 5.0, 0)]  # type: ignore[arg-type]  # not (12, ...): not reduced twice
    numbered(harness, 2, epoch=epoch).reduce("r", [b"k"], [vec(1, 7.0, 0)], b"", False)
    late = numbered(harness, 1, epoch=epoch).reduce("r", [b"k"], [vec(1, 5.0, 0)], b"", True)
    assert reduced(late) == [(12, 7.0, 0)]  # type: ignore[arg-type]  # the value now, request 2 included

    commit(harness, winner(0, 1, {(OP, 0): 2}), epoch=epoch)
    assert reduced(harness.backend().value_get("r", [b"k"], b"")) == [(12, 7.0, 0)]


def test_unnumbered_writes_are_neither_deduplicated_nor_counted(harness: EpochHarness) -> None:
    numbered(harness, 0).list_append("l", [b"k"], [b"a"], b"")
    numbered(harness, 0).list_append("l", [b"k"], [b"a"], b"")
    assert staged(harness) == 0
    assert numbered(harness, 0).list_get("l", [b"k"], b"") == [[b"a", b"a"]]
    with pytest.raises(
        EpochConflictError, match="had 2 write request\\(s\\) acknowledged by job-1/op/0, but 0 are staged here"
    ):
        commit(harness, winner(0, 1, {(OP, 0): 2}))
    commit(harness, winner(0, 1, {(OP, 0): 0}))
    assert harness.backend().list_get("l", [b"k"], b"") == [[b"a", b"a"]]


def test_sequence_numbers_belong_to_one_attempt_of_one_epoch(harness: EpochHarness) -> None:
    _value_put(numbered(harness, 1, attempt=1), b"attempt-1")
    _value_put(numbered(harness, 1, attempt=2), b"attempt-2")  # another attempt's request 1: staged
    _value_put(numbered(harness, 1, partition=3, attempt=1), b"partition-3")
    _value_put(numbered(harness, 1, epoch=EPOCH + 1), b"next-epoch")
    assert [
        staged(harness, attempt=1),
        staged(harness, attempt=2),
        staged(harness, partition=3),
        staged(harness, epoch=EPOCH + 1),
    ] == [1, 1, 1, 1]
    assert _value(numbered(harness, 0, attempt=2)) == [b"attempt-2"]
    assert _value(numbered(harness, 0, partition=3)) == [b"partition-3"]


def test_a_refused_request_leaves_no_mark_so_its_retry_is_staged(harness: EpochHarness) -> None:
    with pytest.raises(WrongStateKindError):
        numbered(harness, 1).value_put("l", [b"k"], [b"x"], b"")  # a list state: refused before staging
    assert staged(harness) == 0
    _value_put(numbered(harness, 1), b"fixed")
    assert staged(harness) == 1
    assert _value(numbered(harness, 0)) == [b"fixed"]


def test_a_negative_sequence_number_is_refused(harness: EpochHarness) -> None:
    with pytest.raises(InvalidArgumentError, match="EpochContext.sequence must be 0 or more, got -1"):
        _value_put(numbered(harness, -1), b"x")
    assert staged(harness) == 0


# -- ledgers ----------------------------------------------------------------------------------
def _three_requests(h: EpochHarness) -> None:
    for seq in (1, 2, 3):
        numbered(h, seq).list_append("l", [b"k"], [b"e%d" % seq], b"")


def test_a_ledger_that_differs_from_what_was_staged_is_refused_and_applies_nothing(harness: EpochHarness) -> None:
    _three_requests(harness)
    for claimed in (0, 1, 2, 4, 1000):
        with pytest.raises(EpochConflictError) as info:
            commit(harness, winner(0, 1, {(OP, 0): claimed}))
        assert info.value.reason is Reason.EPOCH_CONFLICT
        assert info.value.message == (
            f"partition 0 attempt 1 of epoch 0 had {claimed} write request(s) acknowledged by job-1/op/0, but 3 are "
            "staged here: its writes did not all reach this slot (routed to an old owner, or lost with a restarted "
            "slot); the batch must run again"
        )
        with pytest.raises(EpochConflictError):
            commit(harness, winner(0, 1, {(OP, 0): claimed}), prepare=True)
    assert harness.committed_epoch() == -1
    assert harness.backend().list_get("l", [b"k"], b"") == [[]]
    # The staged writes are kept: the right ledger commits them.
    commit(harness, winner(0, 1, {(OP, 0): 3}))
    assert harness.backend().list_get("l", [b"k"], b"") == [[b"e1", b"e2", b"e3"]]


def test_a_ledger_naming_a_slot_the_writes_did_not_reach_is_refused_on_both_slots(
    make_harness: Callable[..., EpochHarness],
) -> None:
    h = make_harness(deploy=False)
    keys = two_slots(h)
    numbered(h, 1, subtask=0).value_put("v", keys[0], [b"x"] * 3, b"")
    # The task thinks subtask 1 acknowledged its request (the routing moved): neither slot agrees.
    with pytest.raises(
        EpochConflictError, match="had 0 write request\\(s\\) acknowledged by job-1/op/0, but 1 are staged here"
    ):
        commit(h, winner(0, 1, {(OP, 1): 1}))
    assert [h.committed_epoch(0), h.committed_epoch(1)] == [-1, -1]
    with pytest.raises(
        EpochConflictError, match="had 1 write request\\(s\\) acknowledged by job-1/op/1, but 0 are staged here"
    ):
        h.manager.slot_epochs(h.slot(1)).prepare(EPOCH, {0: Winner(0, 1, {(OP, 1): 1})}, ROUTING_VERSION)
    assert h.backend(0).value_get("v", keys[0], b"") == [None] * 3
    commit(h, winner(0, 1, {(OP, 0): 1, (OP, 1): 0}))
    assert h.backend(0).value_get("v", keys[0], b"") == [b"x"] * 3
    assert [h.committed_epoch(0), h.committed_epoch(1)] == [EPOCH, EPOCH]


def test_a_winner_without_a_ledger_is_not_counted_and_other_operators_entries_are_ignored(
    harness: EpochHarness,
) -> None:
    _three_requests(harness)
    numbered(harness, 1, partition=1, attempt=7).value_put("v", [b"p1"], [b"p1"], b"")
    commit(
        harness,
        winner(0, 1, None),  # has_ledger False: whatever it staged is applied
        winner(1, 7, {(OP, 0): 1, ("another-operator", 0): 99, (OP, 5): 12}),
    )
    assert harness.backend().list_get("l", [b"k"], b"") == [[b"e1", b"e2", b"e3"]]
    assert harness.backend().value_get("v", [b"p1"], b"") == [b"p1"]


def test_a_losers_requests_are_not_counted_for_the_winner(harness: EpochHarness) -> None:
    numbered(harness, 1, attempt=1).value_put("v", [b"k"], [b"winner"], b"")
    for seq in (1, 2, 3):
        numbered(harness, seq, attempt=2).value_put("v", [b"k"], [b"loser"], b"")
    commit(harness, winner(0, 1, {(OP, 0): 1}))
    assert harness.backend().value_get("v", [b"k"], b"") == [b"winner"]


# -- refusals apply nothing on any slot of the TaskManager -------------------------------------
def redeploy(h: EpochHarness, subtask_index: int, key_groups: KeyGroupRange, routing_version: int) -> Slot:
    """Release a slot and deploy the subtask again under another routing version (a restore or rescale)."""
    h.release(subtask_index)
    subtask = SubtaskId(JOB, OP, subtask_index)
    index = next(i for i in range(h.table.num_slots) if all(s.index != i for s in h.table.all()))
    slot = h.table.reserve(subtask, OperatorSpec(OP, 2, STATES), key_groups, MP, index, routing_version, "", False)
    backend = create_backend(
        h.kind,
        subtask,
        key_groups,
        MP,
        STATES,
        local_dir=h.work / f"v{routing_version}",
        limits=h.limits,
        clock=h.clock,
    )
    h.table.activate(slot, backend)
    return slot


def _stage_on_both(h: EpochHarness, keys: dict[int, list[bytes]], epoch: int = EPOCH) -> None:
    for subtask in (0, 1):
        numbered(h, 1, subtask=subtask, epoch=epoch).value_put("v", keys[subtask], [b"new"] * 3, b"")


def _nothing_applied_on_subtask_0(h: EpochHarness, keys: dict[int, list[bytes]], epoch: int = EPOCH) -> None:
    assert h.committed_epoch(0) == epoch - 1
    assert h.backend(0).value_get("v", keys[0], b"") == [None] * 3
    # Still staged, ready for a commit that can be applied.
    assert numbered(h, 0, subtask=0, epoch=epoch).value_get("v", keys[0], b"") == [b"new"] * 3


LEDGER: dict[tuple[str, int], int] = {(OP, 0): 1, (OP, 1): 1}


def test_a_ledger_refused_by_the_last_slot_applies_nothing_on_the_first(
    make_harness: Callable[..., EpochHarness],
) -> None:
    h = make_harness(deploy=False)
    keys = two_slots(h)
    _stage_on_both(h, keys)
    with pytest.raises(EpochConflictError, match="acknowledged by job-1/op/1, but 1 are staged here"):
        commit(h, winner(0, 1, {(OP, 0): 1, (OP, 1): 2}))
    _nothing_applied_on_subtask_0(h, keys)
    assert h.committed_epoch(1) == -1
    commit(h, winner(0, 1, LEDGER))
    assert h.backend(1).value_get("v", keys[1], b"") == [b"new"] * 3


def test_a_slot_of_another_routing_version_refuses_the_commit_and_nothing_applies(
    make_harness: Callable[..., EpochHarness],
) -> None:
    h = make_harness(deploy=False)
    keys = two_slots(h)
    _stage_on_both(h, keys)
    redeploy(h, 1, KeyGroupRange(HALF, MP - 1), ROUTING_VERSION + 1)
    for prepare in (True, False):
        with pytest.raises(EpochConflictError) as info:
            commit(h, winner(0, 1, {(OP, 0): 1}), prepare=prepare)
        assert info.value.message == (
            f"job-1/op/1 is deployed under routing version {ROUTING_VERSION + 1}, the commit of epoch 0 is for version "
            f"{ROUTING_VERSION}: the job was redeployed while the batch ran; run it again"
        )
    _nothing_applied_on_subtask_0(h, keys)
    # The new deployment's version is refused by the old slot the same way.
    with pytest.raises(
        EpochConflictError,
        match="job-1/op/0 is deployed under routing version 1, the commit of epoch 0 is for version 2",
    ):
        commit(h, winner(0, 1, {(OP, 0): 1}), routing_version=ROUTING_VERSION + 1)
    _nothing_applied_on_subtask_0(h, keys)


def test_a_slot_holding_another_epoch_refuses_the_commit_and_nothing_applies(
    make_harness: Callable[..., EpochHarness],
) -> None:
    h = make_harness(deploy=False)
    keys = two_slots(h)
    commit(h, winner(0, 1, {}))
    # Subtask 0 alone moves on to epoch 1 (a half-applied commit the JobManager failed over from).
    h.manager.slot_epochs(h.slot(0)).commit(EPOCH + 1, {}, ROUTING_VERSION)
    _stage_on_both(h, keys, epoch=EPOCH + 2)
    with pytest.raises(EpochGapError) as gap:
        commit(h, winner(0, 1, LEDGER), epoch=EPOCH + 2)
    assert gap.value.reason is Reason.EPOCH_GAP
    assert gap.value.message == (
        "job-1/op/1 holds epoch 0, so epoch 2 cannot be applied on top of it: epochs 1..1 are missing from its state "
        "(an older checkpoint was restored?)"
    )
    _nothing_applied_on_subtask_0(h, keys, epoch=EPOCH + 2)
    assert h.committed_epoch(1) == EPOCH
    # Epoch 1 again: subtask 0 holds it already (a no-op there), subtask 1 takes it.
    commit(h, winner(0, 1, {}), epoch=EPOCH + 1)
    assert [h.committed_epoch(0), h.committed_epoch(1)] == [EPOCH + 1, EPOCH + 1]


def test_a_stale_epoch_is_refused_and_an_applied_one_is_a_no_op(harness: EpochHarness) -> None:
    _value_put(numbered(harness, 1), b"e0")
    commit(harness, winner(0, 1, {(OP, 0): 1}))
    _value_put(numbered(harness, 1, epoch=1), b"e1")
    commit(harness, winner(0, 1, {(OP, 0): 1}), epoch=1)
    with pytest.raises(
        EpochConflictError, match="^job-1/op/0 already holds epoch 1; epoch 0 is stale and must not be applied again$"
    ):
        commit(harness, winner(0, 1, {(OP, 0): 1}))
    again = commit(harness, winner(0, 1, {(OP, 0): 5}), epoch=1)  # already applied: the ledger is not checked again
    assert (again.committed_epoch, again.applied_entries) == (1, 0)
    assert _value(harness.backend()) == [b"e1"]


def test_prepare_answers_the_previous_epoch_and_applies_nothing(harness: EpochHarness) -> None:
    _three_requests(harness)
    response = commit(harness, winner(0, 1, {(OP, 0): 3}), prepare=True)
    assert response.committed_epoch == EPOCH - 1 and response.applied_entries == 0
    assert harness.committed_epoch() == -1
    assert harness.backend().list_get("l", [b"k"], b"") == [[]]
    assert staged(harness) == 3


def test_a_commit_naming_no_routing_version_is_refused(harness: EpochHarness) -> None:
    _three_requests(harness)
    for prepare in (True, False):
        with pytest.raises(
            InvalidArgumentError, match="^the commit of epoch 0 names no routing version; a commit must carry"
        ):
            commit(harness, winner(0, 1, {(OP, 0): 3}), prepare=prepare, routing_version=0)
    assert harness.committed_epoch() == -1
