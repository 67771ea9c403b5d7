"""Columns of byte strings in Arrow's binary layout: the columnar wire (KeyedRequest version 2).

A column of ``n`` items travels as two byte strings: ``n + 1`` little-endian int32 offsets and
the items laid end to end (``PackedBytes`` in taskmanager.proto). numpy and one join build a
column from a list and pyarrow splits one back into a list, in C, about 20-40 ns per 100-byte
item, where a protobuf ``repeated bytes`` field costs Python work per element on both ends
(measured on this machine: ~110 ns per item and column to build and serialize, ~35 ns to parse
and list).

:func:`unpack` trusts nothing: every malformed column (a ragged offsets buffer, offsets that do
not start at 0, that decrease, or that end before or past the data) is an
:class:`InvalidArgumentError` naming the field, checked with numpy over the whole column at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from keyedstate.common.errors import InvalidArgumentError

_OFFSET = np.dtype("<i4")
_EMPTY_OFFSETS = b"\x00\x00\x00\x00"
_MAX_DATA = (1 << 31) - 1


def pack(items: Sequence[bytes]) -> tuple[bytes, bytes]:
    """(offsets, data) of ``items``; InvalidArgumentError if they pass 2 GiB (int32 offsets).

    numpy and one join, not ``pa.array``: its first call in a process imports pandas (~0.4 s of
    CPU), which a short-lived executor task would pay on its first batch.
    """
    n = len(items)
    if not n:
        return _EMPTY_OFFSETS, b""
    offsets = np.empty(n + 1, dtype=np.int64)
    offsets[0] = 0
    np.cumsum(np.fromiter(map(len, items), dtype=np.int64, count=n), out=offsets[1:])
    if offsets[-1] > _MAX_DATA:
        raise InvalidArgumentError(f"a column of {n} items holds more than {_MAX_DATA} bytes; send smaller batches")
    return offsets.astype(_OFFSET).tobytes(), b"".join(items)


def unpack(offsets: bytes, data: bytes, field: str) -> list[bytes]:
    """The items of a packed column; InvalidArgumentError naming ``field`` when it is malformed."""
    if not offsets:
        if data:
            raise InvalidArgumentError(
                f"{field}: {len(data)} data bytes but no offsets; send count + 1 int32 offsets (Arrow binary layout)"
            )
        return []
    if len(offsets) % 4:
        raise InvalidArgumentError(
            f"{field}: offsets of {len(offsets)} bytes are not whole little-endian int32 values (count + 1 of them)"
        )
    offs = np.frombuffer(offsets, dtype=_OFFSET)
    n = len(offs) - 1
    if offs[0] != 0:
        raise InvalidArgumentError(f"{field}: offsets must start at 0, got {int(offs[0])}")
    if n and (steps := np.diff(offs) < 0).any():
        i = int(np.argmax(steps))
        raise InvalidArgumentError(
            f"{field}: offsets must not decrease: item #{i} ends at {int(offs[i + 1])} but starts at {int(offs[i])}"
        )
    last = int(offs[-1])
    if last != len(data):
        where = "past the end of" if last > len(data) else "before the end of"
        raise InvalidArgumentError(
            f"{field}: the last offset {last} is {where} the {len(data)} data bytes; it must equal their length"
        )
    if not n:
        return []
    column = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    items: list[bytes] = column.to_pylist()
    return items
