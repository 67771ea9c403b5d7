"""Local storage specifics: URL forms, atomic publication, temporaries, failures."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from keyedstate.common.errors import InvalidArgumentError, StorageError
from keyedstate.common.storage import LocalStorage, open_storage
from keyedstate.common.storage._fsspec import TEMP_PREFIX
from keyedstate.common.storage._local import rename_no_replace


def test_file_urls_and_plain_paths_name_the_same_files(tmp_path: Path) -> None:
    storage = LocalStorage()
    storage.write_bytes(f"file://{tmp_path}/a/b", b"1")
    assert (tmp_path / "a" / "b").read_bytes() == b"1"
    assert storage.read_bytes(str(tmp_path / "a" / "b")) == b"1"
    # listings keep the form of the listed path
    assert [i.path for i in storage.list(f"file://{tmp_path}/a")] == [f"file://{tmp_path}/a/b"]
    assert [i.path for i in storage.list(str(tmp_path / "a"))] == [str(tmp_path / "a" / "b")]


def test_relative_paths_are_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    storage = LocalStorage()
    storage.write_bytes("ckpt/x", b"1")
    assert [i.path for i in storage.list("ckpt")] == [str(tmp_path / "ckpt" / "x")]


@pytest.mark.parametrize("url", ["file://relative/path", "s3://bucket/x", ""])
def test_urls_local_storage_does_not_serve_are_refused(url: str) -> None:
    with pytest.raises(InvalidArgumentError):
        LocalStorage().read_bytes(url)


def test_writes_leave_no_temporary_files(tmp_path: Path) -> None:
    storage = LocalStorage()
    src = tmp_path / "src"
    src.write_bytes(b"s" * 100_000)
    storage.write_bytes(str(tmp_path / "d" / "a"), b"a")
    storage.create_exclusive(str(tmp_path / "d" / "b"), b"b")
    storage.put_file(str(src), str(tmp_path / "d" / "c"))
    assert sorted(os.listdir(tmp_path / "d")) == ["a", "b", "c"]


def test_a_failed_write_leaves_neither_a_temporary_nor_a_partial_file(tmp_path: Path) -> None:
    storage = LocalStorage()
    target = tmp_path / "d" / "taken"
    target.mkdir(parents=True)  # os.replace cannot put a file over a directory
    with pytest.raises(StorageError) as info:
        storage.write_bytes(str(target), b"data")
    assert str(target) in info.value.message
    assert os.listdir(tmp_path / "d") == ["taken"]
    assert target.is_dir()


def test_failed_exclusive_create_leaves_no_temporary(tmp_path: Path) -> None:
    storage = LocalStorage()
    storage.write_bytes(str(tmp_path / "m"), b"first")
    with pytest.raises(FileExistsError):
        storage.create_exclusive(str(tmp_path / "m"), b"second")
    assert os.listdir(tmp_path) == ["m"]


def test_leftovers_of_a_crashed_writer_are_hidden_from_listings(tmp_path: Path) -> None:
    storage = LocalStorage()
    storage.write_bytes(str(tmp_path / "real"), b"x")
    (tmp_path / f"{TEMP_PREFIX}real.0123456789ab").write_bytes(b"partial")
    assert [i.path for i in storage.list(str(tmp_path))] == [str(tmp_path / "real")]
    assert [i.path for i in storage.list(str(tmp_path), recursive=True)] == [str(tmp_path / "real")]


def test_delete_dir_refuses_the_file_system_root() -> None:
    with pytest.raises(InvalidArgumentError):
        LocalStorage().delete_dir("file:///")
    with pytest.raises(InvalidArgumentError):
        LocalStorage().delete_dir("/")


def test_size_of_a_directory_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    with pytest.raises(StorageError, match="is a directory"):
        LocalStorage().size(str(tmp_path / "d"))


def test_reading_a_directory_is_a_storage_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    with pytest.raises(StorageError) as info:
        LocalStorage().read_bytes(str(tmp_path / "d"))
    assert str(tmp_path / "d") in info.value.message


def test_get_file_of_a_directory_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "remote" / "dir").mkdir(parents=True)
    with pytest.raises(StorageError):
        LocalStorage().get_file(str(tmp_path / "remote" / "dir"), str(tmp_path / "local" / "x"))
    assert os.listdir(tmp_path / "local") == []


def test_writing_under_a_file_is_a_storage_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(StorageError):
        open_storage(str(tmp_path)).write_bytes(str(tmp_path / "file" / "child"), b"y")


def test_rename_no_replace_refuses_an_existing_target(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(b"new")
    try:
        rename_no_replace(str(src), str(dst))
    except OSError as exc:
        if exc.errno in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            pytest.skip(f"renameat2(RENAME_NOREPLACE) unsupported here: {exc}")
        raise
    assert dst.read_bytes() == b"new" and not src.exists()
    src.write_bytes(b"intruder")
    with pytest.raises(FileExistsError):
        rename_no_replace(str(src), str(dst))
    assert dst.read_bytes() == b"new"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores file permissions")
def test_permission_denied_names_the_path_and_the_fix(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(StorageError) as info:
            LocalStorage().write_bytes(str(locked / "f"), b"x")
        assert str(locked / "f") in info.value.message
        assert "permissions" in info.value.message
    finally:
        locked.chmod(0o700)
