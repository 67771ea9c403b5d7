"""The CheckpointStorage contract, written once and run against every storage we can run here.

Each subclass provides two fixtures: ``storage`` and ``root`` (an absolute URL of an empty
directory/prefix for this test). HDFS cannot run here (see common/storage/_hdfs.py).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from keyedstate.common.errors import InvalidArgumentError, StorageError
from keyedstate.common.storage import CheckpointStorage, FileInfo, open_storage


class StorageContract:
    """Abstract: not collected (no ``Test`` prefix); subclasses bind the fixtures."""

    @pytest.fixture
    def storage(self) -> CheckpointStorage:
        raise NotImplementedError

    @pytest.fixture
    def root(self) -> str:
        raise NotImplementedError

    # -- bytes --------------------------------------------------------------------------------
    def test_write_then_read(self, storage: CheckpointStorage, root: str) -> None:
        path = storage.join(root, "chk-1", "_metadata")
        storage.write_bytes(path, b"hello")
        assert storage.read_bytes(path) == b"hello"
        storage.write_bytes(path, b"replaced, longer")
        assert storage.read_bytes(path) == b"replaced, longer"

    def test_empty_object_round_trip(self, storage: CheckpointStorage, root: str) -> None:
        path = storage.join(root, "empty")
        storage.write_bytes(path, b"")
        assert storage.read_bytes(path) == b""
        assert storage.size(path) == 0
        assert storage.exists(path)

    def test_read_missing_raises_file_not_found_naming_the_url(self, storage: CheckpointStorage, root: str) -> None:
        path = storage.join(root, "nope", "missing.sst")
        with pytest.raises(FileNotFoundError) as info:
            storage.read_bytes(path)
        assert path in str(info.value)
        assert info.value.filename == path

    def test_size_and_exists(self, storage: CheckpointStorage, root: str) -> None:
        path = storage.join(root, "d", "f.bin")
        assert not storage.exists(path)
        storage.write_bytes(path, b"x" * 1234)
        assert storage.exists(path)
        assert storage.exists(storage.join(root, "d"))
        assert storage.size(path) == 1234
        with pytest.raises(FileNotFoundError):
            storage.size(storage.join(root, "d", "other.bin"))

    # -- exclusive create ------------------------------------------------------------------------
    def test_create_exclusive_creates_a_new_object(self, storage: CheckpointStorage, root: str) -> None:
        path = storage.join(root, "chk-7", "_metadata")
        storage.create_exclusive(path, b"first")
        assert storage.read_bytes(path) == b"first"

    def test_create_exclusive_refuses_existing_and_keeps_the_original(
        self, storage: CheckpointStorage, root: str
    ) -> None:
        path = storage.join(root, "chk-7", "_metadata")
        storage.write_bytes(path, b"original")
        with pytest.raises(FileExistsError) as info:
            storage.create_exclusive(path, b"intruder")
        assert info.value.filename == path
        assert storage.read_bytes(path) == b"original"
        assert [i.path for i in storage.list(storage.join(root, "chk-7"))] == [path]

    def test_create_exclusive_has_one_winner_among_racing_writers(self, storage: CheckpointStorage, root: str) -> None:
        path = storage.join(root, "race", "_metadata")
        writers = 6
        start = threading.Barrier(writers)
        outcomes: list[str] = []
        lock = threading.Lock()

        def writer(n: int) -> None:
            start.wait(timeout=10)
            try:
                storage.create_exclusive(path, f"writer-{n}".encode())
                result = f"won-{n}"
            except FileExistsError:
                result = "lost"
            with lock:
                outcomes.append(result)

        threads = [threading.Thread(target=writer, args=(n,)) for n in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        winners = [o for o in outcomes if o.startswith("won-")]
        assert len(outcomes) == writers
        assert len(winners) == 1, outcomes
        assert storage.read_bytes(path) == f"writer-{winners[0][4:]}".encode()

    # -- files ---------------------------------------------------------------------------------------
    def test_put_file_get_file_round_trip_of_a_multi_mb_file(
        self, storage: CheckpointStorage, root: str, tmp_path: Path
    ) -> None:
        payload = os.urandom(6 * 1024 * 1024 + 17)
        src = tmp_path / "src.sst"
        src.write_bytes(payload)
        remote = storage.join(root, "shared", "000042.sst")
        storage.put_file(str(src), remote)
        assert storage.size(remote) == len(payload)
        dst = tmp_path / "restore" / "deep" / "000042.sst"  # parents are created
        storage.get_file(remote, str(dst))
        assert dst.read_bytes() == payload
        assert sorted(os.listdir(dst.parent)) == ["000042.sst"]  # no temporary left behind

    def test_get_file_replaces_an_existing_local_file(
        self, storage: CheckpointStorage, root: str, tmp_path: Path
    ) -> None:
        remote = storage.join(root, "f")
        storage.write_bytes(remote, b"new")
        dst = tmp_path / "f"
        dst.write_bytes(b"old and longer")
        storage.get_file(remote, str(dst))
        assert dst.read_bytes() == b"new"

    def test_get_file_of_missing_object_raises_and_creates_nothing(
        self, storage: CheckpointStorage, root: str, tmp_path: Path
    ) -> None:
        remote = storage.join(root, "missing.sst")
        with pytest.raises(FileNotFoundError) as info:
            storage.get_file(remote, str(tmp_path / "out" / "x.sst"))
        assert info.value.filename == remote
        assert not (tmp_path / "out" / "x.sst").exists()
        assert os.listdir(tmp_path / "out") == []

    def test_put_file_of_missing_local_file_names_the_local_path(
        self, storage: CheckpointStorage, root: str, tmp_path: Path
    ) -> None:
        local = str(tmp_path / "not-there.sst")
        with pytest.raises(FileNotFoundError) as info:
            storage.put_file(local, storage.join(root, "x.sst"))
        assert info.value.filename == local
        assert not storage.exists(storage.join(root, "x.sst"))

    # -- listing -------------------------------------------------------------------------------------
    def _populate(self, storage: CheckpointStorage, root: str) -> None:
        for rel, data in {
            "chk-1/_metadata": b"m",
            "chk-1/taskowned/a.sst": b"aa",
            "chk-1/taskowned/sub/b.sst": b"bbb",
            "chk-10/_metadata": b"mm",
            "top.txt": b"tttt",
        }.items():
            storage.write_bytes(storage.join(root, *rel.split("/")), data)

    def test_list_non_recursive_returns_children_with_absolute_urls(
        self, storage: CheckpointStorage, root: str
    ) -> None:
        self._populate(storage, root)
        listed = list(storage.list(storage.join(root, "chk-1")))
        assert listed == [
            FileInfo(storage.join(root, "chk-1", "_metadata"), 1, False),
            FileInfo(storage.join(root, "chk-1", "taskowned"), 0, True),
        ]
        top = list(storage.list(root))
        assert [(i.path, i.is_dir) for i in top] == [
            (storage.join(root, "chk-1"), True),
            (storage.join(root, "chk-10"), True),
            (storage.join(root, "top.txt"), False),
        ]

    def test_list_recursive_returns_every_file_and_no_directories(self, storage: CheckpointStorage, root: str) -> None:
        self._populate(storage, root)
        listed = list(storage.list(storage.join(root, "chk-1"), recursive=True))
        assert listed == [
            FileInfo(storage.join(root, "chk-1", "_metadata"), 1, False),
            FileInfo(storage.join(root, "chk-1", "taskowned", "a.sst"), 2, False),
            FileInfo(storage.join(root, "chk-1", "taskowned", "sub", "b.sst"), 3, False),
        ]
        assert all(i.path.startswith(root) for i in listed)

    def test_list_of_missing_path_is_empty(self, storage: CheckpointStorage, root: str) -> None:
        assert list(storage.list(storage.join(root, "nothing-here"))) == []
        assert list(storage.list(storage.join(root, "nothing-here"), recursive=True)) == []

    def test_listing_is_fresh_after_writes_and_deletes(self, storage: CheckpointStorage, root: str) -> None:
        directory = storage.join(root, "fresh")
        assert list(storage.list(directory)) == []
        storage.write_bytes(storage.join(directory, "a"), b"1")
        assert [i.path for i in storage.list(directory)] == [storage.join(directory, "a")]
        storage.write_bytes(storage.join(directory, "b"), b"2")
        assert len(list(storage.list(directory))) == 2
        storage.delete(storage.join(directory, "a"))
        assert [i.path for i in storage.list(directory)] == [storage.join(directory, "b")]
        assert not storage.exists(storage.join(directory, "a"))

    # -- deleting ------------------------------------------------------------------------------------
    def test_delete_removes_a_file_and_ignores_a_missing_one(self, storage: CheckpointStorage, root: str) -> None:
        path = storage.join(root, "gone")
        storage.write_bytes(path, b"x")
        storage.delete(path)
        assert not storage.exists(path)
        storage.delete(path)  # again: missing is fine

    def test_delete_dir_removes_the_tree_but_not_a_sibling_sharing_its_prefix(
        self, storage: CheckpointStorage, root: str
    ) -> None:
        self._populate(storage, root)
        storage.delete_dir(storage.join(root, "chk-1"))
        assert list(storage.list(storage.join(root, "chk-1"), recursive=True)) == []
        assert not storage.exists(storage.join(root, "chk-1", "_metadata"))
        assert storage.read_bytes(storage.join(root, "chk-10", "_metadata")) == b"mm"
        assert storage.read_bytes(storage.join(root, "top.txt")) == b"tttt"
        storage.delete_dir(storage.join(root, "chk-1"))  # again: missing is fine

    # -- paths ----------------------------------------------------------------------------------------
    def test_makedirs_is_idempotent_and_writes_below_it_work(self, storage: CheckpointStorage, root: str) -> None:
        target = storage.join(root, "job", "taskowned")
        storage.makedirs(target)
        storage.makedirs(target)
        storage.write_bytes(storage.join(target, "f"), b"x")
        assert storage.read_bytes(storage.join(target, "f")) == b"x"
        assert [i.path for i in storage.list(target)] == [storage.join(target, "f")]

    def test_join(self, storage: CheckpointStorage, root: str) -> None:
        assert storage.join(root, "a", "b/c") == root.rstrip("/") + "/a/b/c"
        assert storage.join(root + "/", "/a/") == root.rstrip("/") + "/a"
        for bad in ("..", "a/../b", "", "./x"):
            with pytest.raises(InvalidArgumentError):
                storage.join(root, bad)

    def test_a_url_of_another_scheme_is_refused(self, storage: CheckpointStorage, root: str) -> None:
        with pytest.raises(InvalidArgumentError):
            storage.read_bytes("gs://bucket/x" if not root.startswith("gs") else "s3://b/x")


class TestLocalFileUrlStorage(StorageContract):
    @pytest.fixture
    def storage(self) -> CheckpointStorage:
        return open_storage("file:///")

    @pytest.fixture
    def root(self, tmp_path: Path) -> str:
        return f"file://{tmp_path}/checkpoints"


class TestLocalPlainPathStorage(StorageContract):
    @pytest.fixture
    def storage(self, tmp_path: Path) -> CheckpointStorage:
        return open_storage(str(tmp_path))

    @pytest.fixture
    def root(self, tmp_path: Path) -> str:
        return str(tmp_path / "checkpoints")


class TestJobManagerMemoryStorage(StorageContract):
    @pytest.fixture
    def storage(self) -> CheckpointStorage:
        return open_storage("jobmanager://contract")

    @pytest.fixture
    def root(self, tmp_path: Path) -> Iterator[str]:
        root = f"jobmanager://contract-{tmp_path.name}/checkpoints"
        yield root
        open_storage(root).delete_dir(root)


@pytest.mark.s3
class TestS3Storage(StorageContract):
    @pytest.fixture
    def storage(self, s3_config) -> CheckpointStorage:  # type: ignore[no-untyped-def]
        return open_storage("s3://bucket", s3_config)

    @pytest.fixture
    def root(self, s3_bucket: tuple[str, str]) -> str:
        return f"s3://{s3_bucket[1]}/jobs/checkpoints"


def test_makedirs_creates_an_empty_local_directory(tmp_path: Path) -> None:
    storage = open_storage(f"file://{tmp_path}")
    storage.makedirs(f"file://{tmp_path}/a/b/shared")
    assert (tmp_path / "a" / "b" / "shared").is_dir()
    assert storage.exists(f"file://{tmp_path}/a/b/shared")


def test_storage_error_is_not_raised_for_plain_misses(tmp_path: Path) -> None:
    # A miss is a FileNotFoundError, never a StorageError: callers distinguish "absent" from "broken".
    storage = open_storage(str(tmp_path))
    with pytest.raises(FileNotFoundError) as info:
        storage.read_bytes(str(tmp_path / "x"))
    assert not isinstance(info.value, StorageError)
