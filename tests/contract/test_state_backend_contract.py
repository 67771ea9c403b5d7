"""The keyed-state backend contract: every behaviour, one test body, run against RocksDB and HashMap.

The HashMap backend is an independent implementation of the same semantics, so each test here
checks both backends against each other's expected behaviour. Time is a ManualClock; nothing
sleeps.
"""

from __future__ import annotations

import random
import struct
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

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
from keyedstate.common.errors import (
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    InvalidArgumentError,
    KeyedStateError,
    NotFoundError,
    Reason,
    SizeLimitError,
    StaleRoutingError,
    UnavailableError,
    WrongStateKindError,
)
from keyedstate.common.ids import KeyGroupRange, SubtaskId
from keyedstate.common.keygroups import key_group
from keyedstate.taskmanager.state import (
    KeyedStateBackend,
    Mutation,
    MutationKind,
    RocksDBKeyedStateBackend,
    StateLimits,
    create_backend,
    restore_backend,
)
from keyedstate.taskmanager.state.metadata import COMMITTED_EPOCH, SNAPSHOT_MANIFEST
from tests.fakes.clock import ManualClock

MP = 128
FULL = KeyGroupRange(0, MP - 1)
TTL = 10_000
VEC = struct.Struct(">qdq")  # count (sum), max (float), min (int)


def unpack_vec(raw: bytes | None) -> tuple[Any, ...]:
    """A stored reducing value; an absent one (None) fails here."""
    assert raw is not None
    return VEC.unpack(raw)


STATES = (
    StateDescriptor("v", StateKind.VALUE),
    StateDescriptor("l", StateKind.LIST),
    StateDescriptor("m", StateKind.MAP),
    StateDescriptor(
        "r",
        StateKind.REDUCING,
        reduce_fields=(
            ReduceField("count"),
            ReduceField("max", ReduceFunction.MAX, NumberType.FLOAT64),
            ReduceField("min", ReduceFunction.MIN, NumberType.INT64),
        ),
    ),
    StateDescriptor("tv", StateKind.VALUE, TtlConfig(TTL)),
    StateDescriptor("tvr", StateKind.VALUE, TtlConfig(TTL, TtlUpdateType.ON_READ_AND_WRITE)),
    StateDescriptor("tl", StateKind.LIST, TtlConfig(TTL)),
    StateDescriptor("tlr", StateKind.LIST, TtlConfig(TTL, TtlUpdateType.ON_READ_AND_WRITE)),
    StateDescriptor("tm", StateKind.MAP, TtlConfig(TTL)),
    StateDescriptor("tmr", StateKind.MAP, TtlConfig(TTL, TtlUpdateType.ON_READ_AND_WRITE)),
    StateDescriptor("tr", StateKind.REDUCING, TtlConfig(TTL), (ReduceField("n"),)),
)


def keys_in(groups: KeyGroupRange, n: int, prefix: bytes = b"key-") -> list[bytes]:
    """``n`` distinct keys whose key groups lie in ``groups``."""
    out: list[bytes] = []
    i = 0
    while len(out) < n:
        k = prefix + str(i).encode()
        if key_group(k, MP) in groups:
            out.append(k)
        i += 1
    return out


def dump(backend: KeyedStateBackend) -> dict[str, dict[tuple[bytes, bytes], Any]]:
    """Every live entry of every state, read through the public API."""
    out: dict[str, dict[tuple[bytes, bytes], Any]] = {}
    for d in backend.descriptors():
        entries: dict[tuple[bytes, bytes], Any] = {}
        for key, ns in backend.scan_keys(d.name):
            if d.kind in (StateKind.VALUE, StateKind.REDUCING):
                entries[(key, ns)] = backend.value_get(d.name, [key], ns)[0]
            elif d.kind is StateKind.LIST:
                entries[(key, ns)] = backend.list_get(d.name, [key], ns)[0]
            else:
                entries[(key, ns)] = list(backend.map_scan(d.name, key, ns))
        out[d.name] = entries
    return out


def populate(backend: KeyedStateBackend, keys: list[bytes]) -> None:
    """A bit of everything, in two namespaces."""
    for ns in (b"", b"window-1"):
        backend.value_put("v", keys, [b"v:" + k + ns for k in keys], ns)
        backend.list_append("l", keys + keys, [b"a:" + k for k in keys] + [b"b:" + k for k in keys], ns)
        backend.map_put(
            "m", keys + keys, [b"u2"] * len(keys) + [b"u1"] * len(keys), [b"x"] * len(keys) + [b"y"] * len(keys), ns
        )
        backend.reduce("r", keys, [VEC.pack(1, 0.5, 7)] * len(keys), ns, False)
        backend.value_put("tv", keys, [b"t:" + k for k in keys], ns)
        backend.list_append("tl", keys, [b"tl:" + k for k in keys], ns)
        backend.map_put("tm", keys, [b"uk"] * len(keys), [b"tm:" + k for k in keys], ns)
        backend.reduce("tr", keys, [struct.pack(">q", 3)] * len(keys), ns, False)
    backend.apply([], meta={COMMITTED_EPOCH: b"42"})


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(params=["rocksdb", "hashmap"])
def kind(request: pytest.FixtureRequest) -> str:
    return cast(str, request.param)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def make(kind: str, clock: ManualClock, tmp_path: Path) -> Iterator[Callable[..., KeyedStateBackend]]:
    """``make(key_groups=..., states=..., limits=..., index=...)``: a new backend, closed after the test."""
    created: list[KeyedStateBackend] = []

    def factory(
        key_groups: KeyGroupRange = FULL,
        states: tuple[StateDescriptor, ...] = STATES,
        limits: StateLimits | None = None,
        index: int = 0,
        max_parallelism: int = MP,
    ) -> KeyedStateBackend:
        backend = create_backend(
            kind,
            SubtaskId("job1", "op1", index),
            key_groups,
            max_parallelism,
            states,
            local_dir=tmp_path / "local",
            limits=limits or StateLimits(),
            clock=clock,
            resources=None,
        )
        created.append(backend)
        return backend

    yield factory
    for b in created:
        b.close()


@pytest.fixture
def restore(kind: str, clock: ManualClock, tmp_path: Path) -> Iterator[Callable[..., KeyedStateBackend]]:
    created: list[KeyedStateBackend] = []

    def factory(
        dirs: list[Path],
        key_groups: KeyGroupRange = FULL,
        states: tuple[StateDescriptor, ...] = STATES,
        index: int = 7,
        as_kind: str | None = None,
        max_parallelism: int = MP,
    ) -> KeyedStateBackend:
        backend = restore_backend(
            as_kind or kind,
            SubtaskId("job1", "op1", index),
            key_groups,
            max_parallelism,
            states,
            snapshot_dirs=dirs,
            local_dir=tmp_path / "restored",
            limits=StateLimits(),
            clock=clock,
        )
        created.append(backend)
        return backend

    yield factory
    for b in created:
        b.close()


@pytest.fixture
def backend(make: Callable[..., KeyedStateBackend]) -> KeyedStateBackend:
    return make()


def snap(backend: KeyedStateBackend, target: Path) -> Path:
    backend.snapshot(target).materialize()
    return target


# -- value ------------------------------------------------------------------------------------


def test_value_put_get_and_missing_is_none(backend: KeyedStateBackend) -> None:
    keys = keys_in(FULL, 50)
    backend.value_put("v", keys, [k * 2 for k in keys], b"")
    assert backend.value_get("v", keys + [b"absent"], b"") == [k * 2 for k in keys] + [None]


def test_large_batches_of_equal_length_keys_keep_the_last_write_of_a_repeated_key(backend: KeyedStateBackend) -> None:
    """The bulk path of batches of one key length (built and sorted in numpy on RocksDB) applies a
    repeated key's writes in the caller's order, in every namespace, like a small batch."""
    rng = random.Random(11)
    keys = [rng.randbytes(16) for _ in range(3000)]
    for i in range(0, 3000, 100):
        keys[i + 50] = keys[i]  # every 100th key again 50 positions later, with another value
    values = [b"v%05d" % i for i in range(3000)]
    backend.value_put("v", keys, values, b"ns")
    latest = dict(zip(keys, values))
    assert backend.value_get("v", keys, b"ns") == [latest[k] for k in keys]
    assert backend.value_get("v", keys[:200], b"") == [None] * 200
    equal_width = [b"w%099d" % i for i in range(3000)]
    backend.value_put("v", keys, equal_width, b"")
    latest = dict(zip(keys, equal_width))
    assert backend.value_get("v", keys, b"") == [latest[k] for k in keys]


def test_value_namespaces_are_independent(backend: KeyedStateBackend) -> None:
    backend.value_put("v", [b"k", b"k"], [b"one", b"two"], [b"ns1", b"ns2"])
    assert backend.value_get("v", [b"k", b"k", b"k"], [b"ns1", b"ns2", b""]) == [b"one", b"two", None]
    assert backend.value_get("v", [b"k"], b"ns2") == [b"two"]


def test_key_and_namespace_boundaries_are_unambiguous(backend: KeyedStateBackend) -> None:
    # (key "ab", ns "c") and (key "a", ns "bc") concatenate alike; the stored layout must not mix them.
    backend.value_put("v", [b"ab", b"a"], [b"first", b"second"], [b"c", b"bc"])
    backend.list_append("l", [b"ab", b"a"], [b"first", b"second"], [b"c", b"bc"])
    backend.map_put("m", [b"ab", b"a"], [b"u", b"u"], [b"first", b"second"], [b"c", b"bc"])
    assert backend.value_get("v", [b"ab", b"a"], [b"c", b"bc"]) == [b"first", b"second"]
    assert backend.list_get("l", [b"ab", b"a"], [b"c", b"bc"]) == [[b"first"], [b"second"]]
    assert list(backend.map_scan("m", b"a", b"bc")) == [(b"u", b"second")]


def test_last_write_of_a_key_in_a_batch_wins(backend: KeyedStateBackend) -> None:
    backend.value_put("v", [b"k", b"k", b"k"], [b"1", b"2", b"3"], b"")
    assert backend.value_get("v", [b"k"], b"") == [b"3"]
    backend.value_put("v", [b"k"], [b""], b"")
    assert backend.value_get("v", [b"k"], b"") == [b""]  # an empty value is a value, not absence


def test_binary_keys_empty_key_and_empty_namespace(backend: KeyedStateBackend) -> None:
    keys = [b"", b"\x00", b"\xff" * 40, bytes(range(256))]
    backend.value_put("v", keys, [b"a", b"b", b"c", b"d"], b"\x00\xff")
    assert backend.value_get("v", keys, b"\x00\xff") == [b"a", b"b", b"c", b"d"]
    assert sorted(backend.scan_keys("v")) == sorted((k, b"\x00\xff") for k in keys)


def test_clear_removes_every_kind_and_only_that_key(backend: KeyedStateBackend) -> None:
    backend.value_put("v", [b"a", b"b"], [b"1", b"2"], b"")
    backend.list_append("l", [b"a", b"a", b"b"], [b"1", b"2", b"3"], b"")
    backend.map_put("m", [b"a", b"a", b"b"], [b"x", b"y", b"x"], [b"1", b"2", b"3"], b"")
    backend.reduce("r", [b"a", b"b"], [VEC.pack(1, 1.0, 1)] * 2, b"", False)
    for state in ("v", "l", "m", "r"):
        backend.clear(state, [b"a"], b"")
    assert backend.value_get("v", [b"a", b"b"], b"") == [None, b"2"]
    assert backend.list_get("l", [b"a", b"b"], b"") == [[], [b"3"]]
    assert backend.map_get("m", [b"a", b"a", b"b"], [b"x", b"y", b"x"], b"") == [None, None, b"3"]
    assert backend.value_get("r", [b"a"], b"") == [None]
    for state in ("v", "l", "m", "r"):
        assert list(backend.scan_keys(state)) == [(b"b", b"")]
    backend.clear("l", [b"never-written"], b"")  # clearing nothing is fine


def test_empty_batches_are_no_ops_but_still_validated(backend: KeyedStateBackend) -> None:
    assert backend.value_get("v", [], b"") == []
    backend.value_put("v", [], [], b"")
    assert backend.reduce("r", [], [], b"", True) == []
    assert backend.list_get("l", [], b"") == []
    assert backend.map_contains("m", [], [], []) == []
    with pytest.raises(NotFoundError):
        backend.value_get("nope", [], b"")
    with pytest.raises(WrongStateKindError):
        backend.list_append("v", [], [], b"")


# -- reducing ---------------------------------------------------------------------------------


def test_reduce_applies_sum_max_min_in_order_with_repeated_keys(backend: KeyedStateBackend) -> None:
    ops = [VEC.pack(1, 2.5, 10), VEC.pack(2, 1.0, 3), VEC.pack(4, -1.0, 5), VEC.pack(10, 9.0, 100)]
    out = backend.reduce("r", [b"a", b"a", b"b", b"a"], ops, b"", True)
    assert out is not None
    assert [VEC.unpack(x) for x in out] == [(1, 2.5, 10), (3, 2.5, 3), (4, -1.0, 5), (13, 9.0, 3)]
    assert unpack_vec(backend.value_get("r", [b"a"], b"")[0]) == (13, 9.0, 3)
    assert backend.reduce("r", [b"b"], [VEC.pack(1, 0.0, 0)], b"", False) is None
    assert unpack_vec(backend.value_get("r", [b"b"], b"")[0]) == (5, 0.0, 0)


def test_reduce_is_per_namespace(backend: KeyedStateBackend) -> None:
    backend.reduce("r", [b"a", b"a"], [VEC.pack(1, 1.0, 1), VEC.pack(5, 5.0, 5)], [b"w1", b"w2"], False)
    got = backend.value_get("r", [b"a", b"a"], [b"w1", b"w2"])
    assert [unpack_vec(x) for x in got] == [(1, 1.0, 1), (5, 5.0, 5)]


def test_reduce_operand_of_wrong_length_is_rejected_before_writing(backend: KeyedStateBackend) -> None:
    with pytest.raises(InvalidArgumentError, match=r"operand 1 .* 24 bytes"):
        backend.reduce("r", [b"a", b"b"], [VEC.pack(1, 1.0, 1), b"short"], b"", True)
    assert backend.value_get("r", [b"a"], b"") == [None]


def test_reduce_int64_sum_wraps_like_a_java_long(backend: KeyedStateBackend) -> None:
    big = (1 << 63) - 1
    out = backend.reduce("r", [b"a", b"a"], [VEC.pack(big, 0.0, 0), VEC.pack(2, 0.0, 0)], b"", True)
    assert out is not None
    assert VEC.unpack(out[1])[0] == -(1 << 63) + 1


# -- list -------------------------------------------------------------------------------------


def test_list_append_keeps_order_across_repeats_and_calls(backend: KeyedStateBackend) -> None:
    backend.list_append("l", [b"a", b"b", b"a"], [b"1", b"x", b"2"], b"")
    backend.list_append("l", [b"a"], [b"3"], b"")
    assert backend.list_get("l", [b"a", b"b", b"c"], b"") == [[b"1", b"2", b"3"], [b"x"], []]
    assert list(backend.list_scan("l", b"a", b"")) == [b"1", b"2", b"3"]


def test_list_update_replaces_each_distinct_key(backend: KeyedStateBackend) -> None:
    backend.list_append("l", [b"a", b"a", b"b"], [b"old1", b"old2", b"keep"], b"")
    backend.list_update("l", [b"a", b"c", b"a"], [b"n1", b"c1", b"n2"], b"")
    assert backend.list_get("l", [b"a", b"b", b"c"], b"") == [[b"n1", b"n2"], [b"keep"], [b"c1"]]
    backend.list_append("l", [b"a"], [b"n3"], b"")
    assert backend.list_get("l", [b"a"], b"") == [[b"n1", b"n2", b"n3"]]


def test_list_scan_streams_lists_longer_than_any_chunk(backend: KeyedStateBackend) -> None:
    elements = [b"e%05d" % i for i in range(2500)]
    for i in range(0, len(elements), 700):
        chunk = elements[i : i + 700]
        backend.list_append("l", [b"big"] * len(chunk), chunk, b"ns")
    assert list(backend.list_scan("l", b"big", b"ns")) == elements
    assert backend.list_get("l", [b"big"], b"ns") == [elements]


def test_list_get_past_the_response_limit_points_to_list_scan(make: Callable[..., KeyedStateBackend]) -> None:
    backend = make(limits=StateLimits(max_list_response_bytes=1000))
    backend.list_append("l", [b"a"] * 30, [b"x" * 50] * 30, b"")
    with pytest.raises(SizeLimitError) as info:
        backend.list_get("l", [b"a"], b"")
    assert "state.limits.list.max-response-bytes" in info.value.message
    # The fix names the client method users have, not an internal one.
    assert "ListState.scan(key)" in info.value.message and "list_scan" not in info.value.message
    assert len(list(backend.list_scan("l", b"a", b""))) == 30


def test_list_max_elements_refuses_the_whole_batch(make: Callable[..., KeyedStateBackend]) -> None:
    backend = make(limits=StateLimits(max_list_elements=3))
    backend.list_append("l", [b"a", b"a"], [b"1", b"2"], b"")
    with pytest.raises(SizeLimitError, match="state.limits.list.max-elements") as info:
        backend.list_append("l", [b"b", b"a", b"a"], [b"x", b"3", b"4"], b"")
    assert info.value.reason is Reason.SIZE_LIMIT
    assert backend.list_get("l", [b"a", b"b"], b"") == [[b"1", b"2"], []]
    with pytest.raises(SizeLimitError):
        backend.list_update("l", [b"c"] * 4, [b"1", b"2", b"3", b"4"], b"")
    backend.list_update("l", [b"a"], [b"only"], b"")  # replacing frees room
    backend.list_append("l", [b"a", b"a"], [b"2", b"3"], b"")
    assert backend.list_get("l", [b"a"], b"") == [[b"only", b"2", b"3"]]
    backend.clear("l", [b"a"], b"")
    backend.list_append("l", [b"a"] * 3, [b"x", b"y", b"z"], b"")
    assert backend.list_get("l", [b"a"], b"") == [[b"x", b"y", b"z"]]


# -- map --------------------------------------------------------------------------------------


def test_map_put_get_contains_remove(backend: KeyedStateBackend) -> None:
    backend.map_put("m", [b"a", b"a", b"b"], [b"x", b"y", b"x"], [b"1", b"2", b"3"], b"")
    assert backend.map_get("m", [b"a", b"a", b"b", b"b"], [b"x", b"y", b"x", b"y"], b"") == [b"1", b"2", b"3", None]
    assert backend.map_contains("m", [b"a", b"b"], [b"y", b"y"], b"") == [True, False]
    backend.map_remove("m", [b"a", b"a"], [b"x", b"absent"], b"")
    assert backend.map_get("m", [b"a", b"a"], [b"x", b"y"], b"") == [None, b"2"]
    backend.map_put("m", [b"a"], [b"y"], [b"22"], b"")
    assert backend.map_get("m", [b"a"], [b"y"], b"") == [b"22"]


def test_map_scan_is_sorted_by_user_key_bytes(backend: KeyedStateBackend) -> None:
    user_keys = [b"b", b"\xff", b"a", b"ab", b"\x00", b""]
    backend.map_put("m", [b"k"] * 6, user_keys, [u + b"!" for u in user_keys], b"n")
    expected = sorted((u, u + b"!") for u in user_keys)
    assert list(backend.map_scan("m", b"k", b"n")) == expected
    assert list(backend.map_scan("m", b"k", b"n", keys_only=True)) == [(u, b"") for u, _ in expected]
    assert list(backend.map_scan("m", b"k", b"other")) == []


def test_map_scan_of_a_large_map(backend: KeyedStateBackend) -> None:
    uks = [b"u%05d" % i for i in range(2100)]
    backend.map_put("m", [b"k"] * len(uks), uks, uks, b"")
    assert [u for u, _ in backend.map_scan("m", b"k", b"")] == uks


def test_removing_the_last_map_entry_removes_the_key(backend: KeyedStateBackend) -> None:
    backend.map_put("m", [b"a"], [b"x"], [b"1"], b"")
    backend.map_remove("m", [b"a"], [b"x"], b"")
    assert list(backend.scan_keys("m")) == []


# -- scan_keys --------------------------------------------------------------------------------


def test_scan_keys_yields_each_live_key_namespace_once(backend: KeyedStateBackend) -> None:
    keys = keys_in(FULL, 1500)
    backend.value_put("v", keys, [b"x"] * len(keys), b"n1")
    backend.value_put("v", keys[:10], [b"x"] * 10, b"n2")
    backend.list_append("l", keys[:5] * 3, [b"e"] * 15, b"")
    backend.map_put("m", keys[:4] * 400, [b"u%d" % i for i in range(1600)], [b"v"] * 1600, b"")
    assert sorted(backend.scan_keys("v")) == sorted([(k, b"n1") for k in keys] + [(k, b"n2") for k in keys[:10]])
    assert sorted(backend.scan_keys("l")) == sorted((k, b"") for k in keys[:5])
    assert sorted(backend.scan_keys("m")) == sorted((k, b"") for k in keys[:4])


# -- TTL --------------------------------------------------------------------------------------


def test_ttl_on_create_and_write_expires_and_reads_do_not_extend(
    backend: KeyedStateBackend, clock: ManualClock
) -> None:
    backend.value_put("tv", [b"a", b"b"], [b"1", b"2"], b"")
    clock.advance(TTL - 1)
    assert backend.value_get("tv", [b"a", b"b"], b"") == [b"1", b"2"]
    backend.value_put("tv", [b"b"], [b"2b"], b"")  # a write restarts b's TTL
    clock.advance(1)
    assert backend.value_get("tv", [b"a", b"b"], b"") == [None, b"2b"]
    assert list(backend.scan_keys("tv")) == [(b"b", b"")]
    clock.advance(TTL)
    assert backend.value_get("tv", [b"b"], b"") == [None]
    assert list(backend.scan_keys("tv")) == []


def test_ttl_on_read_and_write_reads_extend(backend: KeyedStateBackend, clock: ManualClock) -> None:
    backend.value_put("tvr", [b"a", b"b"], [b"1", b"2"], b"")
    clock.advance(TTL - 1)
    assert backend.value_get("tvr", [b"a"], b"") == [b"1"]
    clock.advance(TTL - 1)
    assert backend.value_get("tvr", [b"a", b"b"], b"") == [b"1", None]
    clock.advance(TTL)
    assert backend.value_get("tvr", [b"a"], b"") == [None]


def test_ttl_list_elements_expire_one_by_one(backend: KeyedStateBackend, clock: ManualClock) -> None:
    backend.list_append("tl", [b"a", b"a"], [b"old1", b"old2"], b"")
    clock.advance(TTL // 2)
    backend.list_append("tl", [b"a"], [b"new"], b"")
    clock.advance(TTL // 2)
    assert backend.list_get("tl", [b"a"], b"") == [[b"new"]]
    assert list(backend.list_scan("tl", b"a", b"")) == [b"new"]
    backend.list_append("tl", [b"a"], [b"newer"], b"")
    assert backend.list_get("tl", [b"a"], b"") == [[b"new", b"newer"]]
    clock.advance(TTL)
    assert backend.list_get("tl", [b"a"], b"") == [[]]
    assert list(backend.scan_keys("tl")) == []


def test_ttl_list_reads_extend_with_on_read_and_write(backend: KeyedStateBackend, clock: ManualClock) -> None:
    backend.list_append("tlr", [b"a", b"a", b"b"], [b"1", b"2", b"x"], b"")
    clock.advance(TTL - 1)
    assert backend.list_get("tlr", [b"a"], b"") == [[b"1", b"2"]]
    clock.advance(TTL - 1)
    assert list(backend.list_scan("tlr", b"a", b"")) == [b"1", b"2"]
    clock.advance(TTL - 1)
    assert backend.list_get("tlr", [b"a", b"b"], b"") == [[b"1", b"2"], []]


def test_ttl_map_entries_expire_individually(backend: KeyedStateBackend, clock: ManualClock) -> None:
    backend.map_put("tm", [b"a", b"a"], [b"x", b"y"], [b"1", b"2"], b"")
    clock.advance(TTL - 1)
    backend.map_put("tm", [b"a"], [b"y"], [b"2b"], b"")
    clock.advance(1)
    assert backend.map_get("tm", [b"a", b"a"], [b"x", b"y"], b"") == [None, b"2b"]
    assert backend.map_contains("tm", [b"a", b"a"], [b"x", b"y"], b"") == [False, True]
    assert list(backend.map_scan("tm", b"a", b"")) == [(b"y", b"2b")]


def test_ttl_map_reads_extend_with_on_read_and_write(backend: KeyedStateBackend, clock: ManualClock) -> None:
    backend.map_put("tmr", [b"a", b"a", b"a"], [b"x", b"y", b"z"], [b"1", b"2", b"3"], b"")
    clock.advance(TTL - 1)
    assert backend.map_get("tmr", [b"a"], [b"x"], b"") == [b"1"]
    assert backend.map_contains("tmr", [b"a"], [b"y"], b"") == [True]
    clock.advance(TTL - 1)
    assert list(backend.map_scan("tmr", b"a", b"")) == [(b"x", b"1"), (b"y", b"2")]
    clock.advance(TTL - 1)
    assert backend.map_get("tmr", [b"a", b"a", b"a"], [b"x", b"y", b"z"], b"") == [b"1", b"2", None]


def test_ttl_reduce_restarts_from_the_operand_after_expiry(backend: KeyedStateBackend, clock: ManualClock) -> None:
    n = struct.Struct(">q")
    backend.reduce("tr", [b"a", b"a"], [n.pack(5), n.pack(5)], b"", False)
    clock.advance(TTL)
    assert backend.value_get("tr", [b"a"], b"") == [None]
    assert backend.reduce("tr", [b"a"], [n.pack(1)], b"", True) == [n.pack(1)]


def test_ttl_apply_and_all_writes_stamp_time(backend: KeyedStateBackend, clock: ManualClock) -> None:
    backend.apply([Mutation(MutationKind.VALUE_PUT, "tv", b"a", b"", value=b"1")])
    clock.advance(TTL)
    assert backend.value_get("tv", [b"a"], b"") == [None]


def test_ttl_sweep_deletes_expired_entries_in_bounded_resumable_steps(
    backend: KeyedStateBackend, clock: ManualClock, restore: Callable[..., KeyedStateBackend], tmp_path: Path
) -> None:
    old = keys_in(FULL, 120, b"old-")
    backend.value_put("tv", old, [b"x"] * len(old), b"")
    backend.list_append("tl", old[:10] * 2, [b"e"] * 20, b"")
    backend.map_put("tm", old[:10], [b"u"] * 10, [b"x"] * 10, b"")
    clock.advance(TTL)
    fresh = keys_in(FULL, 30, b"fresh-")
    backend.value_put("tv", fresh, [b"y"] * len(fresh), b"")
    backend.list_append("tl", old[:3], [b"live"] * 3, b"")

    deleted_per_step = []
    for _ in range(100):
        n = backend.ttl_sweep(25)
        assert 0 <= n <= 25
        deleted_per_step.append(n)
        if sum(deleted_per_step) >= 150:
            break
    assert sum(deleted_per_step) == 150  # 120 values + 20 list elements + 10 map entries
    assert max(deleted_per_step) <= 25 and len(deleted_per_step) >= 6
    assert backend.ttl_sweep(10_000) == 0
    assert backend.list_get("tl", old[:3], b"") == [[b"live"]] * 3
    # Restoring with TTL disabled would show any expired entry still stored: none are.
    plain = tuple(StateDescriptor(d.name, d.kind, None, d.reduce_fields) for d in STATES)
    restored = restore([snap(backend, tmp_path / "swept")], states=plain)
    assert sorted(k for k, _ in restored.scan_keys("tv")) == sorted(fresh)
    assert restored.list_get("tl", old[:4], b"") == [[b"live"]] * 3 + [[]]
    assert list(restored.scan_keys("tm")) == []


def test_ttl_sweep_without_ttl_states_and_bad_budget(make: Callable[..., KeyedStateBackend]) -> None:
    backend = make(states=STATES[:4])
    backend.value_put("v", [b"a"], [b"1"], b"")
    assert backend.ttl_sweep(100) == 0
    with pytest.raises(InvalidArgumentError):
        backend.ttl_sweep(0)


# -- bad input --------------------------------------------------------------------------------

ALL_CALLS: dict[str, Callable[[KeyedStateBackend, str], Any]] = {
    "value_get": lambda b, s: b.value_get(s, [b"k"], b""),
    "value_put": lambda b, s: b.value_put(s, [b"k"], [b"v"], b""),
    "clear": lambda b, s: b.clear(s, [b"k"], b""),
    "reduce": lambda b, s: b.reduce(s, [b"k"], [VEC.pack(1, 1.0, 1)], b"", True),
    "list_append": lambda b, s: b.list_append(s, [b"k"], [b"v"], b""),
    "list_get": lambda b, s: b.list_get(s, [b"k"], b""),
    "list_update": lambda b, s: b.list_update(s, [b"k"], [b"v"], b""),
    "list_scan": lambda b, s: list(b.list_scan(s, b"k", b"")),
    "map_put": lambda b, s: b.map_put(s, [b"k"], [b"u"], [b"v"], b""),
    "map_get": lambda b, s: b.map_get(s, [b"k"], [b"u"], b""),
    "map_remove": lambda b, s: b.map_remove(s, [b"k"], [b"u"], b""),
    "map_contains": lambda b, s: b.map_contains(s, [b"k"], [b"u"], b""),
    "map_scan": lambda b, s: list(b.map_scan(s, b"k", b"")),
    "scan_keys": lambda b, s: list(b.scan_keys(s)),
    "descriptor": lambda b, s: b.descriptor(s),
}


@pytest.mark.parametrize("call", sorted(ALL_CALLS))
def test_unknown_state_names_the_declared_ones(backend: KeyedStateBackend, call: str) -> None:
    with pytest.raises(NotFoundError) as info:
        ALL_CALLS[call](backend, "nope")
    assert info.value.reason is Reason.UNKNOWN_STATE
    assert "'nope'" in info.value.message and "tv, tvr" in info.value.message


# state each call must refuse, with the kind named in the message
WRONG_KIND = {
    "value_get": ("l", "list"),
    "value_put": ("r", "reducing"),
    "reduce": ("v", "value"),
    "list_append": ("v", "value"),
    "list_get": ("m", "map"),
    "list_update": ("r", "reducing"),
    "list_scan": ("v", "value"),
    "map_put": ("l", "list"),
    "map_get": ("v", "value"),
    "map_remove": ("l", "list"),
    "map_contains": ("r", "reducing"),
    "map_scan": ("l", "list"),
}


@pytest.mark.parametrize("call", sorted(WRONG_KIND))
def test_wrong_state_kind_names_the_kind_and_the_right_calls(backend: KeyedStateBackend, call: str) -> None:
    state, kind_name = WRONG_KIND[call]
    with pytest.raises(WrongStateKindError) as info:
        ALL_CALLS[call](backend, state)
    assert info.value.reason is Reason.WRONG_STATE_KIND
    assert f"it is {kind_name} state" in info.value.message
    assert "use " in info.value.message


def test_key_outside_the_slot_key_groups_is_stale_routing_and_nothing_is_written(
    make: Callable[..., KeyedStateBackend],
) -> None:
    mine = KeyGroupRange(0, 63)
    backend = make(key_groups=mine)
    good = keys_in(mine, 3)
    bad = keys_in(KeyGroupRange(64, 127), 1)[0]
    calls: list[Callable[[], object]] = [
        lambda: backend.value_put("v", good + [bad], [b"x"] * 4, b""),
        lambda: backend.list_append("l", good + [bad], [b"x"] * 4, b""),
        lambda: backend.map_put("m", good + [bad], [b"u"] * 4, [b"x"] * 4, b""),
        lambda: backend.reduce("r", good + [bad], [VEC.pack(1, 1.0, 1)] * 4, b"", True),
        lambda: backend.value_get("v", [bad], b""),
        lambda: list(backend.list_scan("l", bad, b"")),
        lambda: backend.apply(
            [
                Mutation(MutationKind.VALUE_PUT, "v", good[0], b"", value=b"x"),
                Mutation(MutationKind.VALUE_PUT, "v", bad, b"", value=b"x"),
            ]
        ),
    ]
    for call in calls:
        with pytest.raises(StaleRoutingError) as info:
            call()
        assert info.value.reason is Reason.STALE_ROUTING
        assert f"key group {key_group(bad, MP)}" in info.value.message and "[0, 63]" in info.value.message
    for state in ("v", "l", "m", "r"):
        assert list(backend.scan_keys(state)) == []


@pytest.mark.parametrize(
    "call, config_key",
    [
        (lambda b: b.value_put("v", [b"ok", b"k" * 101], [b"1", b"2"], b""), "state.limits.max-key-bytes"),
        (lambda b: b.value_put("v", [b"a", b"b"], [b"1", b"x" * 201], b""), "state.limits.max-value-bytes"),
        (lambda b: b.value_put("v", [b"a"], [b"1"], b"n" * 101), "state.limits.max-key-bytes"),
        (lambda b: b.value_put("v", [b"a", b"b"], [b"1", b"2"], [b"", b"n" * 101]), "state.limits.max-key-bytes"),
        (lambda b: b.list_append("l", [b"a", b"a"], [b"1", b"x" * 201], b""), "state.limits.max-value-bytes"),
        (lambda b: b.map_put("m", [b"a", b"a"], [b"u", b"u" * 101], [b"1", b"2"], b""), "state.limits.max-key-bytes"),
        (lambda b: b.map_put("m", [b"a"], [b"u"], [b"x" * 201], b""), "state.limits.max-value-bytes"),
        (
            lambda b: b.apply(
                [
                    Mutation(MutationKind.VALUE_PUT, "v", b"a", b"", value=b"1"),
                    Mutation(MutationKind.LIST_APPEND, "l", b"a", b"", values=(b"x" * 201,)),
                ]
            ),
            "state.limits.max-value-bytes",
        ),
    ],
)
def test_oversize_input_names_the_limit_and_writes_nothing(
    make: Callable[..., KeyedStateBackend], call: Callable[[KeyedStateBackend], Any], config_key: str
) -> None:
    backend = make(limits=StateLimits(max_key_bytes=100, max_value_bytes=200))
    with pytest.raises(SizeLimitError) as info:
        call(backend)
    assert config_key in info.value.message
    assert info.value.reason is Reason.SIZE_LIMIT
    for state in ("v", "l", "m"):
        assert list(backend.scan_keys(state)) == []


@pytest.mark.parametrize(
    "call",
    [
        lambda b: b.value_put("v", [b"a", b"b"], [b"1"], b""),
        lambda b: b.value_get("v", [b"a", b"b"], [b"n"]),
        lambda b: b.list_append("l", [b"a"], [b"1", b"2"], b""),
        lambda b: b.map_put("m", [b"a", b"b"], [b"u"], [b"1", b"2"], b""),
        lambda b: b.map_get("m", [b"a"], [b"u", b"v"], b""),
        lambda b: b.reduce("r", [b"a", b"b"], [VEC.pack(1, 1.0, 1)], b"", True),
        lambda b: b.value_put("v", [b"a"], [b"1"], "text-namespace"),
        lambda b: b.apply([Mutation(MutationKind.LIST_APPEND, "l", b"a", b"", value=b"use values=")]),
    ],
)
def test_mismatched_or_malformed_arguments_are_invalid(
    backend: KeyedStateBackend, call: Callable[[KeyedStateBackend], Any]
) -> None:
    with pytest.raises(InvalidArgumentError):
        call(backend)
    assert list(backend.scan_keys("v")) == [] and list(backend.scan_keys("l")) == []


# -- apply ------------------------------------------------------------------------------------


def test_apply_runs_mutations_in_order_atomically_with_meta(backend: KeyedStateBackend) -> None:
    n = VEC.pack(1, 1.0, 1)
    muts = [
        Mutation(MutationKind.VALUE_PUT, "v", b"a", b"", value=b"1"),
        Mutation(MutationKind.CLEAR, "v", b"a", b""),
        Mutation(MutationKind.VALUE_PUT, "v", b"b", b"ns", value=b"2"),
        Mutation(MutationKind.REDUCE, "r", b"a", b"", value=n),
        Mutation(MutationKind.REDUCE, "r", b"a", b"", value=VEC.pack(2, 3.0, 0)),
        Mutation(MutationKind.LIST_APPEND, "l", b"a", b"", values=(b"x", b"y")),
        Mutation(MutationKind.LIST_REPLACE, "l", b"a", b"", values=(b"z",)),
        Mutation(MutationKind.LIST_APPEND, "l", b"a", b"", values=(b"w",)),
        Mutation(MutationKind.LIST_APPEND, "l", b"b", b"", values=(b"1",)),
        Mutation(MutationKind.LIST_REPLACE, "l", b"b", b"", values=()),
        Mutation(MutationKind.MAP_PUT, "m", b"a", b"", user_key=b"k1", value=b"v1"),
        Mutation(MutationKind.MAP_PUT, "m", b"a", b"", user_key=b"k2", value=b"v2"),
        Mutation(MutationKind.MAP_REMOVE, "m", b"a", b"", user_key=b"k1"),
        Mutation(MutationKind.MAP_PUT, "m", b"c", b"", user_key=b"k", value=b"v"),
        Mutation(MutationKind.CLEAR, "m", b"c", b""),
        Mutation(MutationKind.MAP_PUT, "m", b"c", b"", user_key=b"k3", value=b"v3"),
    ]
    assert backend.apply(muts, meta={COMMITTED_EPOCH: b"7", b"other": b"x"}) == len(muts)
    assert backend.value_get("v", [b"a", b"b"], [b"", b"ns"]) == [None, b"2"]
    assert unpack_vec(backend.value_get("r", [b"a"], b"")[0]) == (3, 3.0, 0)
    assert backend.list_get("l", [b"a", b"b"], b"") == [[b"z", b"w"], []]
    assert list(backend.map_scan("m", b"a", b"")) == [(b"k2", b"v2")]
    assert list(backend.map_scan("m", b"c", b"")) == [(b"k3", b"v3")]
    assert backend.get_meta(COMMITTED_EPOCH) == b"7" and backend.get_meta(b"other") == b"x"
    assert backend.get_meta(b"missing") is None
    assert backend.apply([], meta={COMMITTED_EPOCH: b"8"}) == 0
    assert backend.get_meta(COMMITTED_EPOCH) == b"8"


@pytest.mark.parametrize(
    "bad, error",
    [
        (Mutation(MutationKind.VALUE_PUT, "nope", b"a", b"", value=b"1"), NotFoundError),
        (Mutation(MutationKind.LIST_APPEND, "v", b"a", b"", values=(b"1",)), WrongStateKindError),
        (Mutation(MutationKind.REDUCE, "r", b"a", b"", value=b"short"), InvalidArgumentError),
        (Mutation(MutationKind.MAP_PUT, "m", b"a", b"", user_key=b"u" * 70_000, value=b"1"), SizeLimitError),
        # data-dependent: 1 stored + 1 appended above + 3 > 4
        (Mutation(MutationKind.LIST_APPEND, "l", b"a", b"", values=(b"1",) * 3), SizeLimitError),
    ],
)
def test_apply_with_one_bad_mutation_writes_nothing(
    make: Callable[..., KeyedStateBackend], bad: Mutation, error: type[KeyedStateError]
) -> None:
    backend = make(limits=StateLimits(max_list_elements=4))
    backend.list_append("l", [b"a"], [b"0"], b"")
    good = [
        Mutation(MutationKind.VALUE_PUT, "v", b"a", b"", value=b"1"),
        Mutation(MutationKind.LIST_APPEND, "l", b"a", b"", values=(b"1",)),
        Mutation(MutationKind.MAP_PUT, "m", b"a", b"", user_key=b"u", value=b"1"),
        Mutation(MutationKind.CLEAR, "v", b"zz", b""),
    ]
    with pytest.raises(error, match="mutation #4|state.limits.list.max-elements"):
        backend.apply(good + [bad], meta={COMMITTED_EPOCH: b"1"})
    assert backend.value_get("v", [b"a"], b"") == [None]
    assert backend.list_get("l", [b"a"], b"") == [[b"0"]]
    assert backend.map_get("m", [b"a"], [b"u"], b"") == [None]
    assert backend.get_meta(COMMITTED_EPOCH) is None


def test_apply_refuses_reserved_or_non_bytes_meta(backend: KeyedStateBackend) -> None:
    with pytest.raises(InvalidArgumentError, match="reserved"):
        backend.apply([Mutation(MutationKind.VALUE_PUT, "v", b"a", b"", value=b"1")], meta={b"\x00states": b"x"})
    with pytest.raises(InvalidArgumentError):
        backend.apply([], meta={"text": b"x"})  # type: ignore[dict-item]
    assert backend.value_get("v", [b"a"], b"") == [None]


# -- concurrency ------------------------------------------------------------------------------


@pytest.fixture
def frequent_thread_switches() -> Iterator[None]:
    # Threads switch every 5 ms by default, too rarely to interleave two read-modify-writes.
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(previous)


@pytest.mark.usefixtures("frequent_thread_switches")
def test_concurrent_read_modify_writes_lose_no_update(backend: KeyedStateBackend) -> None:
    one = VEC.pack(1, 0.0, 0)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for j in range(400):
                backend.reduce("r", [b"hot", b"hot"], [one, one], b"", False)
                backend.list_append("l", [b"hot"], [b"%d-%d" % (i, j)], b"")
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert unpack_vec(backend.value_get("r", [b"hot"], b"")[0])[0] == 3200
    elements = backend.list_get("l", [b"hot"], b"")[0]
    assert len(elements) == 1600 and len(set(elements)) == 1600
    for i in range(4):  # each thread's own appends stay in order
        mine = [e for e in elements if e.startswith(b"%d-" % i)]
        assert mine == [b"%d-%d" % (i, j) for j in range(400)]


def test_snapshot_is_consistent_with_concurrent_batches(
    backend: KeyedStateBackend, restore: Callable[..., KeyedStateBackend], tmp_path: Path
) -> None:
    keys = keys_in(FULL, 200)
    backend.value_put("v", keys, [b"0"] * len(keys), b"")
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            backend.value_put("v", keys, [b"%d" % i] * len(keys), b"")

    t = threading.Thread(target=writer)
    t.start()
    try:
        dirs = [snap(backend, tmp_path / f"s{i}") for i in range(3)]
    finally:
        stop.set()
        t.join()
    for i, d in enumerate(dirs):
        values = set(restore([d], index=10 + i).value_get("v", keys, b""))
        assert len(values) == 1, f"snapshot {d} mixes two batches: {sorted(values, key=repr)[:3]}"


# -- snapshot & restore -----------------------------------------------------------------------


def test_snapshot_restore_round_trip_is_exact(
    backend: KeyedStateBackend, restore: Callable[..., KeyedStateBackend], tmp_path: Path, kind: str
) -> None:
    keys = keys_in(FULL, 300)
    populate(backend, keys)
    before = dump(backend)
    snapshot = backend.snapshot(tmp_path / "chk-1")
    backend.value_put("v", keys[:5], [b"after"] * 5, b"")  # not part of the snapshot
    files = snapshot.materialize()
    assert files[-1].name == SNAPSHOT_MANIFEST and snapshot.materialized
    assert snapshot.materialize() == files  # idempotent
    restored = restore([snapshot.directory])
    assert dump(restored) == before
    assert restored.get_meta(COMMITTED_EPOCH) == b"42"
    assert sum(len(v) for v in before.values()) == 300 * 2 * 8


@pytest.mark.parametrize("source_kind", ["rocksdb", "hashmap"])
def test_restore_reads_snapshots_of_either_backend(
    kind: str, source_kind: str, clock: ManualClock, tmp_path: Path, restore: Callable[..., KeyedStateBackend]
) -> None:
    source = create_backend(
        source_kind,
        SubtaskId("job1", "op1", 3),
        FULL,
        MP,
        STATES,
        local_dir=tmp_path / "src",
        limits=StateLimits(),
        clock=clock,
    )
    try:
        populate(source, keys_in(FULL, 40))
        expected = dump(source)
        directory = snap(source, tmp_path / "src-chk")
    finally:
        source.close()
    assert dump(restore([directory], as_kind=kind)) == expected


def test_restore_after_rescaling_keeps_exactly_the_new_key_groups(
    make: Callable[..., KeyedStateBackend], restore: Callable[..., KeyedStateBackend], tmp_path: Path
) -> None:
    low, high, new = KeyGroupRange(0, 63), KeyGroupRange(64, 127), KeyGroupRange(32, 95)
    a, b = make(key_groups=low, index=0), make(key_groups=high, index=1)
    keys_low, keys_high = keys_in(low, 150), keys_in(high, 150)
    populate(a, keys_low)
    populate(b, keys_high)
    a.apply([], meta={COMMITTED_EPOCH: b"from-a"})
    b.apply([], meta={COMMITTED_EPOCH: b"from-b", b"only-b": b"1"})
    expected = {
        state: {k: v for k, v in {**entries, **dump(b)[state]}.items() if key_group(k[0], MP) in new}
        for state, entries in dump(a).items()
    }
    restored = restore([snap(a, tmp_path / "a"), snap(b, tmp_path / "b")], key_groups=new)
    got = dump(restored)
    assert got == expected
    wanted = {k for k in keys_low + keys_high if key_group(k, MP) in new}
    assert {k for k, _ in got["v"]} == wanted and 0 < len(wanted) < 300
    assert restored.get_meta(COMMITTED_EPOCH) == b"from-a"  # the first snapshot listed wins
    assert restored.get_meta(b"only-b") == b"1"
    outside = next(k for k in keys_low if key_group(k, MP) not in new)
    with pytest.raises(StaleRoutingError):
        restored.value_get("v", [outside], b"")
    # Nothing of the old ranges hides in the restored slot: scaling back to one slot shows only `new`.
    assert dump(restore([snap(restored, tmp_path / "again")], index=9)) == expected


def test_list_order_survives_restore_and_appends_continue_after_it(
    backend: KeyedStateBackend, restore: Callable[..., KeyedStateBackend], tmp_path: Path
) -> None:
    backend.list_append("l", [b"a"] * 5, [b"1", b"2", b"3", b"4", b"5"], b"")
    backend.list_update("l", [b"b", b"b"], [b"x", b"y"], b"")
    backend.list_append("l", [b"b"], [b"z"], b"")
    restored = restore([snap(backend, tmp_path / "c")])
    restored.list_append("l", [b"a", b"b"], [b"6", b"w"], b"")
    assert restored.list_get("l", [b"a", b"b"], b"") == [[b"1", b"2", b"3", b"4", b"5", b"6"], [b"x", b"y", b"z", b"w"]]
    again = restore([snap(restored, tmp_path / "d")], index=8)
    assert list(again.list_scan("l", b"a", b"")) == [b"1", b"2", b"3", b"4", b"5", b"6"]


def test_restore_keeps_undeclared_states_for_a_later_version(
    backend: KeyedStateBackend, restore: Callable[..., KeyedStateBackend], tmp_path: Path
) -> None:
    backend.value_put("v", [b"a"], [b"1"], b"")
    backend.list_append("l", [b"a"], [b"x"], b"")
    without_l = tuple(d for d in STATES if d.name != "l")
    middle = restore([snap(backend, tmp_path / "one")], states=without_l)
    with pytest.raises(NotFoundError):
        middle.list_get("l", [b"a"], b"")
    assert [d.name for d in middle.descriptors()] == [d.name for d in without_l]
    final = restore([snap(middle, tmp_path / "two")], index=9)
    assert final.list_get("l", [b"a"], b"") == [[b"x"]]


def test_restore_with_ttl_disabled_keeps_values(
    backend: KeyedStateBackend, clock: ManualClock, restore: Callable[..., KeyedStateBackend], tmp_path: Path
) -> None:
    backend.value_put("tv", [b"a"], [b"1"], b"")
    plain = tuple(StateDescriptor(d.name, d.kind, None, d.reduce_fields) for d in STATES)
    restored = restore([snap(backend, tmp_path / "s")], states=plain)
    clock.advance(TTL * 10)
    assert restored.value_get("tv", [b"a"], b"") == [b"1"]


def test_restore_refuses_a_different_max_parallelism(
    make: Callable[..., KeyedStateBackend], restore: Callable[..., KeyedStateBackend], tmp_path: Path
) -> None:
    directory = snap(make(key_groups=KeyGroupRange(0, 255), max_parallelism=256), tmp_path / "s")
    with pytest.raises(IncompatibleCheckpointError, match="max parallelism 256"):
        restore([directory])


def test_restore_refuses_a_state_whose_kind_changed(
    backend: KeyedStateBackend, restore: Callable[..., KeyedStateBackend], tmp_path: Path
) -> None:
    directory = snap(backend, tmp_path / "s")
    changed = tuple(StateDescriptor("v", StateKind.LIST) if d.name == "v" else d for d in STATES)
    with pytest.raises(IncompatibleCheckpointError, match="'v' is value state"):
        restore([directory], states=changed)
    refielded = tuple(
        StateDescriptor("r", StateKind.REDUCING, reduce_fields=(ReduceField("x"),)) if d.name == "r" else d
        for d in STATES
    )
    with pytest.raises(IncompatibleCheckpointError, match="reducing state 'r'"):
        restore([directory], states=refielded)


def test_restore_refuses_incomplete_missing_and_overlapping_snapshots(
    make: Callable[..., KeyedStateBackend], restore: Callable[..., KeyedStateBackend], tmp_path: Path
) -> None:
    backend = make()
    backend.value_put("v", [b"a"], [b"1"], b"")
    unfinished = backend.snapshot(tmp_path / "unfinished")  # HashMap: not materialized yet
    (unfinished.directory / SNAPSHOT_MANIFEST).unlink(missing_ok=True)
    with pytest.raises(CorruptCheckpointError, match="incomplete"):
        restore([unfinished.directory])
    with pytest.raises(CorruptCheckpointError, match="does not exist"):
        restore([tmp_path / "never-written"])
    full = snap(backend, tmp_path / "full")
    other = snap(make(index=1), tmp_path / "other")
    with pytest.raises(InvalidArgumentError, match="both hold key groups"):
        restore([full, other])
    with pytest.raises(InvalidArgumentError):
        restore([])


def test_snapshot_into_an_existing_directory_is_refused(backend: KeyedStateBackend, tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    with pytest.raises(InvalidArgumentError, match="already exists"):
        backend.snapshot(tmp_path / "taken")


def test_snapshot_serving_continues_until_materialized(
    backend: KeyedStateBackend, restore: Callable[..., KeyedStateBackend], tmp_path: Path
) -> None:
    backend.value_put("v", [b"a"], [b"before"], b"")
    backend.list_append("l", [b"a"], [b"before"], b"")
    backend.map_put("m", [b"a"], [b"u"], [b"before"], b"")
    pending = backend.snapshot(tmp_path / "p")
    backend.value_put("v", [b"a"], [b"after"], b"")
    backend.list_append("l", [b"a"], [b"after"], b"")
    backend.map_put("m", [b"a", b"a"], [b"u", b"u2"], [b"after", b"after"], b"")
    backend.apply([], meta={COMMITTED_EPOCH: b"after"})
    assert backend.value_get("v", [b"a"], b"") == [b"after"]
    pending.materialize()
    restored = restore([pending.directory])
    assert restored.value_get("v", [b"a"], b"") == [b"before"]
    assert restored.list_get("l", [b"a"], b"") == [[b"before"]]
    assert list(restored.map_scan("m", b"a", b"")) == [(b"u", b"before")]
    assert restored.get_meta(COMMITTED_EPOCH) is None


# -- lifecycle --------------------------------------------------------------------------------


def test_calls_after_close_are_refused_clearly(make: Callable[..., KeyedStateBackend]) -> None:
    backend = make()
    backend.list_append("l", [b"a"] * 3, [b"1", b"2", b"3"], b"")
    scan = backend.list_scan("l", b"a", b"")
    backend.close()
    backend.close()  # idempotent
    assert backend.closed
    for call in (
        lambda: backend.value_get("v", [b"a"], b""),
        lambda: backend.value_put("v", [b"a"], [b"1"], b""),
        lambda: list(scan),
        lambda: backend.get_meta(b"x"),
        lambda: backend.stats(),
    ):
        with pytest.raises(UnavailableError) as info:
            call()
        assert info.value.reason is Reason.SHUTTING_DOWN


def test_stats_report_the_number_of_entries(backend: KeyedStateBackend) -> None:
    backend.value_put("v", keys_in(FULL, 100), [b"x"] * 100, b"")
    stats = backend.stats()
    assert stats["estimate-num-keys"] >= 100
    assert all(isinstance(v, int) for v in stats.values())


def test_descriptor_returns_the_declared_one(backend: KeyedStateBackend) -> None:
    assert backend.descriptor("tvr") == STATES[5]


# -- RocksDB only: the working DB on local disk -----------------------------------------------


def test_rocksdb_close_and_reopen_keeps_data_and_releases_the_lock(clock: ManualClock, tmp_path: Path) -> None:
    def open_backend() -> KeyedStateBackend:
        return create_backend(
            "rocksdb",
            SubtaskId("job1", "op1", 0),
            FULL,
            MP,
            STATES,
            local_dir=tmp_path,
            limits=StateLimits(),
            clock=clock,
        )

    first = open_backend()
    populate(first, keys_in(FULL, 50))
    expected = dump(first)
    list(first.list_scan("l", b"key-0", b""))  # leave no scan behind holding the DB
    first.close()
    second = open_backend()  # would fail with "lock hold" if anything still referenced the DB
    try:
        assert dump(second) == expected
        assert second.get_meta(COMMITTED_EPOCH) == b"42"
        key = keys_in(FULL, 1)[0]
        second.list_append("l", [key], [b"after-reopen"], b"")
        assert second.list_get("l", [key], b"")[0][-1] == b"after-reopen"
        assert second.list_get("l", [key], b"")[0][:2] == [b"a:" + key, b"b:" + key]
    finally:
        second.close()
    third = open_backend()
    third.close()
    assert isinstance(third, RocksDBKeyedStateBackend)
