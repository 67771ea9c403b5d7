"""Client retry semantics against an in-process cluster.

Idempotent calls are retried through routing changes; a non-idempotent call (ListAppend) is
retried only when the server said it applied nothing, and otherwise fails saying the outcome is
unknown, so it is never applied twice behind the caller's back.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common._proto.v1 import jobmanager_pb2_grpc as jm_grpc
from keyedstate.common.client import ListState, ValueState
from keyedstate.common.errors import UnavailableError
from tests.fixtures.waiting import wait_for
from tests.integration.serving._support import JOB, OPERATOR, keys_of_subtask, operators

RESTARTS = {
    "restart-strategy.type": "fixed-delay",
    "restart-strategy.fixed-delay.delay": "50 ms",
    "restart-strategy.fixed-delay.attempts": "1000",
}


_wait_for = wait_for


@pytest.fixture
def cluster(inprocess_cluster: Any) -> Any:
    return inprocess_cluster(taskmanagers=2, slots=2, jm=RESTARTS)


def _setup(
    cluster: Any, **client_settings: Any
) -> tuple[Any, ValueState[str, int], ListState[str, str], list[str], list[str]]:
    client = cluster.client(**client_settings)
    routing = client.submit_job(JOB, operators(parallelism=2))
    assert routing.operator(OPERATOR).addresses[0] != routing.operator(OPERATOR).addresses[1]
    last: ValueState[str, int] = ValueState(client, JOB, OPERATOR, "last", value_serializer="int")
    events: ListState[str, str] = ListState(client, JOB, OPERATOR, "events", value_serializer="str")
    keys0, keys1 = keys_of_subtask(routing, 0, 20), keys_of_subtask(routing, 1, 20)
    last.put_many(keys0 + keys1, list(range(40)))
    events.append_many(keys0 + keys1, ["a"] * 40)
    checkpoint = client.trigger_checkpoint(JOB, timeout_s=60)
    assert checkpoint.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, checkpoint.failure_reason
    return client, last, events, keys0, keys1


def _owner(cluster: Any, client: Any, subtask: int) -> Any:
    address = client.routing(JOB).operator(OPERATOR).addresses[subtask]
    [tm] = [tm for tm in cluster.taskmanagers if tm.address == address]
    return tm


def test_list_append_to_a_stopped_taskmanager_fails_as_unknown_outcome_and_is_not_retried(cluster: Any) -> None:
    client, last, events, keys0, keys1 = _setup(cluster, max_attempts=10, backoff_s=0.05)
    _owner(cluster, client, 0).stop(grace_s=1)

    with pytest.raises(UnavailableError) as info:
        events.append_many(keys0, ["b"] * len(keys0))
    message = info.value.message
    assert "ListAppend" in message and "outcome of this ListAppend is unknown" in message
    assert "not retried" in message and "epoch transactions" in message

    # Idempotent reads ride out the failover: refresh the routing, wait for RUNNING, resend.
    assert last.get_many(keys0) == list(range(20))
    assert client.job_info(JOB).restarts >= 1
    # The job restored the checkpoint: "b" is nowhere, so no hidden retry reached the new owner.
    assert events.get_many(keys0 + keys1) == [["a"]] * 40
    # With fresh routing the caller decides to append again, once.
    events.append_many(keys0, ["b"] * len(keys0))
    assert events.get_many(keys0) == [["a", "b"]] * 20


def test_idempotent_reads_give_up_with_a_clear_error_while_the_job_cannot_run(cluster: Any) -> None:
    client, last, _, keys0, _ = _setup(cluster, max_attempts=3, backoff_s=0.01)
    for tm in list(cluster.taskmanagers):
        tm.stop(grace_s=1)
    _wait_for(lambda: client.job_info(JOB).status == pb.JOB_STATUS_RESTARTING, 10, "the failover")
    with pytest.raises(UnavailableError) as info:
        last.get_many(keys0)
    assert f"job {JOB!r} is RESTARTING" in info.value.message

    # A TaskManager arrives; the same client, with no help, reads the restored state.
    cluster.add_taskmanager(**{"taskmanager.numberOfTaskSlots": 2})
    _wait_for(lambda: client.job_info(JOB).status == pb.JOB_STATUS_RUNNING, 30, "the restart")
    assert last.get_many(keys0) == list(range(20))


def test_list_append_refused_as_stale_routing_is_retried_and_applied_once(cluster: Any) -> None:
    """After a rescale from 2 to 1 the cached routing sends keys to a subtask that no longer
    exists; the TaskManager answers STALE_ROUTING (nothing applied), so the client may resend."""
    client, _, events, keys0, keys1 = _setup(cluster)
    channel = grpc.insecure_channel(cluster.address)
    try:
        table = jm_grpc.JobManagerStub(channel).RescaleJob(
            jm_pb.RescaleJobRequest(job_id=JOB, parallelism={OPERATOR: 1}), timeout=60
        )
    finally:
        channel.close()
    assert client.routing(JOB).version < table.version  # the client has not seen the rescale

    events.append_many(keys0 + keys1, ["c"] * 40)
    assert client.routing(JOB).version == table.version
    assert client.routing(JOB).operator(OPERATOR).parallelism == 1
    assert events.get_many(keys0 + keys1) == [["a", "c"]] * 40
