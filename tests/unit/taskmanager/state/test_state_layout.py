"""The stored key layout: encoding, decoding, ordering and the prefix properties backends rely on."""

from __future__ import annotations

import random

import pytest

from keyedstate.common.errors import KeyedStateError
from keyedstate.common.ids import KeyGroupRange
from keyedstate.taskmanager.state import layout


@pytest.mark.parametrize("n", [0, 1, 127, 128, 255, 300, 16383, 16384, 1 << 21, (1 << 32) + 5, (1 << 63) - 1])
def test_varint_round_trip(n: int) -> None:
    encoded = layout.encode_varint(n)
    assert layout.decode_varint(encoded + b"tail", 0) == (n, len(encoded))
    if n < 16384:
        assert layout.VARINT[n] == encoded


def test_varint_is_leb128() -> None:
    assert layout.encode_varint(0) == b"\x00"
    assert layout.encode_varint(127) == b"\x7f"
    assert layout.encode_varint(128) == b"\x80\x01"
    assert layout.encode_varint(300) == b"\xac\x02"


def test_truncated_or_overlong_varint_is_an_error() -> None:
    with pytest.raises(KeyedStateError, match="truncated"):
        layout.decode_varint(b"\x80\x80", 0)
    with pytest.raises(KeyedStateError, match="longer than"):
        layout.decode_varint(b"\xff" * 12, 0)


def test_value_key_layout_byte_for_byte() -> None:
    assert layout.key_prefix(258, b"abc", b"n") == b"\x01\x02" + b"\x03abc" + b"\x01n"
    assert layout.key_prefix(0, b"", b"") == b"\x00\x00\x00\x00"


def test_decode_value_list_and_map_keys() -> None:
    prefix = layout.key_prefix(5, b"key", b"ns")
    value = layout.decode_key(prefix)
    assert (value.key_group, value.key, value.namespace, value.suffix, value.prefix_len) == (
        5,
        b"key",
        b"ns",
        b"",
        len(prefix),
    )
    element = layout.decode_key(layout.list_element_key(prefix, 7))
    assert element.seq == 7 and element.key == b"key" and element.prefix_len == len(prefix)
    entry = layout.decode_key(layout.map_entry_key(prefix, b"\x00user"))
    assert entry.suffix == b"\x00user" and entry.namespace == b"ns"
    with pytest.raises(KeyedStateError):
        _ = entry.seq  # a map user key is not a sequence number
    assert layout.prefix_length(layout.map_entry_key(prefix, b"u")) == len(prefix)
    assert layout.key_group_of(prefix) == 5


def test_long_keys_use_multi_byte_lengths() -> None:
    key = b"k" * 20_000
    stored = layout.key_prefix(1, key, b"n" * 200)
    decoded = layout.decode_key(stored + b"user")
    assert decoded.key == key and decoded.namespace == b"n" * 200 and decoded.suffix == b"user"


@pytest.mark.parametrize("bad", [b"", b"\x00", b"\x00\x01\x05ab", b"\x00\x01\x01a\x09n"])
def test_decoding_malformed_keys_fails(bad: bytes) -> None:
    with pytest.raises(KeyedStateError):
        layout.decode_key(bad)


def test_prefixes_are_prefix_free_for_distinct_key_namespace_pairs() -> None:
    rng = random.Random(7)
    alphabet = [b"", b"a", b"ab", b"b", b"\x00", b"\x01", b"\xff", b"a\x00", b"\x01a"]
    pairs = {(k, n) for k in alphabet for n in alphabet}
    pairs |= {(rng.randbytes(rng.randrange(4)), rng.randbytes(rng.randrange(4))) for _ in range(300)}
    prefixes = {layout.key_prefix(3, k, n): (k, n) for k, n in pairs}
    assert len(prefixes) == len(pairs)
    for p in prefixes:
        for q in prefixes:
            assert p == q or not q.startswith(p), (prefixes[p], prefixes[q])


def test_list_elements_sort_by_sequence_and_map_entries_by_user_key() -> None:
    prefix = layout.key_prefix(9, b"k", b"")
    seqs = [0, 1, 2, 255, 256, 70_000, 1 << 40]
    assert sorted(layout.list_element_key(prefix, s) for s in reversed(seqs)) == [
        layout.list_element_key(prefix, s) for s in seqs
    ]
    user_keys = [b"b", b"", b"a", b"\xff", b"ab"]
    assert [layout.map_entry_key(prefix, u) for u in sorted(user_keys)] == sorted(
        layout.map_entry_key(prefix, u) for u in user_keys
    )


def test_prefix_end_bounds_every_extension() -> None:
    for prefix in (b"\x00\x05\x01a\x00", b"ab\xff", b"\x00\xff\xff"):
        end = layout.prefix_end(prefix)
        assert end is not None and end > prefix
        assert prefix + b"\xff" * 20 < end
        assert not end.startswith(prefix)
    assert layout.prefix_end(b"\xff\xff") is None
    assert layout.prefix_end(b"ab\xff") == b"ac"


def test_key_groups_are_contiguous_ranges() -> None:
    begin, end = layout.key_group_bounds(KeyGroupRange(32, 95))
    inside = layout.key_prefix(32, b"\xff" * 100, b"\xff") + b"\xff" * 10
    last = layout.key_prefix(95, b"\xff" * 100, b"\xff")
    assert begin <= layout.key_prefix(32, b"", b"") and inside < end and last < end
    assert layout.key_prefix(31, b"\xff" * 100, b"") < begin
    assert layout.key_prefix(96, b"", b"") >= end
    assert layout.key_group_bounds(KeyGroupRange(0, 32767)) == (b"\x00\x00", b"\x80\x00")


def test_outside_ranges_cover_everything_but_the_range() -> None:
    ranges = layout.outside_ranges(KeyGroupRange(32, 95))
    assert ranges == [(b"\x00\x00", b"\x00\x20"), (b"\x00\x60", b"\xff\xff")]
    assert layout.outside_ranges(KeyGroupRange(0, 127)) == [(b"\x00\x80", b"\xff\xff")]
    assert layout.outside_ranges(KeyGroupRange.empty()) == [(b"\x00\x00", b"\xff\xff")]
    for kg in (0, 31, 96, 32767):
        key = layout.key_prefix(kg, b"x", b"")
        assert any(b <= key < e for b, e in ranges)
    for kg in (32, 95):
        key = layout.key_prefix(kg, b"x", b"")
        assert not any(b <= key < e for b, e in ranges)


@pytest.mark.parametrize("max_key", [5, 16383, 16384, 40_000])
def test_bulk_builder_matches_key_prefix(max_key: int) -> None:
    keys = [b"a", b"bb" * 3, b"k" * max_key, b""]
    groups = [0, 17, 127, 32767]
    shared = layout.build_prefixes(groups, keys, b"ns", max(map(len, keys)))
    assert shared == [layout.key_prefix(g, k, b"ns") for g, k in zip(groups, keys)]
    namespaces = [b"", b"x", b"n" * 20_000, b"y"]
    per_key = layout.build_prefixes(groups, keys, namespaces, max(map(len, keys)))
    assert per_key == [layout.key_prefix(g, k, n) for g, k, n in zip(groups, keys, namespaces)]


@pytest.mark.parametrize("key_len", [0, 1, 16, 127, 128, 300])
@pytest.mark.parametrize("namespace", [b"", b"ns", b"n" * 200])
def test_uniform_builder_matches_key_prefix_and_sorts_stably(key_len: int, namespace: bytes) -> None:
    rng = random.Random(key_len)
    n = 500
    keys = [rng.randbytes(key_len) for _ in range(n)]
    keys[10] = keys[20] = keys[30]  # a key three times: its positions must stay in order
    groups = [rng.randrange(1 << 15) for _ in range(n)]
    expected = [layout.key_prefix(g, k, namespace) for g, k in zip(groups, keys)]
    unsorted = layout.uniform_stored_keys(groups, keys, namespace, key_len, sort=False)
    assert unsorted == (expected, None)
    built = layout.uniform_stored_keys(groups, keys, namespace, key_len, sort=True)
    assert built is not None
    stored, order = built
    assert order is not None and sorted(order) == list(range(n))
    assert stored == [expected[i] for i in order]
    assert stored == sorted(stored)  # byte order, as RocksDB compares
    repeated = [i for i in order if keys[i] == keys[30] and groups[i] == groups[30]]
    assert repeated == sorted(repeated)


def test_uniform_builder_declines_other_shapes() -> None:
    keys = [b"k%03d" % i for i in range(100)]
    groups = [1] * 100
    assert layout.uniform_stored_keys(groups, keys[:10], b"", 4, sort=True) is None  # too few to pay off
    assert layout.uniform_stored_keys(groups, [*keys[:99], b"longer"], b"", 6, sort=True) is None  # lengths differ
    assert layout.uniform_stored_keys(groups, keys, [b""] * 100, 4, sort=True) is None  # a namespace per key


@pytest.mark.parametrize("widths", ["equal", "mixed"])
def test_prefixed_in_order_gathers_payloads_behind_the_header(widths: str) -> None:
    rng = random.Random(3)
    payloads = [rng.randbytes(100 if widths == "equal" else rng.randrange(0, 200)) for _ in range(300)]
    order = list(range(300))
    rng.shuffle(order)
    assert layout.prefixed_in_order(b"\x01hdr", payloads, order) == [b"\x01hdr" + payloads[i] for i in order]
