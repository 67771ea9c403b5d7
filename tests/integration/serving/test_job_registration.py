"""Job registration errors at the JobManager, through raw gRPC stubs and through the client.

A refused job must take no slots and leave no trace; resubmitting the same job is idempotent.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common._proto.v1 import jobmanager_pb2_grpc as jm_grpc
from keyedstate.common.client import ListState, ValueState
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.errors import (
    AlreadyExistsError,
    CapacityError,
    InvalidArgumentError,
    KeyedStateError,
    NotFoundError,
    Reason,
)
from keyedstate.common.rpc.status import status_code
from tests.integration.serving._support import JOB, OPERATOR, keys_of_subtask, operators, reason, rpc_error

VALUE = pb.StateDescriptor(name="v", kind=pb.VALUE)


def _op(
    operator_id: str = "op", parallelism: int = 1, states: tuple[pb.StateDescriptor, ...] = (VALUE,)
) -> pb.OperatorSpec:
    return pb.OperatorSpec(operator_id=operator_id, parallelism=parallelism, states=list(states))


@pytest.fixture
def cluster(inprocess_cluster: Any) -> Any:
    # 2 TaskManagers x 2 slots; pipeline.max-parallelism 64 tells the JobManager default apart from 128.
    return inprocess_cluster(taskmanagers=2, slots=2, jm={"pipeline.max-parallelism": "64"})


@pytest.fixture
def stub(cluster: Any) -> Iterator[jm_grpc.JobManagerStub]:
    channel = grpc.insecure_channel(cluster.address)
    yield jm_grpc.JobManagerStub(channel)
    channel.close()


def _submit(stub: jm_grpc.JobManagerStub, **fields: Any) -> pb.RoutingTable:
    routing: pb.RoutingTable = stub.SubmitJob(jm_pb.SubmitJobRequest(**fields), timeout=30)
    return routing


def _free_slots(stub: jm_grpc.JobManagerStub) -> int:
    free: int = stub.GetClusterOverview(jm_pb.ClusterOverviewRequest(), timeout=10).free_slots
    return free


def _assert_unknown(stub: jm_grpc.JobManagerStub, job_id: str) -> None:
    err = rpc_error(lambda: stub.GetJob(jm_pb.JobRequest(job_id=job_id), timeout=10))
    assert err.code() is grpc.StatusCode.NOT_FOUND and reason(err) == "UNKNOWN_JOB"


def test_a_job_that_does_not_fit_is_resource_exhausted_and_takes_no_slots(
    stub: jm_grpc.JobManagerStub, cluster: Any
) -> None:
    err = rpc_error(lambda: _submit(stub, job_id="big", operators=[_op(parallelism=3), _op("second", parallelism=2)]))
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert reason(err) == "INSUFFICIENT_SLOTS"
    assert "needs 5 slots but only 4 of 4 are free" in err.details()
    assert "taskmanager.numberOfTaskSlots" in err.details() and "start more TaskManagers" in err.details()
    assert _free_slots(stub) == 4
    _assert_unknown(stub, "big")

    client = cluster.client()
    with pytest.raises(CapacityError) as info:
        client.submit_job("big", [OperatorSpec("op", 5, (StateDescriptor("v", StateKind.VALUE),))])
    assert info.value.reason is Reason.INSUFFICIENT_SLOTS and "taskmanager.numberOfTaskSlots" in info.value.message
    assert status_code(info.value) is grpc.StatusCode.RESOURCE_EXHAUSTED

    # What fits still deploys, into exactly the slots that were free.
    routing = client.submit_job("small", [OperatorSpec("op", 4, (StateDescriptor("v", StateKind.VALUE),))])
    assert routing.operator("op").parallelism == 4
    assert _free_slots(stub) == 0
    err = rpc_error(lambda: _submit(stub, job_id="one-more", operators=[_op()]))
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "only 0 of 4 are free" in err.details()


@pytest.mark.parametrize(
    "fields,fragments",
    [
        ({"job_id": "bad id", "operators": [_op()]}, ["invalid job id 'bad id'", "[A-Za-z0-9_.-]"]),
        ({"job_id": "", "operators": [_op()]}, ["invalid job id ''"]),
        ({"job_id": "../escape", "operators": [_op()]}, ["invalid job id '../escape'"]),
        ({"job_id": "j" * 129, "operators": [_op()]}, ["1-128 characters"]),
        ({"job_id": "j", "operators": [_op("a/b")]}, ["invalid operator id 'a/b'"]),
        (
            {"job_id": "j", "operators": [_op(states=(pb.StateDescriptor(name="1st", kind=pb.VALUE),))]},
            ["invalid state name '1st'", "starting with a letter"],
        ),
        (
            {"job_id": "j", "operators": [_op(states=(pb.StateDescriptor(name="x"),))]},
            ["VALUE, LIST, MAP, REDUCING or TIMERS"],
        ),
        ({"job_id": "j", "operators": [_op(), _op()]}, ["declares an operator id twice"]),
        ({"job_id": "j", "operators": [_op(states=(VALUE, VALUE))]}, ["declares state 'v' twice"]),
        ({"job_id": "j", "operators": [_op(parallelism=0)]}, ["parallelism must be at least 1"]),
        (
            {"job_id": "j", "operators": [_op(parallelism=4)], "max_parallelism": 2},
            ["parallelism 4 must be between 1 and the max parallelism 2"],
        ),
        (
            {"job_id": "j", "operators": [_op()], "max_parallelism": 40_000},
            ["max parallelism 40000", "1..32768", "pipeline.max-parallelism"],
        ),
        (
            {"job_id": "j", "operators": [_op()], "max_parallelism": -1},
            ["max parallelism -1", "pipeline.max-parallelism"],
        ),
        ({"job_id": "j", "operators": []}, ["declares no operators", "declare at least one"]),
        ({"job_id": "j", "operators": [_op(states=())]}, ["operator 'op' declares no states"]),
    ],
)
def test_invalid_job_definitions_are_invalid_argument(
    stub: jm_grpc.JobManagerStub, fields: dict[str, Any], fragments: list[str]
) -> None:
    err = rpc_error(lambda: _submit(stub, **fields))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert reason(err) == "INVALID_ARGUMENT"
    for fragment in fragments:
        assert fragment in err.details()
    assert _free_slots(stub) == 4
    if fields["job_id"] == "j":
        _assert_unknown(stub, "j")


def test_invalid_per_job_config_is_invalid_argument_naming_the_key(stub: jm_grpc.JobManagerStub) -> None:
    err = rpc_error(
        lambda: _submit(stub, job_id="j", operators=[_op()], config={"execution.checkpointing.timeout": "5parsecs"})
    )
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and reason(err) == "CONFIG"
    assert "execution.checkpointing.timeout" in err.details() and "'30 s'" in err.details()
    err = rpc_error(lambda: _submit(stub, job_id="j", operators=[_op()], config={"pipeline.max-parallelism": "0"}))
    assert (
        err.code() is grpc.StatusCode.INVALID_ARGUMENT
        and "pipeline.max-parallelism: must be at least 1" in err.details()
    )
    _assert_unknown(stub, "j")


def test_max_parallelism_zero_means_the_jobmanager_default(stub: jm_grpc.JobManagerStub) -> None:
    table = _submit(stub, job_id="j", operators=[_op(parallelism=2)], max_parallelism=0)
    assert table.max_parallelism == 64
    assert [(r.key_groups.start, r.key_groups.end) for r in table.routes] == [(0, 31), (32, 63)]


def test_invalid_definitions_are_refused_by_the_client_before_sending(cluster: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="invalid operator id"):
        OperatorSpec("a b", 1, (StateDescriptor("v", StateKind.VALUE),))
    with pytest.raises(InvalidArgumentError, match="declares state 'v' twice"):
        OperatorSpec("op", 1, (StateDescriptor("v", StateKind.VALUE), StateDescriptor("v", StateKind.LIST)))
    client = cluster.client()
    with pytest.raises(InvalidArgumentError) as info:
        client.submit_job("bad id", operators())
    assert "invalid job id" in info.value.message and status_code(info.value) is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(InvalidArgumentError, match="must be between 1 and the max parallelism 2"):
        client.submit_job(JOB, operators(parallelism=4), max_parallelism=2)


def test_resubmitting_the_same_job_is_idempotent(cluster: Any, stub: jm_grpc.JobManagerStub) -> None:
    client = cluster.client()
    first = client.submit_job(JOB, operators(parallelism=2))
    free = _free_slots(stub)
    last = ValueState[str, int](client, JOB, OPERATOR, "last", value_serializer="int")
    last.put_many(["a", "b"], [1, 2])

    # A restarted driver: a new client submits the same definition and attaches to the running job.
    again = cluster.client().submit_job(JOB, operators(parallelism=2))
    assert again == first
    assert _free_slots(stub) == free
    assert last.get_many(["a", "b"]) == [1, 2]


def test_a_different_definition_under_a_running_id_is_already_exists(
    cluster: Any, stub: jm_grpc.JobManagerStub
) -> None:
    client = cluster.client()
    first = client.submit_job(JOB, operators(parallelism=2))
    free = _free_slots(stub)
    # Only the parallelism differs: a restarted driver adopts the job as it runs (after a rescale).
    assert cluster.client().submit_job(JOB, operators(parallelism=1)) == first
    other_states = [OperatorSpec(OPERATOR, 2, (StateDescriptor("renamed", StateKind.VALUE),))]
    with pytest.raises(AlreadyExistsError) as info:
        cluster.client().submit_job(JOB, other_states)
    assert info.value.reason is Reason.ALREADY_EXISTS
    assert f"the states of operator {OPERATOR!r}" in info.value.message
    assert status_code(info.value) is grpc.StatusCode.ALREADY_EXISTS
    assert f"statectl job cancel {JOB}" in info.value.message and "another job id" in info.value.message
    err = rpc_error(lambda: _submit(stub, job_id=JOB, operators=[_op()]))
    assert err.code() is grpc.StatusCode.ALREADY_EXISTS and reason(err) == "ALREADY_EXISTS"
    # The running job is untouched.
    assert client.routing(JOB, refresh=True) == first
    assert _free_slots(stub) == free
    assert stub.GetJob(jm_pb.JobRequest(job_id=JOB), timeout=10).status == pb.JOB_STATUS_RUNNING


def test_a_canceled_job_id_can_be_reused_and_cached_routing_moves_on(
    cluster: Any, stub: jm_grpc.JobManagerStub
) -> None:
    """A client that cached the old job's routing follows the new definition, never a stale table."""
    client = cluster.client()
    client.submit_job(JOB, operators(parallelism=2))
    events = ListState[str, str](client, JOB, OPERATOR, "events", value_serializer="str")
    events.append("k", "old")
    # A rescale (same parallelism) moves the cached routing past version 1.
    stub.RescaleJob(jm_pb.RescaleJobRequest(job_id=JOB, parallelism={"": 2}), timeout=60)
    assert client.routing(JOB, refresh=True).version == 2

    other = cluster.client()
    info = other.cancel_job(JOB)
    assert info.status == pb.JOB_STATUS_CANCELED
    assert _free_slots(stub) == 4
    new = other.submit_job(JOB, operators(parallelism=1))
    assert new.version > client.routing(JOB).version

    # Keys of the old subtask 1 now belong to subtask 0 elsewhere: STALE_ROUTING, refresh, resend.
    keys = keys_of_subtask(client.routing(JOB), 1, 5)
    events.append_many(keys, ["new"] * 5)
    assert events.get_many(keys) == [["new"]] * 5
    assert client.routing(JOB).version == new.version


def test_rescale_past_the_max_parallelism_is_refused_naming_that_limit(
    cluster: Any, stub: jm_grpc.JobManagerStub
) -> None:
    # Enough free slots for the parallelism asked: the max parallelism is the only obstacle.
    client = cluster.client()
    first = client.submit_job(JOB, operators(parallelism=1), max_parallelism=2)
    err = rpc_error(lambda: stub.RescaleJob(jm_pb.RescaleJobRequest(job_id=JOB, parallelism={"": 3}), timeout=60))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and reason(err) == "INVALID_ARGUMENT"
    assert "max parallelism is 2" in err.details() and "at most 2" in err.details(), err.details()
    assert "TaskManagers would not help" in err.details() and "keeps running" in err.details()
    assert client.routing(JOB, refresh=True) == first


def test_a_client_that_saw_the_job_canceled_follows_its_restore(cluster: Any) -> None:
    """A long-lived client refreshes a cached CANCELED (or FAILED) status before it believes it."""
    client = cluster.client()
    client.submit_job(JOB, operators(parallelism=2))
    last = ValueState[str, int](client, JOB, OPERATOR, "last", value_serializer="int")
    keys = keys_of_subtask(client.routing(JOB), 0, 2) + keys_of_subtask(client.routing(JOB), 1, 2)
    last.put_many(keys, [1, 2, 3, 4])
    checkpoint = client.trigger_checkpoint(JOB, timeout_s=60)
    assert checkpoint.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, checkpoint.failure_reason

    operator = cluster.client()
    operator.cancel_job(JOB)
    with pytest.raises(KeyedStateError, match="is CANCELED") as refused:
        last.get_many(keys)
    assert refused.value.reason is Reason.JOB_NOT_RUNNING
    assert client.routing(JOB).job_status == "CANCELED"  # the long-lived client has cached it
    events = ListState[str, Any](client, JOB, OPERATOR, "events")
    with pytest.raises(KeyedStateError, match="is CANCELED; restore it"):
        list(events.scan(keys[0]))

    operator.restore_job(JOB, checkpoint.path)  # what statectl job restore does
    assert last.get_many(keys) == [1, 2, 3, 4]
    assert list(events.scan(keys[0])) == []
    last.put(keys[0], 10)
    assert last.get(keys[0]) == 10
    assert client.routing(JOB).job_status == "RUNNING"


def test_unknown_job_calls_are_not_found_naming_the_fix(stub: jm_grpc.JobManagerStub, cluster: Any) -> None:
    for call in (stub.GetJob, stub.CancelJob):
        err = rpc_error(functools.partial(call, jm_pb.JobRequest(job_id="ghost"), timeout=10))
        assert err.code() is grpc.StatusCode.NOT_FOUND and reason(err) == "UNKNOWN_JOB"
        assert "unknown job 'ghost'" in err.details() and "submit it first" in err.details()
    err = rpc_error(lambda: stub.GetRouting(jm_pb.GetRoutingRequest(job_id="ghost"), timeout=10))
    assert err.code() is grpc.StatusCode.NOT_FOUND
    with pytest.raises(NotFoundError, match="unknown job 'ghost'"):
        cluster.client().job_info("ghost")
