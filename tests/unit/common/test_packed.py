"""The columnar wire's column codec (common.rpc.packed): round trips, and every malformed column refused."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.rpc.packed import pack, unpack


@given(st.lists(st.binary(max_size=300), max_size=200))
@settings(max_examples=200, deadline=None)
def test_pack_then_unpack_gives_the_items_back(items: list[bytes]) -> None:
    offsets, data = pack(items)
    assert len(offsets) == 4 * (len(items) + 1)
    assert data == b"".join(items)
    assert unpack(offsets, data, "col") == items


@given(st.binary(max_size=64), st.binary(max_size=64))
@settings(max_examples=500, deadline=None)
def test_arbitrary_bytes_are_items_or_an_invalid_argument_naming_the_field(offsets: bytes, data: bytes) -> None:
    try:
        items = unpack(offsets, data, "packed_things")
    except InvalidArgumentError as exc:
        assert exc.message.startswith("packed_things: ")
        return
    # Accepted: then it was a well-formed column, and it packs back to the same bytes.
    assert b"".join(items) == data
    if items:
        assert pack(items) == (offsets, data)


@pytest.mark.parametrize(
    "offsets,data,fragment",
    [
        (b"\x00\x00", b"", "not whole little-endian int32"),
        (struct.pack("<2i", 1, 1), b"x", "must start at 0"),
        (struct.pack("<3i", 0, 4, 2), b"abcd", "must not decrease: item #1 ends at 2 but starts at 4"),
        (struct.pack("<3i", 0, 2, -1), b"ab", "must not decrease"),
        (struct.pack("<2i", 0, 9), b"abc", "past the end of the 3 data bytes"),
        (struct.pack("<2i", 0, 1), b"abc", "before the end of the 3 data bytes"),
        (b"", b"abc", "no offsets"),
    ],
)
def test_malformed_columns_are_refused(offsets: bytes, data: bytes, fragment: str) -> None:
    with pytest.raises(InvalidArgumentError, match="^packed_values: ") as caught:
        unpack(offsets, data, "packed_values")
    assert fragment in caught.value.message


def test_an_empty_column_is_zero_items() -> None:
    assert pack([]) == (b"\x00\x00\x00\x00", b"")
    assert unpack(b"", b"", "c") == [] == unpack(b"\x00\x00\x00\x00", b"", "c")
