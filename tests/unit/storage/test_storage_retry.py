"""Retries of transient storage errors: backoff, bounds, interruption and the final error."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.local import LocalFileSystem

from keyedstate.common.errors import ConfigError, Reason, StorageError
from keyedstate.common.storage import LocalStorage, RetryPolicy
from keyedstate.common.storage._retry import is_transient_os_error

EXACT = RetryPolicy(max_attempts=3, initial_backoff_s=0.2, max_backoff_s=5.0, multiplier=2.0, jitter=0)


class RecordingWaiter:
    """Records each backoff and returns at once, as an Event that is never set would after the wait."""

    def __init__(self) -> None:
        self.waits: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        return False


class FlakyLocalFileSystem(LocalFileSystem):  # type: ignore[misc]  # fsspec publishes no types
    """A real local file system whose reads fail with ``error`` for the first ``failures`` calls."""

    cachable = False  # fsspec would otherwise hand out one shared instance per argument set

    def __init__(self, failures: int, error: OSError, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.failures = failures
        self.error = error
        self.calls = 0

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        data: bytes = super().cat_file(path, start=start, end=end, **kwargs)
        return data


def test_backoff_grows_exponentially_and_is_capped() -> None:
    policy = RetryPolicy(initial_backoff_s=0.5, max_backoff_s=3.0, multiplier=2.0, jitter=0)
    assert [policy.backoff_s(n) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_jitter_only_shortens_the_wait() -> None:
    policy = RetryPolicy(initial_backoff_s=1.0, max_backoff_s=10.0, jitter=0.5)
    waits = [policy.backoff_s(1) for _ in range(200)]
    assert all(0.5 <= w <= 1.0 for w in waits)
    assert len(set(waits)) > 1


@pytest.mark.parametrize(
    "kwargs", [{"max_attempts": 0}, {"initial_backoff_s": -1}, {"multiplier": 0.5}, {"jitter": 1.5}]
)
def test_invalid_policy_is_a_config_error(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        RetryPolicy(**kwargs)


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (OSError(errno.EBUSY, "SlowDown"), True),
        (OSError(errno.EREMOTEIO, "InternalError"), True),
        (OSError(errno.ENOTEMPTY, "Directory not empty"), True),
        (TimeoutError("read timed out"), True),
        (ConnectionResetError(), True),
        (FileNotFoundError(), False),
        (PermissionError(), False),
        (FileExistsError(), False),
        (OSError(errno.EINVAL, "bad request"), False),
        (ValueError("nope"), False),
    ],
)
def test_transient_classification(exc: BaseException, transient: bool) -> None:
    assert is_transient_os_error(exc) is transient


def test_transient_read_errors_are_retried_with_backoff(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"data")
    fs = FlakyLocalFileSystem(2, OSError(errno.EBUSY, "SlowDown"))
    waiter = RecordingWaiter()
    storage = LocalStorage(fs=fs, retry=EXACT, waiter=waiter)
    assert storage.read_bytes(str(tmp_path / "f")) == b"data"
    assert fs.calls == 3
    assert waiter.waits == [0.2, 0.4]


def test_exhausted_retries_raise_storage_error_naming_the_path_with_the_cause(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"data")
    cause = OSError(errno.EBUSY, "SlowDown")
    fs = FlakyLocalFileSystem(10, cause)
    waiter = RecordingWaiter()
    storage = LocalStorage(fs=fs, retry=EXACT, waiter=waiter)
    path = str(tmp_path / "f")
    with pytest.raises(StorageError) as info:
        storage.read_bytes(path)
    assert path in info.value.message
    assert "after 3 attempts" in info.value.message
    assert info.value.reason is Reason.STORAGE
    assert info.value.__cause__ is cause
    assert fs.calls == 3
    assert waiter.waits == [0.2, 0.4]


def test_permanent_errors_are_not_retried(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"data")
    fs = FlakyLocalFileSystem(1, PermissionError(errno.EACCES, "denied"))
    waiter = RecordingWaiter()
    storage = LocalStorage(fs=fs, retry=EXACT, waiter=waiter)
    with pytest.raises(StorageError) as info:
        storage.read_bytes(str(tmp_path / "f"))
    assert "permissions" in info.value.message
    assert fs.calls == 1
    assert waiter.waits == []


def test_a_set_waiter_interrupts_the_backoff(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"data")
    fs = FlakyLocalFileSystem(10, OSError(errno.EBUSY, "SlowDown"))
    shutdown = threading.Event()
    shutdown.set()
    storage = LocalStorage(fs=fs, retry=RetryPolicy(max_attempts=10, initial_backoff_s=60), waiter=shutdown)
    with pytest.raises(StorageError) as info:
        storage.read_bytes(str(tmp_path / "f"))
    assert info.value.reason is Reason.SHUTTING_DOWN
    assert fs.calls == 1


def test_a_delete_that_races_an_upload_is_walked_again(tmp_path: Path) -> None:
    # The late upload of an aborted checkpoint lands in the directory between the walk that
    # deleted its files and the rmdir of the directory: the kernel answers ENOTEMPTY.
    target = tmp_path / "chk-2" / "sessions-0"
    target.mkdir(parents=True)
    (target / "a.sst").write_bytes(b"x")
    real_rmdir = os.rmdir
    raced: list[str] = []

    def rmdir_racing_an_upload(path: Any, *args: Any, **kwargs: Any) -> None:
        if not raced and os.path.basename(str(path)) == target.name:
            raced.append(str(path))
            (target / "late.sst").write_bytes(b"late")
        real_rmdir(path, *args, **kwargs)

    waiter = RecordingWaiter()
    storage = LocalStorage(retry=EXACT, waiter=waiter)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "rmdir", rmdir_racing_an_upload)
        storage.delete_dir(str(tmp_path / "chk-2"))
    assert raced, "the race was not staged"
    assert not (tmp_path / "chk-2").exists()
    assert waiter.waits == [0.2]
