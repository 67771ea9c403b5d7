"""Stored value headers, TTL expiry rules, and the reducing-state vector arithmetic."""

from __future__ import annotations

import math
import struct

import pytest

from keyedstate.common.descriptors import (
    NumberType,
    ReduceField,
    ReduceFunction,
    StateDescriptor,
    StateKind,
    TtlConfig,
    TtlUpdateType,
)
from keyedstate.common.errors import InvalidArgumentError, KeyedStateError
from keyedstate.taskmanager.state.reducing import Reducer
from keyedstate.taskmanager.state.values import ValueCodec, payload_of, timestamp_of, ttl_header

NOW = 1_700_000_000_000


def codec(ttl: int | None, on_read: bool = False) -> ValueCodec:
    update = TtlUpdateType.ON_READ_AND_WRITE if on_read else TtlUpdateType.ON_CREATE_AND_WRITE
    return ValueCodec.for_descriptor(StateDescriptor("s", StateKind.VALUE, TtlConfig(ttl, update) if ttl else None))


def test_plain_values_have_a_one_byte_header() -> None:
    c = codec(None)
    assert c.encode_many([b"abc", b""], NOW) == [b"\x00abc", b"\x00"]
    assert c.decode_many([b"\x00abc", None, b"\x00"], NOW) == [b"abc", None, b""]
    assert not c.has_ttl and not c.update_on_read


def test_ttl_values_carry_the_write_time() -> None:
    c = codec(1000, on_read=True)
    stored = c.encode_many([b"abc"], NOW)[0]
    assert stored == b"\x01" + NOW.to_bytes(8, "big") + b"abc"
    assert timestamp_of(stored) == NOW and payload_of(stored) == b"abc"
    assert c.update_on_read
    assert timestamp_of(c.refreshed(stored, NOW + 5)) == NOW + 5


def test_expiry_is_at_timestamp_plus_ttl_as_in_flink() -> None:
    c = codec(1000)
    stored = ttl_header(NOW) + b"v"
    assert c.decode(stored, NOW + 999) == b"v" and not c.is_expired(stored, NOW + 999)
    assert c.decode(stored, NOW + 1000) is None and c.is_expired(stored, NOW + 1000)
    assert c.decode_many([stored, None], NOW + 1000) == [None, None]


def test_formats_are_readable_across_ttl_changes() -> None:
    with_ttl = ttl_header(NOW) + b"v"
    assert codec(None).decode(with_ttl, NOW * 2) == b"v"  # TTL disabled: the timestamp is ignored
    assert codec(None).decode_many([with_ttl], NOW * 2) == [b"v"]
    assert codec(10).decode(b"\x00v", NOW * 2) == b"v"  # written without TTL: never expires
    assert not codec(10).is_expired(b"\x00v", NOW * 2)


@pytest.mark.parametrize("c", [codec(None), codec(10)])
def test_unknown_format_byte_is_reported_as_corrupt(c: ValueCodec) -> None:
    with pytest.raises(KeyedStateError, match="corrupt"):
        c.decode(b"\x07junk", NOW)
    with pytest.raises(KeyedStateError, match="corrupt"):
        c.decode_many([b"\x07junk"], NOW)
    with pytest.raises(KeyedStateError, match="corrupt"):
        c.is_expired(b"\x07junk", NOW)


def reducer(*fields: ReduceField) -> Reducer:
    return Reducer(StateDescriptor("r", StateKind.REDUCING, reduce_fields=fields))


def test_reducer_combines_per_field() -> None:
    r = reducer(
        ReduceField("sum_i"),
        ReduceField("sum_f", ReduceFunction.SUM, NumberType.FLOAT64),
        ReduceField("min", ReduceFunction.MIN, NumberType.INT64),
        ReduceField("max", ReduceFunction.MAX, NumberType.FLOAT64),
    )
    fmt = struct.Struct(">qdqd")
    assert r.size == 32
    assert r.combine(None, fmt.pack(1, 0.5, 3, -1.0)) == fmt.pack(1, 0.5, 3, -1.0)
    out = r.combine(fmt.pack(1, 0.5, 3, -1.0), fmt.pack(2, 0.25, -4, 7.5))
    assert fmt.unpack(out) == (3, 0.75, -4, 7.5)


def test_reducer_int_overflow_wraps_and_floats_follow_ieee() -> None:
    r = reducer(ReduceField("a"), ReduceField("b", ReduceFunction.SUM, NumberType.FLOAT64))
    fmt = struct.Struct(">qd")
    out = fmt.unpack(r.combine(fmt.pack(-(1 << 63), 1e308), fmt.pack(-1, 1e308)))
    assert out[0] == (1 << 63) - 1 and math.isinf(out[1])


def test_reducer_checks_operand_sizes_naming_the_fields() -> None:
    r = reducer(ReduceField("count"), ReduceField("peak", ReduceFunction.MAX, NumberType.FLOAT64))
    r.check_operands([b"\x00" * 16])
    with pytest.raises(InvalidArgumentError, match=r"operand 1 .*count:int64, peak:float64"):
        r.check_operands([b"\x00" * 16, b"\x00" * 8])
