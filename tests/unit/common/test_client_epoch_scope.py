"""The client's side of an epoch transaction: numbering, the ledger, and what counts as "not applied"."""

from __future__ import annotations

import threading
from typing import Any

import grpc

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common.client import EpochScope
from keyedstate.common.client._client import _not_applied
from keyedstate.common.client._epoch import as_scope
from keyedstate.common.errors import Reason
from keyedstate.common.rpc.convert import winner_to_proto
from keyedstate.common.rpc.status import REASON_KEY, ROUTING_VERSION_KEY


def scope(routing_version: int = 5) -> EpochScope:
    return EpochScope(pb.EpochContext(epoch=3, partition=2, attempt=77, sequence=99), routing_version=routing_version)


def test_sequence_numbers_count_from_1_per_slot() -> None:
    s = scope()
    assert [
        s.next_sequence("op", 0),
        s.next_sequence("op", 0),
        s.next_sequence("op", 1),
        s.next_sequence("other", 0),
    ] == [1, 2, 1, 1]
    assert s.context.sequence == 0  # the scope's own context is never a write request
    ctx = s.context_for(2)
    assert (ctx.epoch, ctx.partition, ctx.attempt, ctx.sequence) == (3, 2, 77, 2)


def test_the_ledger_counts_each_acknowledged_request_once_and_the_winner_carries_it() -> None:
    s = scope()
    for _ in range(3):
        s.next_sequence("op", 1)
    s.next_sequence("op", 0)
    s.acknowledged("op", 1, 1)
    s.acknowledged("op", 1, 1)  # the same request acknowledged twice (a retry's answer) counts once
    s.acknowledged("op", 1, 3)
    s.acknowledged("op", 0, 1)
    assert s.ledger() == {("op", 1): 2, ("op", 0): 1}
    assert s.unacknowledged() == {("op", 1): 1}
    w = winner_to_proto(s.winner())
    assert (w.partition, w.attempt, w.has_ledger) == (2, 77, True)
    assert [(e.operator_id, e.subtask_index, e.requests) for e in w.writes] == [("op", 0, 1), ("op", 1, 2)]


def test_a_winner_that_wrote_nothing_still_has_a_ledger() -> None:
    w = winner_to_proto(scope().winner())
    assert w.has_ledger and list(w.writes) == []


def test_a_bare_context_is_an_unpinned_unnumbered_scope() -> None:
    bare = as_scope(pb.EpochContext(epoch=1, partition=0, attempt=1))
    assert bare is not None and bare.routing_version == 0 and bare.numbered is False
    s = scope()
    assert as_scope(s) is s and as_scope(None) is None


def test_numbers_are_unique_across_threads() -> None:
    s = scope()
    got: list[int] = []
    lock = threading.Lock()

    def take() -> None:
        mine = [s.next_sequence("op", 0) for _ in range(500)]
        with lock:
            got.extend(mine)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(1, 4001))


class _RpcError(grpc.RpcError):
    """What a TaskManager's answer looks like to the client (the other side of a process boundary)."""

    def __init__(self, trailers: Any) -> None:
        self._trailers = trailers

    def trailing_metadata(self) -> Any:
        if isinstance(self._trailers, Exception):
            raise self._trailers
        return self._trailers


def test_only_a_reason_other_than_outcome_unknown_proves_a_call_was_not_applied() -> None:
    for reason in (Reason.STALE_ROUTING, Reason.LEASE_EXPIRED, Reason.UNAVAILABLE, Reason.SHUTTING_DOWN):
        assert _not_applied(_RpcError(((REASON_KEY, reason.value), (ROUTING_VERSION_KEY, "4")))) is True, reason
    assert _not_applied(_RpcError(((REASON_KEY, Reason.OUTCOME_UNKNOWN.value),))) is False
    assert _not_applied(_RpcError(((REASON_KEY, "UNAVAILABLE"), (REASON_KEY, Reason.OUTCOME_UNKNOWN.value)))) is False
    assert _not_applied(_RpcError(())) is False  # a bare transport error: the outcome is unknown
    assert _not_applied(_RpcError(None)) is False
    assert _not_applied(_RpcError(RuntimeError("no metadata on a cancelled call"))) is False
