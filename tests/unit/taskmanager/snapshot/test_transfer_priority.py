"""Checkpoint transfers run on low-priority threads, so they yield a contended CPU to serving.

Observed through a real LocalStorage whose put/get also record the niceness of the thread that
calls them; the calling (serving) thread keeps its own priority.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from keyedstate.common.storage import LocalStorage
from keyedstate.taskmanager.snapshot import download_files, upload_files

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux behaviour")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


class RecordingStorage(LocalStorage):
    """The real local storage; every transfer notes the niceness of the thread doing it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def put_file(self, local_path: str, path: str) -> None:
        self.seen.append(_nice())
        super().put_file(local_path, path)

    def get_file(self, path: str, local_path: str) -> None:
        self.seen.append(_nice())
        super().get_file(path, local_path)


def test_uploads_and_downloads_run_below_the_callers_priority(tmp_path: Path) -> None:
    storage = RecordingStorage()
    files = []
    for i in range(6):
        p = tmp_path / "src" / f"{i}.sst"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(os.urandom(1000 + i))
        files.append((str(p), (tmp_path / "remote" / p.name).as_uri()))
    caller = _nice()
    uploaded = upload_files(storage, files, threads=3)
    assert len(storage.seen) == 6 and all(n >= 10 for n in storage.seen), storage.seen
    storage.seen.clear()
    got = download_files(
        storage,
        [(u.remote_path, str(tmp_path / "back" / f"{i}.sst"), u.size, u.sha256) for i, u in enumerate(uploaded)],
        threads=3,
    )
    assert got == sum(u.size for u in uploaded)
    assert len(storage.seen) == 6 and all(n >= 10 for n in storage.seen), storage.seen
    assert _nice() == caller, "the calling thread keeps its priority"
