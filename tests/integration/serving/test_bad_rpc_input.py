"""Bad keyed-state calls, through raw gRPC stubs and through the client, on both backends.

Every refused call must come back with the right status code, the typed reason in the trailing
metadata and a message naming the fix, must change nothing, and must leave the TaskManager
serving other calls correctly.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from keyedstate.common._proto.v1 import taskmanager_pb2 as tm_pb
from keyedstate.common._proto.v1 import taskmanager_pb2_grpc as tm_grpc
from keyedstate.common.client import ListState, MapState, ReducingState, Routing, StateClient, ValueState
from keyedstate.common.errors import (
    InvalidArgumentError,
    NotFoundError,
    Reason,
    SizeLimitError,
    WrongStateKindError,
)
from keyedstate.common.rpc.packed import pack, unpack
from keyedstate.common.rpc.status import status_code
from tests.integration.serving._support import (
    JOB,
    OPERATOR,
    key_of_subtask,
    keys_of_subtask,
    operators,
    reason,
    rpc_error,
)

MAX_KEY = 64
MAX_VALUE = 128
MAX_LIST_RESPONSE = 1024
LIMITS = {
    "state.limits.max-key-bytes": str(MAX_KEY),
    "state.limits.max-value-bytes": str(MAX_VALUE),
    "state.limits.list.max-response-bytes": str(MAX_LIST_RESPONSE),
}


@dataclass
class Serving:
    client: StateClient
    routing: Routing
    stub: tm_grpc.KeyedStateStub
    """A raw stub to the TaskManager hosting subtask 0."""
    key0: bytes
    """A key subtask 0 owns."""
    key1: bytes
    """A key subtask 1 owns."""
    good_calls: int = 0

    def target(self, state: str, *, job: str = JOB, operator: str = OPERATOR, subtask: int = 0) -> tm_pb.StateTarget:
        return tm_pb.StateTarget(
            job_id=job,
            operator_id=operator,
            subtask_index=subtask,
            state_name=state,
            routing_version=self.routing.version,
        )

    def call(self, method: str, state: str, **fields: Any) -> Any:
        target = fields.pop("target", None) or self.target(state)
        return getattr(self.stub, method)(tm_pb.KeyedRequest(target=target, **fields), timeout=10)

    def assert_still_serving(self) -> None:
        """A good write and read, raw and through the client, on the TaskManager that refused the bad call."""
        self.good_calls += 1
        key = key_of_subtask(self.routing, 0, prefix=f"good{self.good_calls}")
        value = f"v{self.good_calls}".encode()
        assert self.call("ValuePut", "last", keys=[key], values=[value]).applied == 1
        got = self.call("ValueGet", "last", keys=[key])
        assert list(got.found) == [True] and list(got.values) == [value]
        state = ValueState[bytes, bytes](
            self.client, JOB, OPERATOR, "last", key_serializer="bytes", value_serializer="bytes"
        )
        assert state.get(key) == value


@pytest.fixture(params=["rocksdb", "hashmap"])
def serving(request: pytest.FixtureRequest, inprocess_cluster: Any) -> Iterator[Serving]:
    cluster = inprocess_cluster(taskmanagers=2, slots=2, backend=request.param, tm=LIMITS)
    client = cluster.client()
    routing = client.submit_job(JOB, operators(parallelism=2))
    addresses = routing.operator(OPERATOR).addresses
    # The spread puts the two subtasks on different TaskManagers; the stale-routing cases need it.
    assert addresses[0] != addresses[1]
    channel = grpc.insecure_channel(addresses[0])
    try:
        yield Serving(
            client, routing, tm_grpc.KeyedStateStub(channel), key_of_subtask(routing, 0), key_of_subtask(routing, 1)
        )
    finally:
        channel.close()


def _assert_refused(err: grpc.Call, code: grpc.StatusCode, why: str, *fragments: str) -> None:
    assert err.code() is code, err.details()
    assert reason(err) == why, (reason(err), err.details())
    for fragment in fragments:
        assert fragment in err.details(), f"{fragment!r} not in {err.details()!r}"


# -- size limits ---------------------------------------------------------------------------------


def test_key_over_max_key_bytes_is_invalid_argument_and_the_limit_is_inclusive(serving: Serving) -> None:
    s = serving
    at_limit = key_of_subtask(s.routing, 0, length=MAX_KEY)
    assert s.call("ValuePut", "last", keys=[at_limit], values=[b"ok"]).applied == 1

    too_long = key_of_subtask(s.routing, 0, length=MAX_KEY + 1)
    err = rpc_error(lambda: s.call("ValuePut", "last", keys=[too_long], values=[b"v"]))
    _assert_refused(
        err, grpc.StatusCode.INVALID_ARGUMENT, "SIZE_LIMIT", "state.limits.max-key-bytes", str(MAX_KEY), "shorter keys"
    )
    # Reads are checked too: an oversized key cannot be stored, so asking for one is a caller bug.
    err = rpc_error(lambda: s.call("ValueGet", "last", keys=[too_long]))
    _assert_refused(err, grpc.StatusCode.INVALID_ARGUMENT, "SIZE_LIMIT", "state.limits.max-key-bytes")
    assert list(s.call("ValueGet", "last", keys=[at_limit]).values) == [b"ok"]
    s.assert_still_serving()


@pytest.mark.parametrize(
    "method,state,extra",
    [
        ("ValuePut", "last", {}),
        ("ListAppend", "events", {}),
        ("ListUpdate", "events", {}),
        ("MapPut", "attrs", {"user_keys": [b"uk"]}),
    ],
)
def test_value_over_max_value_bytes_is_invalid_argument(
    serving: Serving, method: str, state: str, extra: dict[str, Any]
) -> None:
    s = serving
    assert s.call(method, state, keys=[s.key0], values=[b"x" * MAX_VALUE], **extra).applied == 1
    err = rpc_error(lambda: s.call(method, state, keys=[s.key0], values=[b"x" * (MAX_VALUE + 1)], **extra))
    _assert_refused(err, grpc.StatusCode.INVALID_ARGUMENT, "SIZE_LIMIT", "state.limits.max-value-bytes", str(MAX_VALUE))
    s.assert_still_serving()


def test_map_user_key_over_max_key_bytes_is_invalid_argument(serving: Serving) -> None:
    s = serving
    err = rpc_error(lambda: s.call("MapPut", "attrs", keys=[s.key0], user_keys=[b"u" * (MAX_KEY + 1)], values=[b"v"]))
    _assert_refused(err, grpc.StatusCode.INVALID_ARGUMENT, "SIZE_LIMIT", "user key #0", "state.limits.max-key-bytes")
    s.assert_still_serving()


def test_a_batch_with_one_bad_entry_applies_nothing(serving: Serving) -> None:
    """The client retries a refused non-idempotent call only because the server applied none of it."""
    s = serving
    keys = [key_of_subtask(s.routing, 0, prefix=f"batch{i}") for i in range(3)]
    for method, state, values, extra in [
        ("ValuePut", "last", [b"a", b"x" * (MAX_VALUE + 1), b"c"], {}),
        ("ListAppend", "events", [b"a", b"b", b"x" * (MAX_VALUE + 1)], {}),
        ("MapPut", "attrs", [b"a", b"b", b"c"], {"user_keys": [b"u1", b"u" * (MAX_KEY + 1), b"u3"]}),
    ]:
        err = rpc_error(functools.partial(s.call, method, state, keys=keys, values=values, **extra))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert list(s.call("ValueGet", "last", keys=keys).found) == [False, False, False]
    assert [list(lst.elements) for lst in s.call("ListGet", "events", keys=keys).lists] == [[], [], []]
    assert list(s.call("MapGet", "attrs", keys=keys, user_keys=[b"u1", b"u2", b"u3"]).found) == [False] * 3
    s.assert_still_serving()


def test_oversized_key_and_value_through_the_client(serving: Serving) -> None:
    s = serving
    last = ValueState[bytes, bytes](s.client, JOB, OPERATOR, "last", key_serializer="bytes", value_serializer="bytes")
    with pytest.raises(SizeLimitError) as info:
        last.put(b"k" * (MAX_KEY + 1), b"v")
    assert info.value.reason is Reason.SIZE_LIMIT and "state.limits.max-key-bytes" in info.value.message
    assert status_code(info.value) is grpc.StatusCode.INVALID_ARGUMENT

    events = ListState[bytes, bytes](
        s.client, JOB, OPERATOR, "events", key_serializer="bytes", value_serializer="bytes"
    )
    other = key_of_subtask(s.routing, 0, prefix="other")
    with pytest.raises(SizeLimitError) as info:
        events.append_many([s.key0, other], [b"small", b"x" * (MAX_VALUE + 1)])
    assert "state.limits.max-value-bytes" in info.value.message
    # One request per subtask is all-or-nothing, and the refusal is not retried into a partial write.
    assert events.get_many([s.key0, other]) == [[], []]
    events.append_many([s.key0, other, s.key1], [b"a", b"b", b"c"])
    assert events.get_many([s.key0, other, s.key1]) == [[b"a"], [b"b"], [b"c"]]
    s.assert_still_serving()


@pytest.mark.parametrize("case", ["key", "value", "user key", "namespace"])
def test_a_call_over_several_subtasks_with_one_bad_entry_is_refused_before_anything_is_sent(
    serving: Serving, case: str
) -> None:
    """The client checks the whole call against the TaskManagers' limits: one bad entry changes nothing anywhere."""
    s = serving
    good = keys_of_subtask(s.routing, 0, 3, prefix="ok0") + keys_of_subtask(s.routing, 1, 3, prefix="ok1")
    keys = [k.encode() for k in good]
    values = [b"v%d" % i for i in range(len(keys))]
    user_keys = [b"u%d" % i for i in range(len(keys))]
    bad = 4  # a key of subtask 1; subtask 0's part of the call would be fine on its own
    namespace = b""
    if case == "key":
        keys[bad] = key_of_subtask(s.routing, 1, prefix="long", length=MAX_KEY + 1)
    elif case == "value":
        values[bad] = b"x" * (MAX_VALUE + 1)
    elif case == "user key":
        user_keys[bad] = b"u" * (MAX_KEY + 1)
    else:
        namespace = b"n" * (MAX_KEY + 1)
    events = ListState[bytes, bytes](
        s.client, JOB, OPERATOR, "events", key_serializer="bytes", value_serializer="bytes", namespace=namespace
    )
    attrs = MapState[bytes, bytes, bytes](
        s.client,
        JOB,
        OPERATOR,
        "attrs",
        key_serializer="bytes",
        user_key_serializer="bytes",
        value_serializer="bytes",
        namespace=namespace,
    )
    with pytest.raises(SizeLimitError) as info:
        if case == "user key":
            attrs.put_many(keys, user_keys, values)
        else:
            events.append_many(keys, values)
    message = info.value.message
    limit = "state.limits.max-value-bytes" if case == "value" else "state.limits.max-key-bytes"
    assert limit in message and "nothing of the call was sent" in message, message
    if case != "namespace":
        assert f"#{bad} of the call" in message or f"of key #{bad}" in message, message
    assert status_code(info.value) is grpc.StatusCode.INVALID_ARGUMENT

    # Nothing was applied on either subtask, so resending the fixed call applies it exactly once.
    plain = ListState[bytes, bytes](s.client, JOB, OPERATOR, "events", key_serializer="bytes", value_serializer="bytes")
    plain_map = MapState[bytes, bytes, bytes](
        s.client, JOB, OPERATOR, "attrs", key_serializer="bytes", user_key_serializer="bytes", value_serializer="bytes"
    )
    fixed = [k for i, k in enumerate(keys) if i != bad]
    assert plain.get_many(fixed) == [[]] * len(fixed)
    assert plain_map.get_many(fixed, [uk for i, uk in enumerate(user_keys) if i != bad]) == [None] * len(fixed)
    if case == "user key":
        user_keys[bad] = b"u-fixed"
        plain_map.put_many(keys, user_keys, values)
        assert plain_map.get_many(keys, user_keys) == values
    else:
        keys[bad] = key_of_subtask(s.routing, 1, prefix="fixed")
        values[bad] = b"fixed"
        plain.append_many(keys, values)
        assert plain.get_many(keys) == [[v] for v in values]
    s.assert_still_serving()


def test_list_too_large_for_get_names_the_client_method_that_streams_it(serving: Serving) -> None:
    s = serving
    events = ListState[bytes, bytes](
        s.client, JOB, OPERATOR, "events", key_serializer="bytes", value_serializer="bytes"
    )
    elements = [b"%03d" % i + b"x" * 97 for i in range(2 * MAX_LIST_RESPONSE // 100)]
    events.append_many([s.key0] * len(elements), elements)
    with pytest.raises(SizeLimitError) as info:
        events.get(s.key0)
    message = info.value.message
    assert "state.limits.list.max-response-bytes" in message and "ListState.scan(key)" in message, message
    assert "list_scan" not in message
    assert status_code(info.value) is grpc.StatusCode.INVALID_ARGUMENT
    assert list(events.scan(s.key0)) == elements  # the method the message names does read it
    s.assert_still_serving()


# -- unknown job / operator / subtask / state ----------------------------------------------------


@pytest.mark.parametrize("field,value", [("job", "no-such-job"), ("operator", "no-such-operator")])
def test_unknown_job_or_operator_is_stale_routing(serving: Serving, field: str, value: str) -> None:
    s = serving
    target = s.target("last", **{field: value})  # type: ignore[arg-type]  # field is job or operator, both str
    err = rpc_error(lambda: s.call("ValueGet", "last", target=target, keys=[s.key0]))
    _assert_refused(err, grpc.StatusCode.FAILED_PRECONDITION, "STALE_ROUTING", value, "refresh the routing table")
    s.assert_still_serving()


def test_subtask_not_hosted_here_is_stale_routing(serving: Serving) -> None:
    s = serving
    # Subtask 1 lives on the other TaskManager; this one hosts only subtask 0 of the job.
    err = rpc_error(
        lambda: s.call("ValuePut", "last", target=s.target("last", subtask=1), keys=[s.key1], values=[b"v"])
    )
    _assert_refused(err, grpc.StatusCode.FAILED_PRECONDITION, "STALE_ROUTING", "subtask 1", "refresh the routing table")
    err = rpc_error(
        lambda: s.call("ValuePut", "last", target=s.target("last", subtask=7), keys=[s.key1], values=[b"v"])
    )
    _assert_refused(err, grpc.StatusCode.FAILED_PRECONDITION, "STALE_ROUTING", "subtask 7")
    s.assert_still_serving()


def test_key_of_another_subtask_is_stale_routing_and_not_written(serving: Serving) -> None:
    s = serving
    err = rpc_error(lambda: s.call("ValuePut", "last", keys=[s.key0, s.key1], values=[b"a", b"b"]))
    _assert_refused(
        err, grpc.StatusCode.FAILED_PRECONDITION, "STALE_ROUTING", "key #1", "does not own", "refresh it and resend"
    )
    assert list(s.call("ValueGet", "last", keys=[s.key0]).found) == [False]
    err = rpc_error(lambda: s.call("ListGet", "events", keys=[s.key1]))
    _assert_refused(err, grpc.StatusCode.FAILED_PRECONDITION, "STALE_ROUTING", "does not own")
    s.assert_still_serving()


def test_unknown_state_is_not_found_naming_the_declared_states(serving: Serving) -> None:
    s = serving
    err = rpc_error(lambda: s.call("ValueGet", "no_such_state", keys=[s.key0]))
    _assert_refused(err, grpc.StatusCode.NOT_FOUND, "UNKNOWN_STATE", "no_such_state", "attrs, events, last, totals")
    s.assert_still_serving()


def test_unknown_job_operator_and_state_through_the_client(serving: Serving) -> None:
    s = serving
    with pytest.raises(NotFoundError) as info:
        ValueState(s.client, "no-such-job", OPERATOR, "last")
    assert info.value.reason is Reason.UNKNOWN_JOB
    assert "unknown job 'no-such-job'" in info.value.message and "submit it first" in info.value.message
    assert status_code(info.value) is grpc.StatusCode.NOT_FOUND
    with pytest.raises(NotFoundError) as info:
        s.client.routing("no-such-job")
    assert info.value.reason is Reason.UNKNOWN_JOB

    with pytest.raises(NotFoundError) as info:
        ValueState(s.client, JOB, "no-such-operator", "last")
    assert info.value.reason is Reason.UNKNOWN_OPERATOR
    assert "no operator 'no-such-operator'" in info.value.message and OPERATOR in info.value.message

    with pytest.raises(NotFoundError) as info:
        ValueState(s.client, JOB, OPERATOR, "no_such_state")
    assert info.value.reason is Reason.UNKNOWN_STATE
    assert "no_such_state" in info.value.message and "last" in info.value.message
    s.assert_still_serving()


# -- wrong state kind ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method,state,fields,names",
    [
        ("ListGet", "last", {}, "ValueGet"),
        ("ValuePut", "events", {"values": [b"v"]}, "ListAppend"),
        ("MapGet", "events", {"user_keys": [b"u"]}, "ListGet"),
        ("ListAppend", "attrs", {"values": [b"v"]}, "MapPut"),
        ("ValuePut", "totals", {"values": [b"v"]}, "Reduce"),
        ("Reduce", "last", {"values": [struct.pack(">q", 1)]}, "ValuePut"),
    ],
)
def test_wrong_state_kind_is_failed_precondition_naming_the_right_call(
    serving: Serving, method: str, state: str, fields: dict[str, Any], names: str
) -> None:
    s = serving
    err = rpc_error(lambda: s.call(method, state, keys=[s.key0], **fields))
    _assert_refused(err, grpc.StatusCode.FAILED_PRECONDITION, "WRONG_STATE_KIND", method, repr(state), names)
    s.assert_still_serving()


def test_wrong_state_kind_through_the_client(serving: Serving) -> None:
    s = serving
    with pytest.raises(WrongStateKindError) as info:
        ListState(s.client, JOB, OPERATOR, "last")
    assert "value state" in info.value.message and "ValueState" in info.value.message
    assert status_code(info.value) is grpc.StatusCode.FAILED_PRECONDITION

    # Past the handle check (a caller using keyed_call directly), the server's answer arrives typed.
    def build(target: tm_pb.StateTarget, indices: list[int] | range | None) -> tm_pb.KeyedRequest:
        return tm_pb.KeyedRequest(target=target, keys=[s.key0])

    with pytest.raises(WrongStateKindError) as info:
        s.client.keyed_call(JOB, OPERATOR, "last", "ListGet", [s.key0], build)
    assert info.value.reason is Reason.WRONG_STATE_KIND and "ValueGet" in info.value.message
    s.assert_still_serving()


# -- mismatched columns and malformed requests ---------------------------------------------------


@pytest.mark.parametrize(
    "method,state,fields,fragment",
    [
        ("ValuePut", "last", {"values": [b"a"]}, "1 values for 2 keys"),
        ("ListAppend", "events", {"values": [b"a", b"b", b"c"]}, "3 values for 2 keys"),
        ("MapPut", "attrs", {"user_keys": [b"u"], "values": [b"a", b"b"]}, "1 user keys for 2 keys"),
        ("MapGet", "attrs", {"user_keys": [b"u"]}, "1 user keys for 2 keys"),
        ("Reduce", "totals", {"values": [struct.pack(">q", 1)]}, "1 operands for 2 keys"),
        ("ValueGet", "last", {"namespaces": [b"ns"]}, "1 namespaces for 2 keys"),
    ],
)
def test_mismatched_column_lengths_are_invalid_argument(
    serving: Serving, method: str, state: str, fields: dict[str, Any], fragment: str
) -> None:
    s = serving
    keys = [s.key0, key_of_subtask(s.routing, 0, prefix="second")]
    err = rpc_error(lambda: s.call(method, state, keys=keys, **fields))
    _assert_refused(err, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", fragment)
    assert "per key" in err.details()
    s.assert_still_serving()


def test_malformed_reduce_operand_is_invalid_argument(serving: Serving) -> None:
    s = serving
    err = rpc_error(lambda: s.call("Reduce", "totals", keys=[s.key0], values=[b"\x01\x02"]))
    _assert_refused(err, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "2 bytes", "int64/float64")
    s.assert_still_serving()


def test_malformed_scans_are_invalid_argument(serving: Serving) -> None:
    s = serving

    def scan(method: str, **fields: Any) -> list[tm_pb.ScanChunk]:
        return list(getattr(s.stub, method)(tm_pb.ScanRequest(**fields), timeout=10))

    err = rpc_error(lambda: scan("ListScan", target=s.target("events")))
    _assert_refused(err, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "has_key")
    err = rpc_error(lambda: scan("MapScan", target=s.target("attrs"), has_key=True, key=s.key0, chunk_size=-1))
    _assert_refused(err, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "chunk_size")
    err = rpc_error(lambda: scan("ScanKeys", target=s.target("events", job="no-such-job")))
    _assert_refused(err, grpc.StatusCode.FAILED_PRECONDITION, "STALE_ROUTING")
    s.assert_still_serving()


def test_mismatched_lengths_through_the_client_are_refused_before_sending(serving: Serving) -> None:
    s = serving
    last = ValueState[str, int](s.client, JOB, OPERATOR, "last", value_serializer="int")
    attrs = MapState[str, str, int](s.client, JOB, OPERATOR, "attrs", value_serializer="int")
    totals = ReducingState[str](s.client, JOB, OPERATOR, "totals")
    keys = keys_of_subtask(s.routing, 0, 2)
    with pytest.raises(InvalidArgumentError, match=r"equal lengths \(keys=2, values=1\)"):
        last.put_many(keys, [1])
    with pytest.raises(InvalidArgumentError, match="equal lengths"):
        attrs.put_many(keys, ["u"], [1, 2])
    with pytest.raises(InvalidArgumentError, match=r"operands of 1 numbers"):
        totals.add(keys[0], (1, 2))
    assert last.get_many(keys) == [None, None]
    s.assert_still_serving()


# -- the columnar wire (wire version 2: packed_* columns) ------------------------------------------


def _packed(items: list[bytes]) -> tm_pb.PackedBytes:
    offsets, data = pack(items)
    return tm_pb.PackedBytes(offsets=offsets, data=data)


def _raw_column(offsets: list[int], data: bytes) -> tm_pb.PackedBytes:
    return tm_pb.PackedBytes(offsets=struct.pack(f"<{len(offsets)}i", *offsets), data=data)


@pytest.mark.parametrize(
    "field,column,fragment",
    [
        ("packed_keys", tm_pb.PackedBytes(offsets=b"\x00\x00\x00", data=b""), "not whole little-endian int32"),
        ("packed_keys", _raw_column([4, 8], b"12345678"), "must start at 0"),
        ("packed_user_keys", _raw_column([0, 5, 3], b"abcde"), "must not decrease: item #1"),
        ("packed_values", _raw_column([0, 3, 9], b"abcde"), "past the end of the 5 data bytes"),
        ("packed_values", _raw_column([0, 1, 2], b"abcde"), "before the end of the 5 data bytes"),
        ("packed_user_keys", tm_pb.PackedBytes(offsets=b"", data=b"x"), "no offsets"),
        ("packed_values", _packed([b"a"]), "1 items for 2 keys"),
        ("packed_user_keys", _packed([b"a", b"b", b"c"]), "3 items for 2 keys"),
        ("packed_namespaces", _packed([b"n1", b"n2", b"n3"]), "3 items for 2 keys"),
    ],
)
def test_malformed_packed_columns_are_invalid_argument_naming_the_field(
    serving: Serving, field: str, column: tm_pb.PackedBytes, fragment: str
) -> None:
    s = serving
    keys = [s.key0, key_of_subtask(s.routing, 0, prefix="second")]
    fields = {
        "packed_keys": _packed(keys),
        "packed_user_keys": _packed([b"u0", b"u1"]),
        "packed_values": _packed([b"v0", b"v1"]),
        field: column,
    }
    err = rpc_error(lambda: s.call("MapPut", "attrs", **fields))
    _assert_refused(err, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", field, fragment)
    # Nothing of the refused call was written.
    got = s.call("MapGet", "attrs", keys=keys, user_keys=[b"u0", b"u1"])
    assert list(got.found) == [False, False]
    s.assert_still_serving()


def test_a_request_mixing_packed_and_repeated_columns_is_invalid_argument(serving: Serving) -> None:
    s = serving
    mixed = {"packed_keys": _packed([s.key0]), "values": [b"v"]}
    err = rpc_error(lambda: s.call("ValuePut", "last", **mixed))
    _assert_refused(err, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "packed_keys", "values", "not both")
    err = rpc_error(lambda: s.call("ValuePut", "last", keys=[s.key0], packed_values=_packed([b"v"])))
    _assert_refused(err, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "packed_values without packed_keys")
    assert list(s.call("ValueGet", "last", keys=[s.key0]).found) == [False]
    s.assert_still_serving()


def test_packed_columns_keep_every_per_request_check(serving: Serving) -> None:
    """Sizes, ownership and state kinds are checked on packed columns exactly as on repeated ones."""
    s = serving
    too_long = key_of_subtask(s.routing, 0, length=MAX_KEY + 1)
    err = rpc_error(lambda: s.call("ValuePut", "last", packed_keys=_packed([too_long]), packed_values=_packed([b"v"])))
    _assert_refused(err, grpc.StatusCode.INVALID_ARGUMENT, "SIZE_LIMIT", "state.limits.max-key-bytes")
    big = b"x" * (MAX_VALUE + 1)
    err = rpc_error(lambda: s.call("ValuePut", "last", packed_keys=_packed([s.key0]), packed_values=_packed([big])))
    _assert_refused(err, grpc.StatusCode.INVALID_ARGUMENT, "SIZE_LIMIT", "state.limits.max-value-bytes")
    err = rpc_error(
        lambda: s.call("ValuePut", "last", packed_keys=_packed([s.key0, s.key1]), packed_values=_packed([b"a", b"b"]))
    )
    _assert_refused(err, grpc.StatusCode.FAILED_PRECONDITION, "STALE_ROUTING", "does not own")
    err = rpc_error(lambda: s.call("ValuePut", "events", packed_keys=_packed([s.key0]), packed_values=_packed([b"v"])))
    _assert_refused(err, grpc.StatusCode.FAILED_PRECONDITION, "WRONG_STATE_KIND", "ListAppend")
    err = rpc_error(lambda: s.call("Reduce", "totals", packed_keys=_packed([s.key0]), packed_values=_packed([b"\x01"])))
    _assert_refused(err, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "int64/float64")
    assert list(s.call("ValueGet", "last", keys=[s.key0, too_long[:MAX_KEY]]).found) == [False, False]
    s.assert_still_serving()


def test_packed_and_repeated_requests_are_served_alike_and_answered_in_their_own_version(serving: Serving) -> None:
    """An old client (repeated fields) and a new one (packed) read and write the same state; answers
    advertise the columnar version, and a found empty value is told apart from a missing one."""
    s = serving
    keys = [s.key0, key_of_subtask(s.routing, 0, prefix="empty"), key_of_subtask(s.routing, 0, prefix="absent")]
    put = s.call("ValuePut", "last", packed_keys=_packed(keys[:2]), packed_values=_packed([b"one", b""]))
    assert put.applied == 2 and put.wire_version == tm_pb.WIRE_VERSION_COLUMNAR
    old = s.call("ValueGet", "last", keys=keys)
    assert old.wire_version == tm_pb.WIRE_VERSION_COLUMNAR and not old.HasField("packed_values")
    assert list(old.values) == [b"one", b"", b""] and list(old.found) == [True, True, False]
    new = s.call("ValueGet", "last", packed_keys=_packed(keys))
    assert not new.values and not new.found
    assert unpack(new.packed_values.offsets, new.packed_values.data, "answer") == [b"one", b"", b""]
    assert new.found_mask == b"\x01\x01\x00"
    s.call("ValuePut", "last", keys=[keys[2]], values=[b"three"])
    again = s.call("ValueGet", "last", packed_keys=_packed(keys), namespace=b"")
    assert again.found_mask == b"\x01\x01\x01"
    contains = s.call("MapContains", "attrs", packed_keys=_packed(keys[:1]), packed_user_keys=_packed([b"u"]))
    assert contains.found_mask == b"\x00"
    s.call(
        "ListAppend",
        "events",
        packed_keys=_packed([keys[0], keys[2], keys[0]]),
        packed_values=_packed([b"a", b"", b"c"]),
    )
    lists = s.call("ListGet", "events", packed_keys=_packed(keys))
    assert not lists.lists and lists.wire_version == tm_pb.WIRE_VERSION_COLUMNAR
    assert unpack(lists.packed_elements.offsets, lists.packed_elements.data, "answer") == [b"a", b"c", b""]
    assert struct.unpack("<3i", lists.list_lengths) == (2, 0, 1)
    assert [list(v.elements) for v in s.call("ListGet", "events", keys=keys).lists] == [[b"a", b"c"], [], [b""]]
    s.assert_still_serving()


def test_the_client_sends_packed_columns_once_a_taskmanager_advertised_them(serving: Serving) -> None:
    s = serving
    state = ValueState[str, bytes](s.client, JOB, OPERATOR, "last", value_serializer="bytes")
    keys = keys_of_subtask(s.routing, 0, 50)
    address = s.routing.operator(OPERATOR).addresses[0]
    version = s.client.routing(JOB).version
    state.put_many(keys[:1], [b"first"])
    assert s.client._wire.columnar(address, version)  # learned from the first answer
    assert not s.client._wire.columnar(address, version + 1)  # a new routing version asks again
    values = [bytes([i]) * i for i in range(50)]
    state.put_many(keys, values)
    assert state.get_many([*keys, "absent"]) == [*values, None]
    s.assert_still_serving()
