"""Local snapshot files: the .kvs format, the manifest, and their failure modes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keyedstate.common.descriptors import StateDescriptor, StateKind, TtlConfig
from keyedstate.common.errors import CorruptCheckpointError, IncompatibleCheckpointError
from keyedstate.common.ids import KeyGroupRange, SubtaskId
from keyedstate.taskmanager.state import layout
from keyedstate.taskmanager.state.metadata import SNAPSHOT_MANIFEST
from keyedstate.taskmanager.state.snapshot import (
    HashMapSnapshotReader,
    LocalSnapshot,
    SnapshotManifest,
    open_snapshot,
    read_kvs,
    write_kvs,
)

RECORDS = [(b"", b""), (b"a", b"1"), (b"b" * 70_000, b"v" * 300_000), (b"c", b"")]


def test_kvs_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "state-x.kvs"
    assert write_kvs(path, RECORDS) == 4
    assert list(read_kvs(path)) == RECORDS
    assert not list(tmp_path.glob("*.tmp"))
    write_kvs(tmp_path / "empty.kvs", [])
    assert list(read_kvs(tmp_path / "empty.kvs")) == []


@pytest.mark.parametrize("damage", ["truncate", "flip", "footer", "magic"])
def test_damaged_kvs_files_are_reported_as_corrupt(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "state-x.kvs"
    write_kvs(path, RECORDS)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[100] ^= 0x01
    elif damage == "footer":
        data[-13] ^= 0x01  # the record count
    else:
        data[0:4] = b"NOPE"
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=str(path)):
        list(read_kvs(path))


def test_missing_kvs_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(CorruptCheckpointError, match="missing"):
        list(read_kvs(tmp_path / "gone.kvs"))


def manifest(**overrides: object) -> SnapshotManifest:
    values: dict[str, object] = {
        "backend": "hashmap",
        "subtask": SubtaskId("job", "op", 2),
        "key_groups": KeyGroupRange(10, 20),
        "max_parallelism": 128,
        "states": (StateDescriptor("a", StateKind.VALUE, TtlConfig(5)), StateDescriptor("b", StateKind.LIST)),
        "created_ms": 123,
    }
    values.update(overrides)
    return SnapshotManifest(**values)  # type: ignore[arg-type]


def test_manifest_round_trip(tmp_path: Path) -> None:
    m = manifest()
    m.write(tmp_path)
    assert SnapshotManifest.read(tmp_path) == m
    assert json.loads((tmp_path / SNAPSHOT_MANIFEST).read_text())["key_groups"] == [10, 20]


def test_newer_manifest_is_incompatible_and_garbage_is_corrupt(tmp_path: Path) -> None:
    manifest(format_version=99).write(tmp_path)
    with pytest.raises(IncompatibleCheckpointError, match="upgrade"):
        SnapshotManifest.read(tmp_path)
    (tmp_path / SNAPSHOT_MANIFEST).write_text('{"format_version": 1}')
    with pytest.raises(CorruptCheckpointError, match="not a valid snapshot manifest"):
        SnapshotManifest.read(tmp_path)
    (tmp_path / SNAPSHOT_MANIFEST).write_text("not json")
    with pytest.raises(CorruptCheckpointError):
        SnapshotManifest.read(tmp_path)


def test_unknown_backend_in_manifest_is_refused(tmp_path: Path) -> None:
    manifest(backend="cassandra").write(tmp_path)
    with pytest.raises(IncompatibleCheckpointError, match="cassandra"):
        open_snapshot(tmp_path)


def test_local_snapshot_materializes_once_and_lists_the_manifest_last(tmp_path: Path) -> None:
    calls = []

    def pending() -> None:
        calls.append(1)
        write_kvs(tmp_path / "state-a.kvs", [(b"k", b"v")])
        write_kvs(tmp_path / "meta.kvs", [])

    snap = LocalSnapshot(tmp_path, manifest(), _pending=pending)
    assert not snap.materialized and snap.files() == []
    files = snap.materialize()
    assert [f.name for f in files] == ["meta.kvs", "state-a.kvs", SNAPSHOT_MANIFEST]
    assert snap.materialize() == files and calls == [1]
    assert snap.size_bytes() > 0
    snap.discard()
    assert not tmp_path.exists()


def test_hashmap_reader_filters_by_key_group(tmp_path: Path) -> None:
    records = sorted((layout.key_prefix(g, b"k%d" % g, b""), b"v") for g in (5, 10, 15, 20, 21))
    write_kvs(tmp_path / "state-a.kvs", records)
    write_kvs(tmp_path / "meta.kvs", [(b"committed-epoch", b"3")])
    manifest().write(tmp_path)
    with open_snapshot(tmp_path) as reader:
        assert isinstance(reader, HashMapSnapshotReader)
        got = [layout.key_group_of(k) for k, _ in reader.entries("a", KeyGroupRange(10, 20))]
        assert got == [10, 15, 20]
        assert reader.meta() == {b"committed-epoch": b"3"}
        with pytest.raises(CorruptCheckpointError, match="state-b.kvs"):
            list(reader.entries("b", KeyGroupRange(0, 127)))
