"""Epoch transactions end to end over gRPC: client handles with an EpochContext, CommitEpoch on the TaskManagers.

Two in-process TaskManagers, four subtasks per operator, so every batch fans out over both
TaskManagers and every commit has to reach all of them.
"""

from __future__ import annotations

from typing import Any, cast

import grpc
import pytest

from keyedstate.common._proto.v1 import common_pb2
from keyedstate.common._proto.v1 import taskmanager_pb2 as tm_pb
from keyedstate.common._proto.v1 import taskmanager_pb2_grpc as tm_grpc
from keyedstate.common.client import (
    BatchAction,
    CheckpointStatus,
    EpochScope,
    ListState,
    MapState,
    ReducingState,
    StateClient,
    ValueState,
)
from keyedstate.common.descriptors import OperatorSpec, ReduceField, StateDescriptor, StateKind
from keyedstate.common.errors import EpochConflictError, Reason
from keyedstate.common.rpc.status import REASON_KEY
from tests.fixtures.cluster import InProcessCluster

JOB = "epochs"
OP = "counts"
OPERATORS = [
    OperatorSpec(
        OP,
        4,
        (
            StateDescriptor("total", StateKind.VALUE),
            StateDescriptor("events", StateKind.LIST),
            StateDescriptor("attrs", StateKind.MAP),
            StateDescriptor("sums", StateKind.REDUCING, reduce_fields=(ReduceField("n"), ReduceField("amount"))),
        ),
    ),
]


def _ctx(epoch: int, partition: int, attempt: int) -> common_pb2.EpochContext:
    return common_pb2.EpochContext(epoch=epoch, partition=partition, attempt=attempt)


def _commit(
    cluster: InProcessCluster, epoch: int, winners: dict[int, int], abort: bool = False
) -> list[tm_pb.EpochCommitResponse]:
    """CommitEpoch on every TaskManager, as the JobManager sends it (under the job's routing version)."""
    version = cluster.client().routing(JOB, refresh=True).version
    request = tm_pb.EpochCommitRequest(
        job_id=JOB,
        epoch=epoch,
        abort=abort,
        routing_version=version,
        winners=[common_pb2.PartitionAttempt(partition=p, attempt=a) for p, a in sorted(winners.items())],
    )
    responses = []
    for tm in cluster.taskmanagers:
        with grpc.insecure_channel(tm.address) as channel:
            responses.append(tm_grpc.TaskExecutorStub(channel).CommitEpoch(request, timeout=30))
    return responses


class _Handles:
    def __init__(self, client: StateClient, epoch: common_pb2.EpochContext | None) -> None:
        self.total: ValueState[Any, Any] = ValueState(client, JOB, OP, "total", value_serializer="int", epoch=epoch)
        self.events: ListState[Any, Any] = ListState(client, JOB, OP, "events", value_serializer="str", epoch=epoch)
        self.attrs: MapState[Any, Any, Any] = MapState(client, JOB, OP, "attrs", value_serializer="str", epoch=epoch)
        self.sums = ReducingState[str](client, JOB, OP, "sums", epoch=epoch)


@pytest.mark.parametrize("backend", ["rocksdb", "hashmap"])
def test_staged_writes_become_visible_only_for_the_winners_once_committed(inprocess_cluster: Any, backend: str) -> None:
    cluster = inprocess_cluster(taskmanagers=2, slots=2, backend=backend)
    client = cluster.client()
    routing = client.submit_job(JOB, OPERATORS)
    assert len(set(routing.operator(OP).addresses)) == 2
    keys = [f"user-{i}" for i in range(400)]
    committed = _Handles(client, None)
    committed.total.put_many(keys, list(range(400)))
    committed.events.append_many(keys[:10], ["seed"] * 10)
    committed.sums.add_many(keys[:10], [(1, 1)] * 10)

    winner = _Handles(client, _ctx(0, 0, 100))
    loser = _Handles(client, _ctx(0, 0, 101))
    other_partition = _Handles(client, _ctx(0, 1, 102))
    winner.total.put_many(keys[:200], [-i for i in range(200)])
    winner.events.append_many(keys[:10], ["e1"] * 10)
    winner.attrs.put_many(keys[:10], ["plan"] * 10, ["pro"] * 10)
    assert winner.sums.add_many(keys[:10], [(1, 5)] * 10, return_values=True) == [(2, 6)] * 10
    loser.total.put_many(keys, [999] * 400)
    loser.attrs.put_many(keys[:10], ["plan"] * 10, ["loser"] * 10)
    other_partition.total.put_many(keys[200:300], [7] * 100)

    # Read-your-writes for the attempt, isolation from the others, committed state untouched.
    assert winner.total.get_many(keys) == [-i for i in range(200)] + list(range(200, 400))
    assert winner.events.get_many(keys[:2]) == [["seed", "e1"]] * 2
    assert list(winner.events.scan(keys[0])) == ["seed", "e1"]
    assert dict(winner.attrs.items(keys[0])) == {"plan": "pro"}
    assert winner.sums.get_many(keys[:2]) == [(2, 6)] * 2
    assert loser.total.get_many(keys[:2]) == [999, 999]
    assert other_partition.total.get_many(keys[:2]) == [0, 1]
    assert committed.total.get_many(keys[:2]) == [0, 1]
    assert committed.attrs.get(keys[0], "plan") is None

    responses = _commit(cluster, 0, {0: 100, 1: 102})

    assert [r.committed_epoch for r in responses] == [0, 0]
    assert sum(r.applied_entries for r in responses) == 200 + 10 + 10 + 10 + 100
    assert committed.total.get_many(keys) == [-i for i in range(200)] + [7] * 100 + list(range(300, 400))
    assert committed.events.get_many(keys[:2]) == [["seed", "e1"]] * 2
    assert committed.attrs.get_many(keys[:10], ["plan"] * 10) == ["pro"] * 10
    assert committed.sums.get_many(keys[:10]) == [(2, 6)] * 10

    # The speculative loser comes back late: refused with ABORTED, never applied.
    with pytest.raises(EpochConflictError, match="already committed epoch 0"):
        loser.total.put_many(keys[:5], [5] * 5)
    subtask = client.subtask_of(JOB, OP, keys[0].encode())
    address = client.routing(JOB).operator(OP).addresses[subtask]
    request = tm_pb.KeyedRequest(
        target=tm_pb.StateTarget(
            job_id=JOB,
            operator_id=OP,
            subtask_index=subtask,
            state_name="total",
            routing_version=client.routing(JOB).version,
            epoch=_ctx(0, 0, 101),
        ),
        keys=[keys[0].encode()],
        values=[b"x"],
    )
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as info:
        tm_grpc.KeyedStateStub(channel).ValuePut(request, timeout=10)
    assert cast(grpc.Call, info.value).code() is grpc.StatusCode.ABORTED
    assert dict(cast(grpc.Call, info.value).trailing_metadata() or ())[REASON_KEY] == Reason.EPOCH_CONFLICT.value

    # A retried commit applies nothing twice.
    again = _commit(cluster, 0, {0: 100, 1: 102})
    assert [(r.committed_epoch, r.applied_entries) for r in again] == [(0, 0), (0, 0)]
    assert committed.sums.get_many(keys[:1]) == [(2, 6)]

    # Epochs are contiguous: one that skips an epoch is refused, whatever it staged.
    with pytest.raises(grpc.RpcError) as gap:
        _commit(cluster, 5, {})
    assert cast(grpc.Call, gap.value).code() is grpc.StatusCode.FAILED_PRECONDITION
    assert dict(cast(grpc.Call, gap.value).trailing_metadata() or ())[REASON_KEY] == Reason.EPOCH_GAP.value

    # An aborted epoch leaves no trace, and the micro-batch can run again.
    _Handles(client, _ctx(1, 0, 200)).total.put_many(keys[:3], [42] * 3)
    assert [r.committed_epoch for r in _commit(cluster, 1, {}, abort=True)] == [0, 0]
    assert committed.total.get_many(keys[:3]) == [0, -1, -2]
    _Handles(client, _ctx(1, 0, 201)).total.put_many(keys[:3], [43] * 3)
    assert [r.committed_epoch for r in _commit(cluster, 1, {0: 201})] == [1, 1]
    assert committed.total.get_many(keys[:3]) == [43] * 3


def test_commit_through_the_jobmanager_checkpoints_the_committed_epoch(inprocess_cluster: Any) -> None:
    cluster = inprocess_cluster(taskmanagers=2, slots=2)
    client = cluster.client()
    client.submit_job(JOB, OPERATORS)
    keys = [f"k{i}" for i in range(100)]
    start = client.begin_batch(JOB, "query-1", 0)
    assert (start.action, start.epoch, start.committed_epoch) == (BatchAction.RUN, 0, -1)
    scope = EpochScope(_ctx(start.epoch, 0, 1), routing_version=start.routing.version)
    ValueState[str, int](client, JOB, OP, "total", value_serializer="int", epoch=scope).put_many(keys, list(range(100)))

    response = client.commit_epoch(
        JOB,
        start.epoch,
        [scope.winner()],
        query_id="query-1",
        batch_id=0,
        expected_routing_version=start.routing.version,
        timeout_s=60,
    )

    assert response.committed_epoch == 0
    # Every slot's checkpoint reports the epoch the commit wrote into its metadata.
    assert response.checkpoint is not None
    assert response.checkpoint.status is CheckpointStatus.COMPLETED, response.checkpoint
    assert response.checkpoint.epoch == 0
    assert ValueState[str, int](client, JOB, OP, "total", value_serializer="int").get_many(keys) == list(range(100))
    info = client.job_info(JOB)
    assert (info.committed_epoch, info.durable_epoch) == (0, 0)
    assert [(e.query_id, e.offset, e.first_epoch) for e in info.lineage] == [("query-1", 0, 0)]
    # The batch again (a restarted driver): the state holds it, so it is only made durable.
    again = client.begin_batch(JOB, "query-1", 0)
    assert (again.action, again.epoch) == (BatchAction.ALREADY_COMMITTED, 0)


def test_epoch_calls_to_a_slot_that_is_not_here_are_stale_routing(inprocess_cluster: Any) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=4)
    client = cluster.client()
    client.submit_job(JOB, OPERATORS)
    request = tm_pb.KeyedRequest(
        target=tm_pb.StateTarget(job_id=JOB, operator_id=OP, subtask_index=9, state_name="total", epoch=_ctx(1, 0, 1)),
        keys=[b"k"],
        values=[b"v"],
    )
    with grpc.insecure_channel(cluster.taskmanagers[0].address) as channel, pytest.raises(grpc.RpcError) as info:
        tm_grpc.KeyedStateStub(channel).ValuePut(request, timeout=10)
    assert cast(grpc.Call, info.value).code() is grpc.StatusCode.FAILED_PRECONDITION
    assert dict(cast(grpc.Call, info.value).trailing_metadata() or ())[REASON_KEY] == Reason.STALE_ROUTING.value
    with grpc.insecure_channel(cluster.taskmanagers[0].address) as channel, pytest.raises(grpc.RpcError) as info:
        tm_grpc.TaskExecutorStub(channel).CommitEpoch(
            tm_pb.EpochCommitRequest(job_id="unknown-job", epoch=1), timeout=10
        )
    assert cast(grpc.Call, info.value).code() is grpc.StatusCode.NOT_FOUND
