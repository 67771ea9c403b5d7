"""RocksDB-only behaviour: the working directory, reopening, clipping, and restore by hard links."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import rocksdict

from keyedstate.common.descriptors import StateDescriptor, StateKind
from keyedstate.common.errors import ConfigError, IncompatibleCheckpointError, InvalidArgumentError, StorageError
from keyedstate.common.ids import KeyGroupRange, SubtaskId
from keyedstate.common.keygroups import key_group
from keyedstate.taskmanager.state import (
    HashMapKeyedStateBackend,
    KeyedStateBackend,
    RocksDBKeyedStateBackend,
    StateLimits,
    create_backend,
    layout,
    restore_backend,
    slot_db_dir,
)
from keyedstate.taskmanager.state.metadata import META_CF
from tests.fakes.clock import ManualClock

MP = 128
ALL_KEY_GROUPS = KeyGroupRange(0, MP - 1)
SUBTASK = SubtaskId("job", "op", 0)
STATES = (StateDescriptor("v", StateKind.VALUE), StateDescriptor("l", StateKind.LIST))


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def opened() -> Iterator[list[KeyedStateBackend]]:
    backends: list[KeyedStateBackend] = []
    yield backends
    for b in backends:
        b.close()


def open_rocks(
    local: Path,
    clock: ManualClock,
    opened: list[KeyedStateBackend],
    key_groups: KeyGroupRange = ALL_KEY_GROUPS,
    states: tuple[StateDescriptor, ...] = STATES,
    mp: int = MP,
) -> KeyedStateBackend:
    b = create_backend("rocksdb", SUBTASK, key_groups, mp, states, local_dir=local, limits=StateLimits(), clock=clock)
    opened.append(b)
    return b


def keys_in(groups: KeyGroupRange, n: int) -> list[bytes]:
    out: list[bytes] = []
    i = 0
    while len(out) < n:
        k = b"k%d" % i
        if key_group(k, MP) in groups:
            out.append(k)
        i += 1
    return out


def test_db_lives_in_the_instance_directory(
    tmp_path: Path, clock: ManualClock, opened: list[KeyedStateBackend]
) -> None:
    b = open_rocks(tmp_path, clock, opened)
    assert isinstance(b, RocksDBKeyedStateBackend)
    assert b.db_dir == tmp_path / "job_job_op_op_0" / "db" == slot_db_dir(tmp_path, SUBTASK)
    assert (b.db_dir / "CURRENT").exists()
    assert set(rocksdict.Rdict.list_cf(str(b.db_dir), rocksdict.Options(raw_mode=True))) == {
        "default",
        META_CF,
        "v",
        "l",
    }


def test_unwritable_local_dir_names_the_config_key(
    tmp_path: Path, clock: ManualClock, opened: list[KeyedStateBackend]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="state.backend.rocksdb.localdir"):
        open_rocks(blocker / "sub", clock, opened)


def test_a_slot_db_cannot_be_opened_twice(tmp_path: Path, clock: ManualClock, opened: list[KeyedStateBackend]) -> None:
    open_rocks(tmp_path, clock, opened)
    with pytest.raises(StorageError, match="release that slot first"):
        open_rocks(tmp_path, clock, opened)


def test_reopen_refuses_other_max_parallelism_and_changed_kinds_then_still_opens(
    tmp_path: Path, clock: ManualClock, opened: list[KeyedStateBackend]
) -> None:
    b = open_rocks(tmp_path, clock, opened)
    b.value_put("v", [b"a"], [b"1"], b"")
    b.close()
    with pytest.raises(IncompatibleCheckpointError, match="max parallelism 128"):
        open_rocks(tmp_path, clock, opened, key_groups=KeyGroupRange(0, 255), mp=256)
    with pytest.raises(IncompatibleCheckpointError, match="'v' is value state"):
        open_rocks(tmp_path, clock, opened, states=(StateDescriptor("v", StateKind.MAP),))
    # The failed opens released the DB (no LOCK left behind).
    again = open_rocks(tmp_path, clock, opened)
    assert again.value_get("v", [b"a"], b"") == [b"1"]


def test_reopen_with_a_smaller_range_deletes_the_other_key_groups(
    tmp_path: Path, clock: ManualClock, opened: list[KeyedStateBackend]
) -> None:
    b = open_rocks(tmp_path, clock, opened)
    keys = keys_in(KeyGroupRange(0, 127), 200)
    b.value_put("v", keys, [b"x"] * len(keys), b"")
    b.list_append("l", keys, [b"e"] * len(keys), b"")
    b.close()
    open_rocks(tmp_path, clock, opened, key_groups=KeyGroupRange(0, 63)).close()
    wide = open_rocks(tmp_path, clock, opened)
    low = [k for k in keys if key_group(k, MP) <= 63]
    assert sorted(k for k, _ in wide.scan_keys("v")) == sorted(low)
    assert sorted(k for k, _ in wide.scan_keys("l")) == sorted(low)


def test_list_sequence_numbers_continue_after_reopen(
    tmp_path: Path, clock: ManualClock, opened: list[KeyedStateBackend]
) -> None:
    b = open_rocks(tmp_path, clock, opened)
    b.list_append("l", [b"a", b"a"], [b"1", b"2"], b"")
    b.close()
    b = open_rocks(tmp_path, clock, opened)
    b.list_append("l", [b"a"], [b"3"], b"")
    db_dir = cast(RocksDBKeyedStateBackend, b).db_dir
    b.close()
    raw = rocksdict.Rdict(
        str(db_dir),
        rocksdict.Options(raw_mode=True),
        column_families={n: rocksdict.Options(raw_mode=True) for n in ("l", "v", META_CF)},
        access_type=rocksdict.AccessType.read_only(False),
    )
    cf = raw.get_column_family("l")
    keys = cast("Iterator[bytes]", cf.keys())  # raw mode: bytes keys (a column family is not iterable)
    seqs = [layout.decode_key(k).seq for k in keys]
    del cf
    raw.close()
    assert seqs == [0, 1, 2]


def test_abandoned_scans_do_not_keep_the_db_locked(
    tmp_path: Path, clock: ManualClock, opened: list[KeyedStateBackend]
) -> None:
    b = open_rocks(tmp_path, clock, opened)
    b.list_append("l", [b"a"] * 3000, [b"%d" % i for i in range(3000)], b"")
    scan = b.list_scan("l", b"a", b"")
    assert next(scan) == b"0"  # first chunk read, generator left suspended
    b.close()
    again = open_rocks(tmp_path, clock, opened)
    assert len(again.list_get("l", [b"a"], b"")[0]) == 3000


def test_restore_from_one_covering_snapshot_hard_links_its_sst_files(
    tmp_path: Path, clock: ManualClock, opened: list[KeyedStateBackend]
) -> None:
    source = open_rocks(tmp_path / "src", clock, opened)
    keys = keys_in(KeyGroupRange(0, 127), 500)
    source.value_put("v", keys, [b"x" * 50] * len(keys), b"")
    snapshot = source.snapshot(tmp_path / "chk")
    sst = sorted(p for p in snapshot.directory.iterdir() if p.suffix == ".sst")
    assert sst and all(p.stat().st_nlink >= 2 for p in sst)  # the checkpoint links the working DB's files

    restored = restore_backend(
        "rocksdb",
        SubtaskId("job", "op", 1),
        KeyGroupRange(0, 63),
        MP,
        STATES,
        snapshot_dirs=[snapshot.directory],
        local_dir=tmp_path / "dst",
        limits=StateLimits(),
        clock=clock,
    )
    opened.append(restored)
    assert isinstance(restored, RocksDBKeyedStateBackend)
    linked = {p.name: p.stat().st_ino for p in restored.db_dir.iterdir() if p.suffix == ".sst"}
    assert all(linked.get(p.name) == p.stat().st_ino for p in sst)
    low = [k for k in keys if key_group(k, MP) <= 63]
    assert sorted(k for k, _ in restored.scan_keys("v")) == sorted(low)

    # Writing to (and closing) the restored DB leaves the snapshot intact and reusable.
    restored.value_put("v", low, [b"changed"] * len(low), b"")
    restored.close()
    again = restore_backend(
        "rocksdb",
        SubtaskId("job", "op", 2),
        KeyGroupRange(0, 127),
        MP,
        STATES,
        snapshot_dirs=[snapshot.directory],
        local_dir=tmp_path / "dst2",
        limits=StateLimits(),
        clock=clock,
    )
    opened.append(again)
    assert set(again.value_get("v", keys, b"")) == {b"x" * 50}


def test_restore_replaces_stale_local_data(tmp_path: Path, clock: ManualClock, opened: list[KeyedStateBackend]) -> None:
    stale = open_rocks(tmp_path, clock, opened)
    stale.value_put("v", [b"stale"], [b"1"], b"")
    source = HashMapKeyedStateBackend(
        SubtaskId("job", "op", 5), KeyGroupRange(0, 127), MP, STATES, limits=StateLimits(), clock=clock
    )
    source.value_put("v", [b"fresh"], [b"2"], b"")
    directory = tmp_path / "hm-chk"
    source.snapshot(directory).materialize()
    stale.close()
    restored = restore_backend(
        "rocksdb",
        SUBTASK,
        KeyGroupRange(0, 127),
        MP,
        STATES,
        snapshot_dirs=[directory],
        local_dir=tmp_path,
        limits=StateLimits(),
        clock=clock,
    )
    opened.append(restored)
    assert list(restored.scan_keys("v")) == [(b"fresh", b"")]


def test_snapshot_that_cannot_be_written_is_a_storage_error(
    tmp_path: Path, clock: ManualClock, opened: list[KeyedStateBackend]
) -> None:
    b = open_rocks(tmp_path / "db", clock, opened)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StorageError):
        b.snapshot(blocker / "chk")
    assert b.value_get("v", [b"a"], b"") == [None]  # still serving


def test_unknown_backend_kind_is_a_config_error(tmp_path: Path, clock: ManualClock) -> None:
    with pytest.raises(ConfigError, match="state.backend.type"):
        create_backend(
            "leveldb", SUBTASK, KeyGroupRange(0, 127), MP, STATES, local_dir=tmp_path, limits=StateLimits(), clock=clock
        )


@pytest.mark.parametrize("key_groups", [KeyGroupRange(0, 128), KeyGroupRange.empty(), KeyGroupRange(-1, 3)])
def test_key_group_range_must_fit_max_parallelism(
    tmp_path: Path, clock: ManualClock, key_groups: KeyGroupRange
) -> None:
    with pytest.raises(InvalidArgumentError, match="key-group range"):
        create_backend(
            "rocksdb", SUBTASK, key_groups, MP, STATES, local_dir=tmp_path, limits=StateLimits(), clock=clock
        )
    assert not os.path.exists(slot_db_dir(tmp_path, SUBTASK))
