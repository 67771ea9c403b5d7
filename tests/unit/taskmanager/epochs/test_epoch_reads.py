"""Read-your-writes inside an epoch transaction, for every state kind, against RocksDB and HashMap slots.

Each test stages writes through an attempt's view, checks that the attempt reads committed state
merged with its own writes (and that committed state is untouched), then commits and checks that
the backend ends up exactly where the attempt's reads said it would.
"""

from __future__ import annotations

import pytest

from keyedstate.common.errors import SizeLimitError
from keyedstate.taskmanager.state import StateLimits
from tests.unit.taskmanager.epochs.conftest import VEC, EpochHarness, vec


def test_value_reads_merge_committed_and_staged(harness: EpochHarness) -> None:
    b = harness.backend()
    b.value_put("v", [b"a", b"b", b"c"], [b"A", b"B", b"C"], b"")
    v = harness.view(1, 0, 7)
    v.value_put("v", [b"a", b"n"], [b"A1", b"N1"], b"")
    v.value_put("v", [b"a"], [b"A2"], b"")  # put after put: the last put
    v.clear("v", [b"b"], b"")
    v.clear("v", [b"c"], b"")
    v.value_put("v", [b"c"], [b"C2"], b"")  # put after clear: the put
    assert v.value_get("v", [b"a", b"b", b"c", b"n", b"zz"], b"") == [b"A2", None, b"C2", b"N1", None]
    assert b.value_get("v", [b"a", b"b", b"c", b"n"], b"") == [b"A", b"B", b"C", None]

    harness.commit(1, {0: 7})
    assert b.value_get("v", [b"a", b"b", b"c", b"n", b"zz"], b"") == [b"A2", None, b"C2", b"N1", None]


def test_value_reads_with_one_namespace_per_key(harness: EpochHarness) -> None:
    b = harness.backend()
    b.value_put("v", [b"k", b"k"], [b"n1", b"n2"], [b"ns1", b"ns2"])
    v = harness.view(1, 0, 1)
    v.value_put("v", [b"k"], [b"staged"], [b"ns2"])
    assert v.value_get("v", [b"k", b"k", b"k"], [b"ns1", b"ns2", b"ns3"]) == [b"n1", b"staged", None]
    harness.commit(1, {0: 1})
    assert b.value_get("v", [b"k", b"k"], [b"ns1", b"ns2"]) == [b"n1", b"staged"]


def test_reduce_folds_staged_operands_onto_committed_values(harness: EpochHarness) -> None:
    b = harness.backend()
    b.reduce("r", [b"a", b"b"], [vec(1, 2.0, 5), vec(10, 1.0, 1)], b"", False)
    v = harness.view(1, 0, 7)
    # Repeated keys in one batch return the running value after each operand.
    after = v.reduce("r", [b"a", b"a", b"z"], [vec(1, 1.0, 3), vec(1, 9.0, 9), vec(4, 4.0, 4)], b"", True)
    assert after is not None
    assert [VEC.unpack(x) for x in after] == [(2, 2.0, 3), (3, 9.0, 3), (4, 4.0, 4)]
    assert v.reduce("r", [b"a"], [vec(1, 0.0, 7)], b"", False) is None
    # Reduce after clear starts from the operand (the committed value is gone).
    v.clear("r", [b"b"], b"")
    assert [VEC.unpack(x) for x in v.reduce("r", [b"b"], [vec(2, 2.0, 2)], b"", True)] == [(2, 2.0, 2)]  # type: ignore[union-attr]
    expected = [(4, 9.0, 3), (2, 2.0, 2), (4, 4.0, 4)]
    assert [VEC.unpack(x) for x in v.value_get("r", [b"a", b"b", b"z"], b"")] == expected  # type: ignore[arg-type]
    assert [VEC.unpack(x) for x in b.value_get("r", [b"a", b"b"], b"")] == [(1, 2.0, 5), (10, 1.0, 1)]  # type: ignore[arg-type]

    harness.commit(1, {0: 7})
    assert [VEC.unpack(x) for x in b.value_get("r", [b"a", b"b", b"z"], b"")] == expected  # type: ignore[arg-type]


def test_cleared_reducing_value_reads_as_missing(harness: EpochHarness) -> None:
    b = harness.backend()
    b.reduce("r", [b"a"], [vec(1, 1.0, 1)], b"", False)
    v = harness.view(1, 0, 7)
    v.reduce("r", [b"a"], [vec(1, 1.0, 1)], b"", False)
    v.clear("r", [b"a"], b"")
    assert v.value_get("r", [b"a"], b"") == [None]
    harness.commit(1, {0: 7})
    assert b.value_get("r", [b"a"], b"") == [None]


def test_list_reads_merge_committed_and_staged(harness: EpochHarness) -> None:
    b = harness.backend()
    b.list_append("l", [b"a", b"a", b"b", b"c"], [b"1", b"2", b"x", b"old"], b"")
    v = harness.view(1, 0, 7)
    v.list_append("l", [b"a", b"n", b"a"], [b"3", b"n1", b"4"], b"")  # appends keep their order
    v.clear("l", [b"b"], b"")
    v.list_append("l", [b"b"], [b"y"], b"")  # append after clear: replaces the committed list
    v.list_update("l", [b"c", b"c"], [b"p", b"q"], b"")
    v.list_append("l", [b"c"], [b"r"], b"")
    expected = [[b"1", b"2", b"3", b"4"], [b"y"], [b"p", b"q", b"r"], [b"n1"], []]
    keys = [b"a", b"b", b"c", b"n", b"zz"]
    assert v.list_get("l", keys, b"") == expected
    assert [list(v.list_scan("l", k, b"")) for k in keys] == expected
    assert b.list_get("l", [b"a", b"b", b"c"], b"") == [[b"1", b"2"], [b"x"], [b"old"]]

    harness.commit(1, {0: 7})
    assert b.list_get("l", keys, b"") == expected


def test_list_update_then_clear_leaves_an_empty_list(harness: EpochHarness) -> None:
    b = harness.backend()
    b.list_append("l", [b"a"], [b"1"], b"")
    v = harness.view(1, 0, 7)
    v.list_update("l", [b"a"], [b"2"], b"")
    v.clear("l", [b"a"], b"")
    assert v.list_get("l", [b"a"], b"") == [[]]
    assert list(v.list_scan("l", b"a", b"")) == []
    harness.commit(1, {0: 7})
    assert b.list_get("l", [b"a"], b"") == [[]]


def test_list_scan_streams_a_long_staged_list_in_order(harness: EpochHarness) -> None:
    b = harness.backend()
    b.list_append("l", [b"a"] * 3, [b"c0", b"c1", b"c2"], b"")
    v = harness.view(1, 0, 7)
    staged = [b"s%05d" % i for i in range(3000)]  # several staging scan chunks
    v.list_append("l", [b"a"] * len(staged), staged, b"")
    assert list(v.list_scan("l", b"a", b"")) == [b"c0", b"c1", b"c2", *staged]


def test_list_get_refuses_a_merged_list_over_the_response_limit(make_harness) -> None:  # type: ignore[no-untyped-def]
    h = make_harness(limits=StateLimits(max_list_response_bytes=10))
    h.backend().list_append("l", [b"a"], [b"123456"], b"")
    v = h.view(1, 0, 7)
    v.list_append("l", [b"a"], [b"789"], b"")
    assert v.list_get("l", [b"a"], b"") == [[b"123456", b"789"]]
    v.list_append("l", [b"a"], [b"0ab"], b"")
    with pytest.raises(SizeLimitError, match=r"ListState\.scan\(key\)"):
        v.list_get("l", [b"a"], b"")
    # The stream has no response limit.
    assert list(v.list_scan("l", b"a", b"")) == [b"123456", b"789", b"0ab"]


def test_map_reads_merge_committed_and_staged(harness: EpochHarness) -> None:
    b = harness.backend()
    b.map_put("m", [b"a", b"a", b"a", b"b"], [b"u1", b"u2", b"u4", b"w"], [b"x1", b"x2", b"x4", b"w1"], b"")
    v = harness.view(1, 0, 7)
    v.map_put("m", [b"a", b"a", b"a"], [b"u3", b"u2", b"u0"], [b"x3", b"y2", b"x0"], b"")
    v.map_remove("m", [b"a", b"a"], [b"u1", b"u9"], b"")
    v.clear("m", [b"b"], b"")
    v.map_put("m", [b"b"], [b"z"], [b"z1"], b"")
    v.map_remove("m", [b"b"], [b"w"], b"")
    uks = [b"u0", b"u1", b"u2", b"u3", b"u4", b"u9"]
    assert v.map_get("m", [b"a"] * 6, uks, b"") == [b"x0", None, b"y2", b"x3", b"x4", None]
    assert v.map_contains("m", [b"a"] * 6, uks, b"") == [True, False, True, True, True, False]
    assert v.map_get("m", [b"b", b"b"], [b"w", b"z"], b"") == [None, b"z1"]
    merged_a = [(b"u0", b"x0"), (b"u2", b"y2"), (b"u3", b"x3"), (b"u4", b"x4")]
    assert list(v.map_scan("m", b"a", b"")) == merged_a
    assert list(v.map_scan("m", b"a", b"", keys_only=True)) == [(uk, b"") for uk, _ in merged_a]
    assert list(v.map_scan("m", b"b", b"")) == [(b"z", b"z1")]
    assert list(b.map_scan("m", b"a", b"")) == [(b"u1", b"x1"), (b"u2", b"x2"), (b"u4", b"x4")]

    harness.commit(1, {0: 7})
    assert list(b.map_scan("m", b"a", b"")) == merged_a
    assert list(b.map_scan("m", b"b", b"")) == [(b"z", b"z1")]


def test_map_scan_merges_many_entries_in_user_key_order(harness: EpochHarness) -> None:
    b = harness.backend()
    committed = {b"k%05d" % i: b"c" for i in range(0, 3000, 2)}
    b.map_put("m", [b"a"] * len(committed), list(committed), list(committed.values()), b"")
    v = harness.view(1, 0, 7)
    staged = {b"k%05d" % i: b"s" for i in range(0, 3000, 3)}
    v.map_put("m", [b"a"] * len(staged), list(staged), list(staged.values()), b"")
    removed = [b"k%05d" % i for i in range(0, 3000, 10)]
    v.map_remove("m", [b"a"] * len(removed), removed, b"")
    expected = {**committed, **staged}
    for uk in removed:
        expected.pop(uk, None)
    assert list(v.map_scan("m", b"a", b"")) == sorted(expected.items())
    harness.commit(1, {0: 7})
    assert list(b.map_scan("m", b"a", b"")) == sorted(expected.items())


def test_scan_keys_lists_committed_keys_only(harness: EpochHarness) -> None:
    b = harness.backend()
    b.value_put("v", [b"a"], [b"A"], b"")
    v = harness.view(1, 0, 7)
    v.value_put("v", [b"new"], [b"N"], b"")
    assert sorted(v.scan_keys("v")) == [(b"a", b"")]
    harness.commit(1, {0: 7})
    assert sorted(v.scan_keys("v")) == [(b"a", b""), (b"new", b"")]


def test_attempts_partitions_and_epochs_are_isolated(harness: EpochHarness) -> None:
    b = harness.backend()
    b.value_put("v", [b"a"], [b"committed"], b"")
    b.reduce("r", [b"a"], [vec(1, 1.0, 1)], b"", False)
    first = harness.view(1, 0, 1)
    first.value_put("v", [b"a", b"n"], [b"first", b"first"], b"")
    first.list_append("l", [b"a"], [b"first"], b"")
    first.map_put("m", [b"a"], [b"u"], [b"first"], b"")
    first.reduce("r", [b"a"], [vec(100, 100.0, -100)], b"", False)
    for other in (harness.view(1, 0, 2), harness.view(1, 1, 1), harness.view(2, 0, 1)):
        assert other.value_get("v", [b"a", b"n"], b"") == [b"committed", None]
        assert other.list_get("l", [b"a"], b"") == [[]]
        assert list(other.list_scan("l", b"a", b"")) == []
        assert other.map_get("m", [b"a"], [b"u"], b"") == [None]
        assert list(other.map_scan("m", b"a", b"")) == []
        assert [VEC.unpack(x) for x in other.value_get("r", [b"a"], b"")] == [(1, 1.0, 1)]  # type: ignore[arg-type]
        assert [VEC.unpack(x) for x in other.reduce("r", [b"a"], [vec(1, 1.0, 1)], b"", True)] == [(2, 1.0, 1)]  # type: ignore[union-attr]
    assert first.value_get("v", [b"a"], b"") == [b"first"]
    assert [VEC.unpack(x) for x in first.value_get("r", [b"a"], b"")] == [(101, 100.0, -100)]  # type: ignore[arg-type]
