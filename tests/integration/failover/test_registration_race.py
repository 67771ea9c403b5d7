"""A failover waiting for slots and a TaskManager's registration: the restart never deploys to the
TaskManager before its registration is decided.

A TaskManager restarted under the same resource id registers while its job's failover waits for
slots. If the JobManager offered its slots before deciding which of its reported slots it keeps,
the restart deployed to it in that window, the registration then judged the new slots "lost"
(they were not in what the TaskManager reported), failed the job over a second time, and its
answer told the TaskManager to release the slots it had just been given. The registration
handler is slowed here between admitting the TaskManager and deciding (as a loaded JobManager
is), which opened that window every time.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common.client import ValueState
from keyedstate.jobmanager.dispatcher import Dispatcher
from tests.integration.serving._support import OPERATOR, operators

JOB = "registering"
FAST_RESTARTS = {
    "restart-strategy.type": "fixed-delay",
    "restart-strategy.fixed-delay.attempts": "10",
    "restart-strategy.fixed-delay.delay": "50 ms",
}
DECISION_DELAY_S = 1.5


def _wait_for(client: Any, predicate: Any, what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        info = client.job_info(JOB)
        if predicate(info):
            return info
        assert time.monotonic() < deadline, f"{what}: {info}"
        time.sleep(0.05)


def test_a_restarted_taskmanager_gets_its_slots_after_its_registration_is_decided(
    inprocess_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=2, jm=FAST_RESTARTS)
    client = cluster.client()
    client.submit_job(JOB, operators(2))
    state = ValueState[str, int](client, JOB, OPERATOR, "last")
    keys = [f"k{i}" for i in range(50)]
    for i, key in enumerate(keys):
        state.put(key, i)
    client.trigger_checkpoint(JOB, wait=True)

    dispatcher: Dispatcher = cluster.jobmanager.dispatcher
    decide = dispatcher._keep_assigned_slots

    def slow_decision(record: Any, reported: Any) -> Any:
        time.sleep(DECISION_DELAY_S)
        return decide(record, reported)

    monkeypatch.setattr(dispatcher, "_keep_assigned_slots", slow_decision)

    # The only TaskManager goes: the failover waits for two slots.
    cluster.taskmanagers[0].stop(grace_s=1)
    _wait_for(client, lambda i: i.status == pb.JOB_STATUS_RESTARTING, "the job did not fail over")
    # It comes back under the same resource id, and registers while the failover waits.
    tm = cluster.add_taskmanager(**{"taskmanager.resource-id": "tm-0"})

    info = _wait_for(client, lambda i: i.status == pb.JOB_STATUS_RUNNING, "the job did not run again")
    time.sleep(DECISION_DELAY_S + 0.5)  # long enough for a wrong second failover to have started
    info = client.job_info(JOB)
    assert (info.status, info.restarts) == (pb.JOB_STATUS_RUNNING, 1), info.failure_cause
    hosted = sorted(s.subtask_index for t in client.cluster().taskmanagers for s in t.slots if s.job_id == JOB)
    assert hosted == [0, 1]
    assert sorted(s.subtask.subtask_index for s in tm.host.slots.all()) == [0, 1], "the TaskManager released its slots"
    assert [state.get(key) for key in keys] == list(range(50))


def test_a_release_that_fails_on_the_old_address_leaves_the_new_registration_alone(inprocess_cluster: Any) -> None:
    # The restart strategy's delay lets the TaskManager come back before the restart releases the
    # old deployment: that release goes to the old process's address and fails (nothing listens).
    slow_restart = {**FAST_RESTARTS, "restart-strategy.fixed-delay.delay": "3 s"}
    cluster = inprocess_cluster(taskmanagers=1, slots=2, jm=slow_restart)
    client = cluster.client()
    client.submit_job(JOB, operators(2))
    state = ValueState[str, int](client, JOB, OPERATOR, "last")
    state.put("k", 7)
    client.trigger_checkpoint(JOB, wait=True)

    cluster.taskmanagers[0].stop(grace_s=1)
    _wait_for(client, lambda i: i.status == pb.JOB_STATUS_RESTARTING, "the job did not fail over")
    tm = cluster.add_taskmanager(**{"taskmanager.resource-id": "tm-0"})
    assert tm.connection.registrations == 1

    info = _wait_for(client, lambda i: i.status == pb.JOB_STATUS_RUNNING, "the job did not run again")
    assert info.restarts == 1, info.failure_cause
    # Declared lost for the old process's release, it would have had to register again.
    assert tm.connection.registrations == 1, "the JobManager declared the new registration lost"
    assert state.get("k") == 7
