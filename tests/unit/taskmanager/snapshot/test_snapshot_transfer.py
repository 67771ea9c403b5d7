"""upload_files / download_files against real local storage and a real moto S3 server."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from keyedstate.common.config import Configuration
from keyedstate.common.errors import CheckpointError, CorruptCheckpointError, InvalidArgumentError
from keyedstate.common.storage import LocalStorage, RetryPolicy, S3Storage, open_storage, s3fs_options
from keyedstate.taskmanager.snapshot import (
    DownloadFile,
    TransferCancelledError,
    TransferStats,
    UploadedFile,
    download_files,
    upload_files,
)
from tests.fixtures.s3 import boto3_client, make_flaky_s3_filesystem


def _make_files(directory: Path, count: int, size: int = 1000) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        p = directory / f"{i:06d}.sst"
        p.write_bytes(os.urandom(size + i))
        paths.append(p)
    return paths


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def storage() -> LocalStorage:
    return LocalStorage()


@pytest.fixture
def remote(tmp_path: Path) -> str:
    return f"file://{tmp_path}/remote"


# -- round trip -----------------------------------------------------------------------------------
def test_upload_records_size_and_sha256_in_input_order_and_download_verifies(
    storage: LocalStorage, remote: str, tmp_path: Path
) -> None:
    files = _make_files(tmp_path / "db", 7)
    stats = TransferStats()
    uploaded = upload_files(storage, [(str(p), f"{remote}/shared/{p.name}") for p in files], threads=3, stats=stats)
    assert uploaded == [
        UploadedFile(f"{remote}/shared/{p.name}", p.stat().st_size, _sha(p.read_bytes())) for p in files
    ]
    assert (stats.files_uploaded, stats.bytes_uploaded) == (7, sum(p.stat().st_size for p in files))

    wanted = [
        DownloadFile(u.remote_path, str(tmp_path / "restore" / Path(u.remote_path).name), u.size, u.sha256)
        for u in uploaded
    ]
    assert download_files(storage, wanted, threads=3, stats=stats) == sum(u.size for u in uploaded)
    for p in files:
        assert (tmp_path / "restore" / p.name).read_bytes() == p.read_bytes()
    assert (stats.files_downloaded, stats.bytes_downloaded) == (7, stats.bytes_uploaded)
    assert sorted(os.listdir(tmp_path / "restore")) == sorted(p.name for p in files)  # no temporaries


def test_plain_tuples_and_empty_lists_work(storage: LocalStorage, remote: str, tmp_path: Path) -> None:
    assert upload_files(storage, [], threads=2) == []
    assert download_files(storage, [], threads=2) == 0
    (src,) = _make_files(tmp_path / "db", 1)
    # A Path is fine too, although upload_files is annotated for str.
    (up,) = upload_files(storage, [(src, f"{remote}/x")], threads=1)  # type: ignore[list-item]
    assert (
        download_files(storage, [(up.remote_path, str(tmp_path / "x"), up.size, up.sha256.upper())], threads=1)
        == up.size
    )


def test_a_large_file_is_hashed_alongside_its_upload(storage: LocalStorage, remote: str, tmp_path: Path) -> None:
    big = tmp_path / "big.sst"
    big.write_bytes(os.urandom(9 * 1024 * 1024))  # above the size where hashing runs on a helper thread
    (up,) = upload_files(storage, [(str(big), f"{remote}/big.sst")], threads=2)
    assert (up.size, up.sha256) == (big.stat().st_size, _sha(big.read_bytes()))
    assert storage.read_bytes(up.remote_path) == big.read_bytes()


class _ModifiesSourceDuringUpload(LocalStorage):
    """Real local storage; a stray writer appends to the source while it is being uploaded."""

    def put_file(self, local_path: str, path: str) -> None:
        super().put_file(local_path, path)
        with open(local_path, "ab") as f:
            f.write(b"late write")


def test_a_source_modified_during_upload_fails_the_upload(remote: str, tmp_path: Path) -> None:
    (src,) = _make_files(tmp_path / "db", 1)
    with pytest.raises(CheckpointError, match="changed while it was uploaded"):
        upload_files(_ModifiesSourceDuringUpload(), [(str(src), f"{remote}/a.sst")], threads=1)


# -- damaged checkpoints ---------------------------------------------------------------------------
def _uploaded_one(storage: LocalStorage, remote: str, tmp_path: Path) -> UploadedFile:
    (src,) = _make_files(tmp_path / "db", 1, size=50_000)
    (up,) = upload_files(storage, [(str(src), f"{remote}/shared/000000.sst")], threads=1)
    return up


def test_a_flipped_byte_is_detected_and_names_the_file(storage: LocalStorage, remote: str, tmp_path: Path) -> None:
    up = _uploaded_one(storage, remote, tmp_path)
    stored = Path(up.remote_path.removeprefix("file://"))
    data = bytearray(stored.read_bytes())
    data[12_345] ^= 0x01
    stored.write_bytes(bytes(data))
    stats = TransferStats()
    target = tmp_path / "restore" / "000000.sst"
    with pytest.raises(CorruptCheckpointError) as info:
        download_files(storage, [(up.remote_path, str(target), up.size, up.sha256)], threads=2, stats=stats)
    assert up.remote_path in info.value.message and "sha256" in info.value.message
    assert not target.exists() and os.listdir(target.parent) == []
    assert stats.files_downloaded == 1  # the read happened; nothing was kept


def test_a_truncated_file_is_detected(storage: LocalStorage, remote: str, tmp_path: Path) -> None:
    up = _uploaded_one(storage, remote, tmp_path)
    stored = Path(up.remote_path.removeprefix("file://"))
    stored.write_bytes(stored.read_bytes()[:-100])
    target = tmp_path / "restore" / "000000.sst"
    with pytest.raises(CorruptCheckpointError) as info:
        download_files(storage, [(up.remote_path, str(target), up.size, up.sha256)], threads=1)
    assert up.remote_path in info.value.message and "truncated" in info.value.message
    assert not target.exists()


def test_a_missing_file_is_a_corrupt_checkpoint_naming_it(storage: LocalStorage, remote: str, tmp_path: Path) -> None:
    up = _uploaded_one(storage, remote, tmp_path)
    storage.delete(up.remote_path)
    with pytest.raises(CorruptCheckpointError) as info:
        download_files(storage, [(up.remote_path, str(tmp_path / "r" / "x"), up.size, up.sha256)], threads=1)
    assert up.remote_path in info.value.message and "missing" in info.value.message
    assert isinstance(info.value.__cause__, FileNotFoundError)


def test_download_keeps_an_existing_local_file_when_verification_fails(
    storage: LocalStorage, remote: str, tmp_path: Path
) -> None:
    up = _uploaded_one(storage, remote, tmp_path)
    target = tmp_path / "restore" / "000000.sst"
    target.parent.mkdir()
    target.write_bytes(b"previous")
    with pytest.raises(CorruptCheckpointError):
        download_files(storage, [(up.remote_path, str(target), up.size, "0" * 64)], threads=1)
    assert target.read_bytes() == b"previous"


# -- bad arguments and failures ------------------------------------------------------------------
def test_invalid_arguments_are_refused(storage: LocalStorage, remote: str, tmp_path: Path) -> None:
    (src,) = _make_files(tmp_path / "db", 1)
    with pytest.raises(InvalidArgumentError):
        upload_files(storage, [(str(src), f"{remote}/a")], threads=0)
    with pytest.raises(InvalidArgumentError):
        upload_files(storage, [(str(src), f"{remote}/a"), (str(src), f"{remote}/a")], threads=2)
    with pytest.raises(InvalidArgumentError):
        download_files(storage, [(f"{remote}/a", str(tmp_path / "x"), 1, "abc")], threads=1)
    with pytest.raises(InvalidArgumentError):
        download_files(storage, [(f"{remote}/a", str(tmp_path / "x"), 1, "0" * 64)] * 2, threads=1)


def test_a_failing_file_stops_the_files_not_yet_started(storage: LocalStorage, remote: str, tmp_path: Path) -> None:
    files = _make_files(tmp_path / "db", 4)
    pairs = [(str(p), f"{remote}/{p.name}") for p in files]
    pairs[1] = (str(tmp_path / "db" / "vanished.sst"), f"{remote}/vanished.sst")
    with pytest.raises(CheckpointError) as info:
        upload_files(storage, pairs, threads=1)  # one worker: files run in order
    assert "vanished.sst" in info.value.message and "does not exist" in info.value.message
    assert [i.path.rpartition("/")[2] for i in storage.list(remote)] == [files[0].name]


# -- cancellation -------------------------------------------------------------------------------------
def test_cancel_before_start_uploads_nothing(storage: LocalStorage, remote: str, tmp_path: Path) -> None:
    files = _make_files(tmp_path / "db", 5)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(TransferCancelledError) as info:
        upload_files(storage, [(str(p), f"{remote}/{p.name}") for p in files], threads=2, cancel=cancel)
    assert info.value.completed == []
    assert list(storage.list(remote)) == []


class _CancelAfterFirstUpload(LocalStorage):
    """Real local storage that aborts the checkpoint once its first file is stored."""

    def __init__(self, cancel: threading.Event) -> None:
        super().__init__()
        self.cancel = cancel

    def put_file(self, local_path: str, path: str) -> None:
        super().put_file(local_path, path)
        self.cancel.set()


def test_cancel_during_upload_stops_the_remaining_files(remote: str, tmp_path: Path) -> None:
    files = _make_files(tmp_path / "db", 6)
    cancel = threading.Event()
    storage = _CancelAfterFirstUpload(cancel)
    stats = TransferStats()
    with pytest.raises(TransferCancelledError) as info:
        upload_files(storage, [(str(p), f"{remote}/{p.name}") for p in files], threads=1, cancel=cancel, stats=stats)
    assert info.value.completed == [f"{remote}/{files[0].name}"]
    assert [i.path for i in storage.list(remote)] == info.value.completed
    assert stats.files_uploaded == 1


def test_cancel_stops_a_download(storage: LocalStorage, remote: str, tmp_path: Path) -> None:
    files = _make_files(tmp_path / "db", 3)
    ups = upload_files(storage, [(str(p), f"{remote}/{p.name}") for p in files], threads=2)
    cancel = threading.Event()
    cancel.set()
    stats = TransferStats()
    with pytest.raises(TransferCancelledError):
        download_files(
            storage,
            [(u.remote_path, str(tmp_path / "r" / str(i)), u.size, u.sha256) for i, u in enumerate(ups)],
            threads=2,
            cancel=cancel,
            stats=stats,
        )
    assert stats.files_downloaded == 0


# -- S3 ----------------------------------------------------------------------------------------------
# The storage package resolves S3Storage lazily (a module __getattr__), so mypy sees Any here.
class _ConcurrencyProbe(S3Storage):  # type: ignore[misc]
    """Real S3 storage that records how many uploads run at once.

    The first ``threads`` uploads wait for each other at a barrier, which proves that the
    transfer reaches its parallelism (the barrier times out otherwise).
    """

    def __init__(self, config: Configuration, threads: int) -> None:
        super().__init__(s3fs_options(config))
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.calls = 0
        self.barrier = threading.Barrier(threads)

    def put_file(self, local_path: str, path: str) -> None:
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.calls += 1
            wait = self.calls <= self.barrier.parties
        try:
            if wait:
                self.barrier.wait(timeout=20)
            super().put_file(local_path, path)
        finally:
            with self.lock:
                self.in_flight -= 1


@pytest.mark.s3
def test_fifty_small_files_upload_in_bounded_parallel_to_s3_and_come_back_verified(
    s3_bucket: tuple[str, str], s3_config: Configuration, tmp_path: Path
) -> None:
    endpoint, bucket = s3_bucket
    files = _make_files(tmp_path / "db", 50, size=2000)
    storage = _ConcurrencyProbe(s3_config, threads=4)
    stats = TransferStats()
    root = f"s3://{bucket}/job/shared"
    uploaded = upload_files(storage, [(str(p), f"{root}/{p.name}") for p in files], threads=4, stats=stats)
    assert storage.max_in_flight == 4
    assert stats.files_uploaded == 50
    listed = {i.path: i.size for i in storage.list(root)}
    assert listed == {u.remote_path: u.size for u in uploaded}
    body = boto3_client(endpoint).get_object(Bucket=bucket, Key=f"job/shared/{files[7].name}")["Body"].read()
    assert body == files[7].read_bytes()

    restored = download_files(
        storage,
        [(u.remote_path, str(tmp_path / "r" / f"{i}.sst"), u.size, u.sha256) for i, u in enumerate(uploaded)],
        threads=4,
        stats=stats,
    )
    assert restored == sum(p.stat().st_size for p in files)
    assert stats.files_downloaded == 50
    assert (tmp_path / "r" / "7.sst").read_bytes() == files[7].read_bytes()


@pytest.mark.s3
def test_transient_s3_errors_during_transfer_are_retried(
    s3_bucket: tuple[str, str], s3_config: Configuration, tmp_path: Path
) -> None:
    _, bucket = s3_bucket
    fs: Any = make_flaky_s3_filesystem(s3fs_options(s3_config), {"put_object": 2, "get_object": 1})
    waits: list[float] = []

    class _Waiter:
        def wait(self, timeout: float | None = None) -> bool:
            waits.append(timeout or 0.0)
            return False

    storage = S3Storage(fs=fs, retry=RetryPolicy(max_attempts=4, initial_backoff_s=0.01, jitter=0), waiter=_Waiter())
    (src,) = _make_files(tmp_path / "db", 1, size=300_000)
    (up,) = upload_files(storage, [(str(src), f"s3://{bucket}/f.sst")], threads=2)
    assert (
        download_files(storage, [(up.remote_path, str(tmp_path / "f.sst"), up.size, up.sha256)], threads=2) == up.size
    )
    assert (tmp_path / "f.sst").read_bytes() == src.read_bytes()
    assert fs.injected == ["put_object", "put_object", "get_object"] and len(waits) == 3


@pytest.mark.s3
def test_corrupt_object_in_s3_is_detected(s3_bucket: tuple[str, str], s3_config: Configuration, tmp_path: Path) -> None:
    endpoint, bucket = s3_bucket
    storage = open_storage(f"s3://{bucket}", s3_config)
    (src,) = _make_files(tmp_path / "db", 1, size=10_000)
    (up,) = upload_files(storage, [(str(src), f"s3://{bucket}/chk-3/a.sst")], threads=1)
    data = bytearray(src.read_bytes())
    data[0] ^= 0xFF
    boto3_client(endpoint).put_object(Bucket=bucket, Key="chk-3/a.sst", Body=bytes(data))
    with pytest.raises(CorruptCheckpointError, match=f"s3://{bucket}/chk-3/a.sst"):
        download_files(storage, [(up.remote_path, str(tmp_path / "a.sst"), up.size, up.sha256)], threads=1)
    assert not (tmp_path / "a.sst").exists()
