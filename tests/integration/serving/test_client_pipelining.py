"""The client splits a call into batch-size requests and pipelines them; results and order must not suffer.

Requests of one subtask may overtake each other in flight, so the client keeps several in flight
only when their order cannot matter (reads, writes of distinct keys) and sends repeated keys'
writes one request at a time.
"""

from __future__ import annotations

from typing import Any

import pytest

from keyedstate.common.client import ListState, MapState, ReducingState, ValueState
from tests.integration.serving._support import JOB, OPERATOR, keys_of_subtask, operators


@pytest.fixture(params=[1, 2], ids=["one-subtask", "two-subtasks"])
def handles(request: pytest.FixtureRequest, inprocess_cluster: Any) -> tuple[Any, int]:
    cluster = inprocess_cluster(taskmanagers=request.param, slots=1)
    client = cluster.client(batch_size=7, max_in_flight=8)
    client.submit_job(JOB, operators(parallelism=request.param))
    return client, request.param


def test_batched_reads_and_writes_come_back_in_key_order(handles: tuple[Any, int]) -> None:
    client, _ = handles
    last: ValueState[str, int] = ValueState(client, JOB, OPERATOR, "last", value_serializer="int")
    keys = [f"k{i}" for i in range(250)]
    last.put_many(keys, list(range(250)))
    assert last.get_many(keys) == list(range(250))
    # A read of more keys than were written, missing ones in between, still lines up.
    mixed = [k for i, k in enumerate(keys) for k in (k, f"missing-{i}")]
    assert last.get_many(mixed) == [v for i in range(250) for v in (i, None)]


def test_repeated_keys_keep_the_callers_order_across_requests(handles: tuple[Any, int]) -> None:
    client, _ = handles
    events: ListState[str, int] = ListState(client, JOB, OPERATOR, "events", value_serializer="int")
    last: ValueState[str, int] = ValueState(client, JOB, OPERATOR, "last", value_serializer="int")
    # 300 appends to 3 keys travel in 43 requests; if two of them overtook each other, a list
    # would come back out of order.
    keys = ["a", "b", "c"] * 100
    events.append_many(keys, list(range(300)))
    assert events.get_many(["a", "b", "c"]) == [list(range(s, 300, 3)) for s in range(3)]
    # The last write of a repeated key wins, even when it is many requests after the first.
    last.put_many(["x"] * 60 + ["y"] * 60, list(range(120)))
    assert last.get_many(["x", "y"]) == [59, 119]


def test_list_update_longer_than_a_batch_replaces_the_whole_list(handles: tuple[Any, int]) -> None:
    client, _ = handles
    events: ListState[str, int] = ListState(client, JOB, OPERATOR, "events", value_serializer="int")
    events.append_many(["k"] * 3, [-1, -2, -3])
    events.update("k", list(range(50)))  # 50 values > batch_size 7: one request all the same
    assert events.get("k") == list(range(50))


def test_reduce_returns_values_aligned_with_their_keys(handles: tuple[Any, int]) -> None:
    client, parallelism = handles
    totals = ReducingState[str](client, JOB, OPERATOR, "totals")
    routing = client.routing(JOB)
    keys = [k for s in range(parallelism) for k in keys_of_subtask(routing, s, 40)]
    first = totals.add_many(keys, [(i,) for i in range(len(keys))], return_values=True)
    assert first == [(i,) for i in range(len(keys))]
    again = totals.add_many(keys + keys[:5], [(1,)] * (len(keys) + 5), return_values=True)
    assert again == [(i + 1,) for i in range(len(keys))] + [(i + 2,) for i in range(5)]


def test_every_bulk_call_reads_back_the_same_over_both_wire_versions(handles: tuple[Any, int]) -> None:
    """The first requests of a routing version go out as repeated fields, the rest packed (the TaskManager
    advertised the columnar wire): every kind of bulk call must give the same answers across the switch."""
    client, _ = handles
    attrs: MapState[str, str, int] = MapState(client, JOB, OPERATOR, "attrs", value_serializer="int")
    totals: ReducingState[str] = ReducingState(client, JOB, OPERATOR, "totals")
    last: ValueState[str, bytes] = ValueState(client, JOB, OPERATOR, "last", value_serializer="bytes", namespace=b"w1")
    keys = [f"m{i}" for i in range(60)]
    attrs.put_many(keys, [f"u{i % 3}" for i in range(60)], list(range(60)))
    assert attrs.get_many(keys, [f"u{i % 3}" for i in range(60)]) == list(range(60))
    assert attrs.contains_many(keys, ["u0"] * 60) == [i % 3 == 0 for i in range(60)]
    attrs.remove_many(keys[:30], [f"u{i % 3}" for i in range(30)])
    assert attrs.get_many(keys, [f"u{i % 3}" for i in range(60)]) == [None] * 30 + list(range(30, 60))
    out = totals.add_many(keys * 2, [(1,)] * 120, return_values=True)
    assert out == [(1,)] * 60 + [(2,)] * 60
    assert totals.get_many([*keys, "none"]) == [(2,)] * 60 + [None]
    values = [b"", *(bytes([i]) * i for i in range(1, 60))]  # an empty value is found, not missing
    last.put_many(keys, values)
    assert last.get_many([*keys, "none"]) == [*values, None]
    last.clear_many(keys[::2])
    assert last.get_many(keys) == [None if i % 2 == 0 else v for i, v in enumerate(values)]
    routing = client.routing(JOB)
    for address in set(routing.operator(OPERATOR).addresses):
        assert client._wire.columnar(address, routing.version)
