"""The exactly-once protocol end to end on in-process daemons: routing versions, BeginBatch/CommitEpoch, leases.

A TaskManager whose lease must run out mid-call gets a boot-time clock the test can move
(only for the threads that serve calls; its heartbeat thread keeps real time, so the next
heartbeat renews the lease): no sleeping to make a lease expire.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from keyedstate.common._proto.v1 import common_pb2
from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common._proto.v1 import jobmanager_pb2_grpc as jm_grpc
from keyedstate.common._proto.v1 import taskmanager_pb2 as tm_pb
from keyedstate.common._proto.v1 import taskmanager_pb2_grpc as tm_grpc
from keyedstate.common.batches import Winner
from keyedstate.common.client import (
    BatchAction,
    BatchStart,
    CheckpointStatus,
    EpochScope,
    ListState,
    ReducingState,
    StateClient,
    ValueState,
)
from keyedstate.common.clock import SYSTEM_CLOCK
from keyedstate.common.config import Configuration
from keyedstate.common.descriptors import OperatorSpec, ReduceField, StateDescriptor, StateKind
from keyedstate.common.errors import EpochConflictError, EpochGapError, Reason, UnavailableError
from keyedstate.common.rpc.status import REASON_KEY, ROUTING_VERSION_KEY
from keyedstate.taskmanager.daemon import TaskManager
from tests.fixtures.cluster import FAST_HEARTBEATS, InProcessCluster
from tests.fixtures.waiting import wait_for

JOB = "eo"
OP = "counts"
OPERATORS = [
    OperatorSpec(
        OP,
        2,
        (
            StateDescriptor("total", StateKind.VALUE),
            StateDescriptor("events", StateKind.LIST),
            StateDescriptor("sums", StateKind.REDUCING, reduce_fields=(ReduceField("n"), ReduceField("amount"))),
        ),
    )
]
KEYS = [f"user-{i}" for i in range(40)]


def ctx(epoch: int, partition: int = 0, attempt: int = 1) -> common_pb2.EpochContext:
    return common_pb2.EpochContext(epoch=epoch, partition=partition, attempt=attempt)


def trailers(err: grpc.RpcError) -> dict[str, str | bytes]:
    return dict(cast(grpc.Call, err).trailing_metadata() or ())


def total(client: StateClient, scope: Any = None) -> ValueState[Any, Any]:
    return ValueState(client, JOB, OP, "total", value_serializer="int", epoch=scope)


def raw_put(address: str, target: tm_pb.StateTarget, key: bytes = b"k", value: bytes = b"v") -> Any:
    with grpc.insecure_channel(address) as channel:
        return tm_grpc.KeyedStateStub(channel).ValuePut(
            tm_pb.KeyedRequest(target=target, keys=[key], values=[value]), timeout=10
        )


def begin(client: StateClient, query: str, batch: int) -> tuple[BatchStart, EpochScope]:
    start = client.begin_batch(JOB, query, batch)
    return start, EpochScope(ctx(start.epoch), routing_version=start.routing.version)


def commit(client: StateClient, start: BatchStart, scope: EpochScope, query: str, batch: int, **kw: Any) -> Any:
    return client.commit_epoch(
        JOB,
        start.epoch,
        [scope.winner()],
        query_id=query,
        batch_id=batch,
        expected_routing_version=start.routing.version,
        timeout_s=60,
        **kw,
    )


def run_batch(client: StateClient, query: str, batch: int, value: int, **kw: Any) -> Any:
    start, scope = begin(client, query, batch)
    assert start.action is BatchAction.RUN, start
    total(client, scope).put_many(KEYS, [value] * len(KEYS))
    return commit(client, start, scope, query, batch, **kw)


@pytest.fixture
def cluster(inprocess_cluster: Callable[..., InProcessCluster]) -> InProcessCluster:
    c = inprocess_cluster(taskmanagers=2, slots=2)
    c.client().submit_job(JOB, OPERATORS)
    return c


# -- routing versions --------------------------------------------------------------------------
def test_a_call_under_another_routing_version_is_refused_with_the_slots_version_in_the_trailers(
    cluster: InProcessCluster,
) -> None:
    client = cluster.client()
    routing = client.routing(JOB)
    version = routing.version
    address = routing.operator(OP).addresses[0]
    for sent, epoch in ((version + 1, None), (version - 1, None), (version + 1, ctx(0)), (0, None)):
        target = tm_pb.StateTarget(
            job_id=JOB, operator_id=OP, subtask_index=0, state_name="total", routing_version=sent, epoch=epoch
        )
        with pytest.raises(grpc.RpcError) as info:
            raw_put(address, target)
        assert cast(grpc.Call, info.value).code() is grpc.StatusCode.FAILED_PRECONDITION, sent
        assert trailers(info.value) == {REASON_KEY: Reason.STALE_ROUTING.value, ROUTING_VERSION_KEY: str(version)}
        if sent:
            assert (
                f"is deployed under routing version {version}, the call was routed with version {sent}"
                in cast(grpc.Call, info.value).details()
            )
        else:
            assert "carries no routing version" in cast(grpc.Call, info.value).details()
    # Nothing was written by any of them.
    assert total(client).get_many(["k"]) == [None]
    # A commit under another version is refused by the TaskManager too.
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as info:
        tm_grpc.TaskExecutorStub(channel).CommitEpoch(
            tm_pb.EpochCommitRequest(job_id=JOB, epoch=0, routing_version=version + 1), timeout=10
        )
    assert cast(grpc.Call, info.value).code() is grpc.StatusCode.ABORTED
    assert trailers(info.value)[REASON_KEY] == Reason.EPOCH_CONFLICT.value
    assert (
        f"is deployed under routing version {version}, the commit of epoch 0 is for version {version + 1}"
        in cast(grpc.Call, info.value).details()
    )


def test_a_pinned_scope_refuses_to_write_after_a_redeploy_and_its_commit_is_refused(cluster: InProcessCluster) -> None:
    client = cluster.client()
    start, scope = begin(client, "q1", 0)
    old = start.routing.version
    total(client, scope).put_many(KEYS, [1] * len(KEYS))
    stale_client = cluster.client()
    assert stale_client.routing(JOB).version == old  # cached: the client keeps it through the rescale
    new = client.rescale_job(JOB, 3, timeout_s=60).version
    assert new > old

    # The client still holds the old table: the slots refuse the old version, and the task fails.
    with pytest.raises(EpochConflictError) as info:
        total(stale_client, scope).put_many(KEYS, [2] * len(KEYS))
    assert f"The batch's routing version v{old} is no longer the slot's" in info.value.message
    assert "the batch must run again" in info.value.message
    # A client that already knows the new table refuses before sending anything.
    client.routing(JOB, refresh=True)
    with pytest.raises(EpochConflictError) as info:
        total(client, scope).put_many(KEYS, [2] * len(KEYS))
    assert info.value.message == (
        f"job {JOB!r} was redeployed (routing v{old} -> v{new}) while epoch 0 ran; the task's writes cannot be committed, "
        "so the batch must run again"
    )
    # Reads inside the pinned scope are refused the same way.
    with pytest.raises(EpochConflictError):
        total(client, scope).get_many(KEYS[:1])

    with pytest.raises(EpochConflictError) as info:
        commit(client, start, scope, "q1", 0)
    assert info.value.message.endswith(
        f"job {JOB!r} was redeployed while epoch 0 ran (routing v{old} -> v{new}); its staged writes are gone: run the "
        "batch again"
    )
    # The batch again, under the new deployment.
    response = run_batch(client, "q1", 0, 3)
    assert response.committed_epoch == 0
    assert total(client).get_many(KEYS) == [3] * len(KEYS)


# -- BeginBatch and CommitEpoch through the JobManager ---------------------------------------------
def test_a_batch_past_a_gap_is_refused_and_a_stale_commit_is_refused(cluster: InProcessCluster) -> None:
    client = cluster.client()
    run_batch(client, "q1", 0, 1, checkpoint=False, wait_for_checkpoint=False)
    with pytest.raises(EpochGapError) as info:
        client.begin_batch(JOB, "q1", 2)
    assert info.value.message.endswith(
        f"job {JOB!r}: batch 2 is epoch 2, but the job's state holds epoch 0, so epochs 1..1 are missing from it (an "
        "older checkpoint or savepoint was restored, or the newest checkpoint was lost). Nothing was applied. Restore a "
        "checkpoint that holds epoch 1 (statectl checkpoint list; statectl job restore), or start the query from a new "
        "checkpointLocation"
    )
    start, scope = begin(client, "q1", 1)
    with pytest.raises(EpochConflictError, match=f"job {JOB!r}: batch 1 is epoch 1 now, not 5"):
        client.commit_epoch(
            JOB,
            5,
            [scope.winner()],
            query_id="q1",
            batch_id=1,
            expected_routing_version=start.routing.version,
            timeout_s=30,
        )
    info_ = client.job_info(JOB)
    assert (info_.committed_epoch, info_.status) == (0, pb.JOB_STATUS_RUNNING)


def test_an_already_committed_batch_is_only_made_durable(cluster: InProcessCluster) -> None:
    client = cluster.client()
    first = run_batch(client, "q1", 0, 7, checkpoint=False, wait_for_checkpoint=False)
    assert (first.committed_epoch, first.already_committed, first.checkpoint) == (0, False, None)
    assert (client.job_info(JOB).committed_epoch, client.job_info(JOB).durable_epoch) == (0, -1)

    # The driver died after the commit; the batch runs again from BeginBatch.
    start, scope = begin(client, "q1", 0)
    assert (start.action, start.epoch, start.committed_epoch, start.durable_epoch) == (
        BatchAction.ALREADY_COMMITTED,
        0,
        0,
        -1,
    )
    again = commit(client, start, scope, "q1", 0)
    assert (again.committed_epoch, again.already_committed) == (0, True)
    assert again.checkpoint is not None
    assert (again.checkpoint.status, again.checkpoint.epoch) == (CheckpointStatus.COMPLETED, 0)
    assert client.job_info(JOB).durable_epoch == 0
    assert total(client).get_many(KEYS) == [7] * len(KEYS)


def test_a_new_query_binds_at_its_batch_0_on_the_existing_state(cluster: InProcessCluster) -> None:
    client = cluster.client()
    for batch in (0, 1):
        run_batch(client, "q1", batch, batch, checkpoint=False, wait_for_checkpoint=False)
    start, scope = begin(client, "q2", 0)
    assert (start.action, start.epoch) == (BatchAction.RUN, 2)
    ListState[str, str](client, JOB, OP, "events", value_serializer="str", epoch=scope).append_many(
        KEYS[:3], ["q2"] * 3
    )
    response = commit(client, start, scope, "q2", 0)
    assert response.committed_epoch == 2 and response.checkpoint is not None and response.checkpoint.epoch == 2
    info = client.job_info(JOB)
    assert [(e.query_id, e.offset, e.first_epoch) for e in info.lineage] == [("q1", 0, 0), ("q2", 2, 2)]
    metadata = json.loads((Path(response.checkpoint.path[len("file://") :]) / "_metadata").read_text())
    assert metadata["epoch"] == 2
    assert metadata["lineage"] == [
        {"query_id": "q1", "offset": 0, "first_epoch": 0},
        {"query_id": "q2", "offset": 2, "first_epoch": 2},
    ]
    assert client.begin_batch(JOB, "q2", 1).epoch == 3
    with pytest.raises(
        EpochGapError, match="the job's state has moved on from query q1 to query q2 \\(since epoch 2\\)"
    ):
        client.begin_batch(JOB, "q1", 2)
    with pytest.raises(
        EpochGapError, match="query q3 is at batch 4, but the job's state holds epoch 2 \\(of query q2\\)"
    ):
        client.begin_batch(JOB, "q3", 4)


def test_a_winner_whose_ledger_the_slots_disagree_with_is_applied_nowhere(cluster: InProcessCluster) -> None:
    client = cluster.client()
    start, scope = begin(client, "q1", 0)
    total(client, scope).put_many(KEYS, [5] * len(KEYS))
    total(client, scope).put_many(KEYS[:1], [6])
    honest = scope.winner()
    assert honest.ledger is not None
    assert sum(honest.ledger.values()) == 3 and len(honest.ledger) == 2  # both slots, one of them twice
    last = max(honest.ledger)  # the slot the wire lists last
    forged = Winner(honest.partition, honest.attempt, {**honest.ledger, last: honest.ledger[last] + 1})
    with pytest.raises(EpochConflictError) as info:
        client.commit_epoch(
            JOB, 0, [forged], query_id="q1", batch_id=0, expected_routing_version=start.routing.version, timeout_s=30
        )
    assert f"job {JOB!r}: epoch 0 was refused by TaskManager" in info.value.message
    assert "before anything was applied" in info.value.message and "run the batch again" in info.value.message
    assert "acknowledged by eo/counts/" in info.value.message
    assert total(client).get_many(KEYS) == [None] * len(KEYS)
    job = client.job_info(JOB)
    assert (job.committed_epoch, job.status) == (-1, pb.JOB_STATUS_RUNNING)
    assert (
        client.commit_epoch(
            JOB, 0, [honest], query_id="q1", batch_id=0, expected_routing_version=start.routing.version, timeout_s=60
        ).committed_epoch
        == 0
    )
    assert total(client).get_many(KEYS[:2]) == [6, 5]


@pytest.mark.parametrize(
    ("winners", "names"),
    [
        # Two winning attempts for one partition: which one's writes would count is undefined.
        (
            [pb.PartitionAttempt(partition=0, attempt=1), pb.PartitionAttempt(partition=0, attempt=2)],
            "two winning attempts",
        ),
        ([pb.PartitionAttempt(partition=-1, attempt=1)], "must be >= 0"),
        (
            [
                pb.PartitionAttempt(
                    partition=0, attempt=1, has_ledger=True, writes=[pb.SlotWrites(operator_id=OP, requests=-3)]
                )
            ],
            "counts and subtask indexes must be >= 0",
        ),
    ],
)
def test_malformed_winners_are_invalid_argument_at_the_jobmanager_and_the_job_keeps_running(
    cluster: InProcessCluster, winners: list[pb.PartitionAttempt], names: str
) -> None:
    """A bad CommitEpoch is the caller's error: refused before any TaskManager sees it, not a failover."""
    client = cluster.client()
    start, scope = begin(client, "q1", 0)
    total(client, scope).put_many(KEYS, [5] * len(KEYS))
    before = client.job_info(JOB)
    request = jm_pb.CommitEpochRequest(
        job_id=JOB,
        epoch=start.epoch,
        winners=winners,
        query_id="q1",
        batch_id=0,
        expected_routing_version=start.routing.version,
        timeout_ms=30_000,
    )
    with grpc.insecure_channel(cluster.address) as channel, pytest.raises(grpc.RpcError) as info:
        jm_grpc.JobManagerStub(channel).CommitEpoch(request, timeout=30)
    err = cast(grpc.Call, info.value)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert names in (err.details() or "")
    after = client.job_info(JOB)
    assert (after.status, after.restarts, after.committed_epoch) == (pb.JOB_STATUS_RUNNING, before.restarts, -1)
    assert total(client).get_many(KEYS) == [None] * len(KEYS)
    # The batch's real winner still commits afterwards: nothing was half-applied or fenced.
    committed = client.commit_epoch(
        JOB,
        0,
        [scope.winner()],
        query_id="q1",
        batch_id=0,
        expected_routing_version=start.routing.version,
        timeout_s=60,
    )
    assert committed.committed_epoch == 0 and total(client).get_many(KEYS[:1]) == [5]


# -- leases ----------------------------------------------------------------------------------------
class ServingClock:
    """The system clock, whose boot-time reading the test can move for the threads that serve calls.

    ``jump_after_next(ms)``: the next read on a serving thread returns the current time, the one
    after it (the call's second lease check) time ``ms`` later, as if the process had been paused
    in the middle of the call; the heartbeat thread sees the jump only from then on, so no renewal
    can slip in between. ``skew(ms)``: serving threads see time ``ms`` ahead (a lease that ran
    out); the heartbeat thread never does, so its renewals keep real time.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jump = 0  # armed: applied after the next serving read
        self._paused = 0  # seen by serving threads only, until their next read
        self._skew = 0
        self._offset = 0  # seen by every thread

    def now_ms(self) -> int:
        return SYSTEM_CLOCK.now_ms()

    def monotonic_ms(self) -> int:
        return SYSTEM_CLOCK.monotonic_ms()

    def boottime_ms(self) -> int:
        base = SYSTEM_CLOCK.boottime_ms()
        with self._lock:
            if threading.current_thread().name == "tm-heartbeat":
                return base + self._offset
            value = base + self._offset + self._paused + self._skew
            if self._paused:
                self._offset, self._paused = self._offset + self._paused, 0
            if self._jump:
                self._paused, self._jump = self._jump, 0
            return value

    def jump_after_next(self, ms: int) -> None:
        with self._lock:
            self._jump = ms

    def skew(self, ms: int) -> None:
        with self._lock:
            self._skew = ms


@pytest.fixture
def leased(inprocess_cluster: Any) -> tuple[InProcessCluster, TaskManager, ServingClock]:
    c = inprocess_cluster(taskmanagers=0, slots=2)
    clock = ServingClock()
    conf = {
        "jobmanager.rpc.port": c.jobmanager.port,
        "taskmanager.resource-id": "tm-clocked",
        "state.backend.rocksdb.localdir": str(c.base / "tm-clocked"),
        "metrics.reporter.prom.port": "-1",
        **FAST_HEARTBEATS,
        **c.tm_config,
    }
    tm = TaskManager(Configuration(conf), clock=clock)
    tm.start()
    c.taskmanagers.append(tm)
    c.client().submit_job(JOB, OPERATORS)
    return c, tm, clock


def _renewed(tm: TaskManager) -> None:
    wait_for(tm.lease.valid, 10, "the next heartbeat renewing the lease")


def test_barriers_refused_by_a_taskmanager_without_a_lease_never_exhaust_tolerable_failures(leased: Any) -> None:
    """A TaskManager out of lease refuses barriers (LEASE_EXPIRED): each such checkpoint fails as
    NOT_ALL_REQUIRED_TASKS_RUNNING, which does not count toward tolerable-failed-checkpoints (0 here),
    so self-triggered checkpoints (overlapped commits take one after every apply) never fail the job
    over; the heartbeat timeout deals with such a TaskManager. Found by the model (tests/model)."""
    cluster, _tm, clock = leased
    client = cluster.client()
    clock.skew(3_600_000)  # serving threads see the lease run out; renewals keep real time
    for _ in range(3):
        info = client.trigger_checkpoint(JOB, wait=True, timeout_s=30)
        assert info.status == jm_pb.CHECKPOINT_STATUS_FAILED
        assert info.failure_reason.startswith("NOT_ALL_REQUIRED_TASKS_RUNNING"), info.failure_reason
    job = client.job_info(JOB)
    assert job.status == pb.JOB_STATUS_RUNNING and job.restarts == 0, job
    clock.skew(0)
    info = client.trigger_checkpoint(JOB, wait=True, timeout_s=30)
    assert info.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, info


def test_a_taskmanager_out_of_lease_refuses_state_calls_commits_and_barriers(leased: Any) -> None:
    cluster, tm, clock = leased
    client = cluster.client(max_attempts=2)
    version = client.routing(JOB).version
    total(client).put_many(KEYS[:2], [1, 2])
    clock.skew(3_600_000)
    target = tm_pb.StateTarget(job_id=JOB, operator_id=OP, subtask_index=0, state_name="total", routing_version=version)
    with pytest.raises(grpc.RpcError) as info:
        raw_put(tm.address, target)
    assert cast(grpc.Call, info.value).code() is grpc.StatusCode.UNAVAILABLE
    assert trailers(info.value) == {REASON_KEY: Reason.LEASE_EXPIRED.value}
    assert (
        cast(grpc.Call, info.value)
        .details()
        .startswith(
            "this TaskManager stopped serving (no heartbeat answered by the JobManager within the lease): ValuePut refused"
        )
    )
    with grpc.insecure_channel(tm.address) as channel:
        stub = tm_grpc.TaskExecutorStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.CommitEpoch(tm_pb.EpochCommitRequest(job_id=JOB, epoch=0, routing_version=version), timeout=10)
        assert trailers(info.value)[REASON_KEY] == Reason.LEASE_EXPIRED.value
        assert "the commit of epoch 0 refused" in cast(grpc.Call, info.value).details()
        with pytest.raises(grpc.RpcError) as info:
            stub.TriggerCheckpoint(tm_pb.CheckpointBarrier(job_id=JOB, checkpoint_id=99, epoch=-1), timeout=10)
        assert trailers(info.value)[REASON_KEY] == Reason.LEASE_EXPIRED.value
        assert "the barrier of checkpoint 99 refused" in cast(grpc.Call, info.value).details()
    with pytest.raises(UnavailableError, match="stopped serving"):
        total(client).get_many(KEYS[:2])
    clock.skew(0)
    assert total(client).get_many(KEYS[:2]) == [1, 2]


def test_a_write_whose_lease_ran_out_while_it_applied_answers_outcome_unknown(leased: Any) -> None:
    cluster, tm, clock = leased
    client = cluster.client(max_attempts=10)
    version = client.routing(JOB).version
    subtask = client.subtask_of(JOB, OP, b"k")
    target = tm_pb.StateTarget(
        job_id=JOB, operator_id=OP, subtask_index=subtask, state_name="total", routing_version=version
    )
    clock.jump_after_next(3_600_000)
    with pytest.raises(grpc.RpcError) as info:
        raw_put(tm.address, target, b"k", (41).to_bytes(8, "big", signed=True))
    assert cast(grpc.Call, info.value).code() is grpc.StatusCode.UNAVAILABLE
    assert trailers(info.value) == {REASON_KEY: Reason.OUTCOME_UNKNOWN.value}
    assert "its outcome is unknown" in cast(grpc.Call, info.value).details()
    _renewed(tm)
    # It was applied: an answer of OUTCOME_UNKNOWN is never "not applied".
    assert ValueState[bytes, int](client, JOB, OP, "total", key_serializer="bytes", value_serializer="int").get_many(
        [b"k"]
    ) == [41]


def test_a_direct_reduce_with_an_unknown_outcome_is_not_retried(leased: Any) -> None:
    cluster, tm, clock = leased
    client = cluster.client(max_attempts=10)
    sums = ReducingState[str](client, JOB, OP, "sums")
    clock.jump_after_next(3_600_000)
    with pytest.raises(UnavailableError) as info:
        sums.add_many(["a"], [(1, 10)])
    assert (
        "The outcome of this Reduce is unknown (the TaskManager may have applied it), so it was not retried"
        in info.value.message
    )
    _renewed(tm)
    assert sums.get_many(["a"]) == [(1, 10)]  # applied once, not twice


def test_a_numbered_write_with_an_unknown_outcome_is_retried_and_staged_once(leased: Any) -> None:
    cluster, _tm, clock = leased
    client = cluster.client(max_attempts=10)
    start, scope = begin(client, "q1", 0)
    sums = ReducingState[str](client, JOB, OP, "sums", epoch=scope)
    sums.add_many(["a"], [(1, 10)])
    clock.jump_after_next(3_600_000)
    assert sums.add_many(["a"], [(1, 5)], return_values=True) == [(2, 15)]  # the retry answered with the value as it is
    assert scope.unacknowledged() == {}
    assert sum((scope.winner().ledger or {}).values()) == 2
    response = commit(client, start, scope, "q1", 0)
    assert response.committed_epoch == 0 and response.checkpoint is not None
    assert response.checkpoint.status is CheckpointStatus.COMPLETED
    assert ReducingState[str](client, JOB, OP, "sums").get_many(["a"]) == [(2, 15)]


def test_an_unpinned_numbered_write_with_an_unknown_outcome_is_still_committed(leased: Any) -> None:
    cluster, _tm, clock = leased
    client = cluster.client(max_attempts=10)
    start = client.begin_batch(JOB, "q1", 0)
    scope = EpochScope(ctx(start.epoch))  # numbered, not pinned
    clock.jump_after_next(3_600_000)
    total(client, scope).put_many(["a"], [1])
    response = client.commit_epoch(
        JOB,
        start.epoch,
        [scope.winner()],
        query_id="q1",
        batch_id=0,
        expected_routing_version=start.routing.version,
        timeout_s=60,
    )
    assert response.committed_epoch == 0
    assert total(client).get_many(["a"]) == [1]
