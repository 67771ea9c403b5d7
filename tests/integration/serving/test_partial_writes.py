"""A direct write over several subtasks that fails on one of them says exactly what was applied.

The client checks a whole call against the limits it knows before sending any of it, but some
refusals depend on the state a TaskManager holds (a list at ``state.limits.list.max-elements``),
and a TaskManager can be lost while a call is in flight. Then the error, and its ``outcome``,
name the keys applied on each subtask, those not applied, and those whose outcome is unknown;
resending only the keys not applied applies every key exactly once.
"""

from __future__ import annotations

from typing import Any

import pytest

from keyedstate.common.client import ListState
from keyedstate.common.errors import SizeLimitError, UnavailableError
from tests.integration.serving._support import JOB, OPERATOR, keys_of_subtask, operators

MAX_ELEMENTS = 3


def _events(client: Any) -> ListState[str, str]:
    return ListState(client, JOB, OPERATOR, "events", value_serializer="str")


@pytest.mark.parametrize("backend", ["rocksdb", "hashmap"])
def test_a_refusal_on_one_subtask_names_what_the_others_applied(inprocess_cluster: Any, backend: str) -> None:
    cluster = inprocess_cluster(
        taskmanagers=2, slots=1, backend=backend, tm={"state.limits.list.max-elements": str(MAX_ELEMENTS)}
    )
    client = cluster.client()
    routing = client.submit_job(JOB, operators(parallelism=2))
    events = _events(client)
    full = keys_of_subtask(routing, 1, 1, prefix="full")[0]
    events.append_many([full] * MAX_ELEMENTS, ["x"] * MAX_ELEMENTS)  # subtask 1's list is at the limit
    fresh = keys_of_subtask(routing, 0, 2, prefix="fresh")
    other = keys_of_subtask(routing, 1, 1, prefix="other")[0]
    keys = [fresh[0], full, fresh[1], other]

    # Only the TaskManager knows the list is full: subtask 0 applies its part, subtask 1 refuses its own.
    with pytest.raises(SizeLimitError) as info:
        events.append_many(keys, ["a", "b", "c", "d"])
    message = info.value.message
    assert "state.limits.list.max-elements" in message
    assert "applied in part" in message and "applied on subtask 0 (2 keys)" in message, message
    assert "not applied on subtask 1 (2 keys)" in message and "Send again only the keys not applied" in message
    outcome = info.value.outcome
    assert outcome is not None and outcome.method == "ListAppend"
    assert (outcome.applied, outcome.not_applied, outcome.unknown) == ((0, 2), (1, 3), ())
    assert events.get_many(keys) == [["a"], ["x"] * MAX_ELEMENTS, ["c"], []]

    # Resending what was not applied (without the full list's key) applies every key once.
    events.append_many([keys[i] for i in outcome.not_applied if keys[i] != full], ["d"])
    assert events.get_many(keys) == [["a"], ["x"] * MAX_ELEMENTS, ["c"], ["d"]]


def test_a_taskmanager_lost_mid_call_leaves_its_keys_unknown_and_names_the_applied_ones(inprocess_cluster: Any) -> None:
    # Without connection-loss detection the JobManager keeps routing to the TaskManager (its heartbeats
    # go on): the client meets a TaskManager that stopped serving in the middle of a call.
    cluster = inprocess_cluster(taskmanagers=2, slots=1, jm={"heartbeat.connection-loss-detection": "false"})
    client = cluster.client()
    routing = client.submit_job(JOB, operators(parallelism=2))
    events = _events(client)
    keys = keys_of_subtask(routing, 0, 2, prefix="a") + keys_of_subtask(routing, 1, 2, prefix="b")
    events.append_many(keys, ["0"] * 4)
    lost = next(tm for tm in cluster.taskmanagers if tm.address == routing.operator(OPERATOR).addresses[1])
    lost._server.stop(None)  # its KeyedState service is gone; nothing else about it changed

    with pytest.raises(UnavailableError) as info:
        events.append_many(keys, ["1"] * 4)
    message = info.value.message
    assert "outcome of this ListAppend is unknown" in message, message
    assert "applied on subtask 0 (2 keys)" in message and "outcome unknown on subtask 1 (2 keys)" in message, message
    assert "read them back before sending them again" in message
    outcome = info.value.outcome
    assert outcome is not None and (outcome.applied, outcome.not_applied, outcome.unknown) == ((0, 1), (), (2, 3))
    assert events.get_many(keys[:2]) == [["0", "1"], ["0", "1"]]
