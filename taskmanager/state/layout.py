"""The stored key layout shared by every backend, snapshot file and the offline inspector.

Every state lives in its own column family (RocksDB) or table (HashMap). Inside it a stored
key is::

    key_group (2 bytes, big-endian) | varint len(key) | key | varint len(ns) | ns | suffix

with ``suffix`` empty for value and reducing state, the user key for map state, and an 8-byte
big-endian sequence number for each list element. Consequences the backends rely on:

* Everything of one key group is one contiguous range ``[kg, kg + 1)`` (2-byte prefixes), so
  a restore clips foreign key groups with two ``delete_range`` calls.
* The lengths make ``prefix(kg, key, ns)`` prefix-free: every stored key starting with it
  belongs to exactly that (key, namespace), so one bounded scan yields a list's elements in
  sequence order or a map's entries sorted by user-key bytes.

Varints are LEB128 (7 bits per byte, low bits first), as in protobuf.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from keyedstate.common.errors import KeyedStateError, Reason
from keyedstate.common.ids import KeyGroupRange

logger = logging.getLogger(__name__)

LAYOUT_VERSION = 1
KEY_GROUP_BYTES = 2
SEQ_BYTES = 8
MAX_KEY_GROUPS = 1 << 15

# Lengths below this have a precomputed varint; longer ones (rare, > 16 KiB) are encoded on the fly.
_TABLE_SIZE = 1 << 14


def encode_varint(n: int) -> bytes:
    """LEB128 encoding of a non-negative int."""
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def decode_varint(data: bytes, pos: int) -> tuple[int, int]:
    """Decode a varint at ``pos``; returns (value, position after it)."""
    result = 0
    shift = 0
    while True:
        if pos >= len(data):
            raise KeyedStateError("truncated varint in a stored key", reason=Reason.INTERNAL)
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise KeyedStateError("varint longer than 9 bytes in a stored key", reason=Reason.INTERNAL)


VARINT: tuple[bytes, ...] = tuple(encode_varint(i) for i in range(_TABLE_SIZE))
"""``VARINT[n]`` is the encoding of ``n`` for ``n < 16384`` (the bulk builders index it)."""

KEY_GROUP_PREFIX: tuple[bytes, ...] = tuple(g.to_bytes(KEY_GROUP_BYTES, "big") for g in range(MAX_KEY_GROUPS))


def varint_len_prefix(data: bytes) -> bytes:
    """``varint(len(data)) + data``."""
    n = len(data)
    return (VARINT[n] if n < _TABLE_SIZE else encode_varint(n)) + data


def key_prefix(key_group: int, key: bytes, namespace: bytes) -> bytes:
    """The stored key of a value/reducing entry, and the prefix of every list/map entry of (key, ns)."""
    return KEY_GROUP_PREFIX[key_group] + varint_len_prefix(key) + varint_len_prefix(namespace)


def list_element_key(prefix: bytes, seq: int) -> bytes:
    return prefix + seq.to_bytes(SEQ_BYTES, "big")


def map_entry_key(prefix: bytes, user_key: bytes) -> bytes:
    return prefix + user_key


def namespace_suffix(namespace: bytes) -> bytes:
    """The part after the key, precomputed once when a whole batch shares one namespace."""
    return varint_len_prefix(namespace)


def build_prefixes(
    key_groups: list[int], keys: list[bytes], namespace: bytes | list[bytes], max_key_len: int
) -> list[bytes]:
    """Stored prefixes of many keys with one concatenation each (the hot path of every call).

    ``max_key_len`` is the longest key of the batch (already computed for the size check); it
    picks the table-driven path when every length has a precomputed varint.
    """
    kgp = KEY_GROUP_PREFIX
    if isinstance(namespace, bytes):
        nsp = namespace_suffix(namespace)
        if max_key_len < _TABLE_SIZE:
            vt = VARINT
            return [kgp[g] + vt[len(k)] + k + nsp for g, k in zip(key_groups, keys)]
        return [kgp[g] + varint_len_prefix(k) + nsp for g, k in zip(key_groups, keys)]
    return [kgp[g] + varint_len_prefix(k) + varint_len_prefix(n) for g, k, n in zip(key_groups, keys, namespace)]


_UNIFORM_MIN = 64
"""Below this many keys the numpy set-up costs more than the per-key concatenations it saves."""


def uniform_stored_keys(
    key_groups: list[int], keys: list[bytes], namespace: bytes | list[bytes], max_key_len: int, *, sort: bool
) -> tuple[list[bytes], list[int] | None] | None:
    """:func:`build_prefixes` for a batch of keys of one length under one namespace, built as one numpy
    matrix instead of three concatenations per key; None when the batch has another shape.

    With ``sort`` the stored keys come back in byte order (a stable sort: a repeated key keeps its
    writes' order, so the last one still wins) with the batch positions they came from; RocksDB
    inserts a sorted WriteBatch into its memtable faster (measured on 2000 keys: about 2.3 us
    per key unsorted, 1.9-2.1 us sorted), which is most of a put's cost.
    """
    n = len(keys)
    if n < _UNIFORM_MIN or not isinstance(namespace, bytes) or max_key_len >= _TABLE_SIZE:
        return None
    joined = b"".join(keys)
    if len(joined) != n * max_key_len:  # every length is at most the longest: equal sums mean equal lengths
        return None
    head = VARINT[max_key_len]
    tail = namespace_suffix(namespace)
    key_at = KEY_GROUP_BYTES + len(head)
    width = key_at + max_key_len + len(tail)
    rows = np.empty((n, width), dtype=np.uint8)
    rows[:, :KEY_GROUP_BYTES] = np.asarray(key_groups, dtype=">u2").view(np.uint8).reshape(n, KEY_GROUP_BYTES)
    rows[:, KEY_GROUP_BYTES:key_at] = np.frombuffer(head, dtype=np.uint8)
    rows[:, key_at : key_at + max_key_len] = np.frombuffer(joined, dtype=np.uint8).reshape(n, max_key_len)
    rows[:, key_at + max_key_len :] = np.frombuffer(tail, dtype=np.uint8)
    if not sort:
        return split_rows(rows), None
    # Fixed-width byte strings sort as their rows do; equal rows (one key twice) keep their order.
    order = np.argsort(rows.view(f"S{width}").ravel(), kind="stable")
    return split_rows(rows[order]), order.tolist()


def prefixed_in_order(header: bytes, payloads: Sequence[bytes], order: list[int]) -> list[bytes]:
    """``header + payloads[i]`` for each ``i`` of ``order`` (one numpy gather when the payloads share a length)."""
    n = len(payloads)
    width = max(map(len, payloads)) if n >= _UNIFORM_MIN else -1
    joined = b"".join(payloads) if width >= 0 else b""
    if width < 0 or len(joined) != n * width:  # every length is at most the longest: equal sums mean equal lengths
        return [header + payloads[i] for i in order]
    rows = np.empty((n, len(header) + width), dtype=np.uint8)
    rows[:, : len(header)] = np.frombuffer(header, dtype=np.uint8)
    rows[:, len(header) :] = np.frombuffer(joined, dtype=np.uint8).reshape(n, width)[order]
    return split_rows(rows)


def split_rows(rows: np.ndarray[tuple[int, int], np.dtype[np.uint8]]) -> list[bytes]:
    """Each row of a C-contiguous byte matrix as bytes (pyarrow splits in C)."""
    n, width = rows.shape
    data = np.ascontiguousarray(rows)
    offsets = np.arange(0, (n + 1) * width, width, dtype=np.int32)
    column = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    items: list[bytes] = column.to_pylist()
    return items


@dataclass(frozen=True)
class StoredKey:
    """A decoded stored key."""

    key_group: int
    key: bytes
    namespace: bytes
    suffix: bytes
    """User key (map), 8-byte sequence number (list) or empty (value, reducing)."""
    prefix_len: int
    """Length of the (key group, key, namespace) prefix within the stored key."""

    @property
    def seq(self) -> int:
        """The sequence number of a list element."""
        if len(self.suffix) != SEQ_BYTES:
            raise KeyedStateError(
                f"stored key suffix of {len(self.suffix)} bytes is not a list sequence number", reason=Reason.INTERNAL
            )
        return int.from_bytes(self.suffix, "big")


def decode_key(stored: bytes) -> StoredKey:
    """Split a stored key into its parts; raises on malformed input (corrupt data)."""
    if len(stored) < KEY_GROUP_BYTES + 2:
        raise KeyedStateError(f"stored key of {len(stored)} bytes is too short to be valid", reason=Reason.INTERNAL)
    kg = int.from_bytes(stored[:KEY_GROUP_BYTES], "big")
    key_len, pos = decode_varint(stored, KEY_GROUP_BYTES)
    key_end = pos + key_len
    ns_len, ns_pos = decode_varint(stored, key_end)
    ns_end = ns_pos + ns_len
    if key_end > len(stored) or ns_end > len(stored):
        raise KeyedStateError("stored key is shorter than the lengths it declares", reason=Reason.INTERNAL)
    return StoredKey(kg, stored[pos:key_end], stored[ns_pos:ns_end], stored[ns_end:], ns_end)


def prefix_length(stored: bytes) -> int:
    """Length of the (key group, key, namespace) prefix of a stored key, without copying parts."""
    key_len, pos = decode_varint(stored, KEY_GROUP_BYTES)
    ns_len, ns_pos = decode_varint(stored, pos + key_len)
    return ns_pos + ns_len


def key_group_of(stored: bytes) -> int:
    return int.from_bytes(stored[:KEY_GROUP_BYTES], "big")


def prefix_end(prefix: bytes) -> bytes | None:
    """The smallest byte string greater than every string starting with ``prefix``.

    None when no such string exists (the prefix is all 0xFF), meaning "no upper bound".
    """
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes((stripped[-1] + 1,))


def key_prefix_end(prefix: bytes) -> bytes:
    """:func:`prefix_end` of a stored key's prefix, which always has one: it starts with a key
    group below ``UPPER_BOUND_MAX_PARALLELISM`` (0x8000), never with 0xFF."""
    end = prefix_end(prefix)
    if end is None:
        raise ValueError(f"{prefix[:8]!r}... is not the prefix of a stored key")
    return end


def key_group_bounds(key_groups: KeyGroupRange) -> tuple[bytes, bytes]:
    """``[begin, end)`` covering every stored key of the key groups of the range."""
    return key_groups.start.to_bytes(KEY_GROUP_BYTES, "big"), (key_groups.end + 1).to_bytes(KEY_GROUP_BYTES, "big")


def outside_ranges(key_groups: KeyGroupRange) -> list[tuple[bytes, bytes]]:
    """``[begin, end)`` ranges covering every key group *outside* ``key_groups`` (for clipping)."""
    if len(key_groups) == 0:
        return [(b"\x00\x00", b"\xff\xff")]
    begin, end = key_group_bounds(key_groups)
    ranges = []
    if key_groups.start > 0:
        ranges.append((b"\x00\x00", begin))
    # Key groups stay below 2**15, so no stored key starts with 0xFFFF.
    ranges.append((end, b"\xff\xff"))
    return ranges
