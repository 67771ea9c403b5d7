"""TransferProcessPool: checkpoint files moved by real low-priority transfer processes.

Real processes, real local storage (file://) and, where a transfer must be caught in the middle,
a named pipe among the files: hashing it blocks in open() until something writes to it, so the
transfer process is stuck mid-upload for as long as the test wants, with no timing involved.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from keyedstate.common.clock import SYSTEM_CLOCK
from keyedstate.common.config import Configuration
from keyedstate.common.errors import CheckpointError, CorruptCheckpointError
from keyedstate.taskmanager.snapshot import TransferCancelledError, TransferStats, sha256_file
from keyedstate.taskmanager.snapshot.transfer_process import TransferProcessLostError, TransferProcessPool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transfer processes: Linux behaviour")

NICE = 7


@pytest.fixture
def pool() -> Iterator[TransferProcessPool]:
    p = TransferProcessPool(Configuration(), 1, NICE, SYSTEM_CLOCK, cancel_grace_ms=500)
    p.start()
    try:
        yield p
    finally:
        p.close()


def _files(root: Path, count: int, size: int = 1000) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(count):
        path = root / f"{i:06d}.sst"
        path.write_bytes(os.urandom(size + i % 7))
        files.append(path)
    return files


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie is gone too
    except FileNotFoundError:
        return True


def _wait(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _thread_nices(pid: int) -> dict[int, int]:
    return {int(t): os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def _stuck_upload(pool: TransferProcessPool, tmp_path: Path, **kw: object) -> tuple[threading.Thread, list[object]]:
    """Start an upload whose second file is a named pipe: the transfer process blocks hashing it."""
    (first,) = _files(tmp_path / "src", 1)
    fifo = tmp_path / "src" / "000001.sst"
    os.mkfifo(fifo)
    remote = (tmp_path / "remote").as_uri()
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(pool.upload(remote, [(str(first), f"{remote}/a"), (str(fifo), f"{remote}/b")], 1, **kw))  # type: ignore[arg-type]
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    _wait(lambda: (tmp_path / "remote" / "a").exists(), "the first file to arrive")
    return thread, outcome


def test_files_make_the_round_trip_through_the_transfer_process(pool: TransferProcessPool, tmp_path: Path) -> None:
    files = _files(tmp_path / "src", 20)
    remote = (tmp_path / "remote").as_uri()
    stats = TransferStats()
    uploaded = pool.upload(remote, [(str(p), f"{remote}/shared/{p.name}") for p in files], 3, stats=stats)
    assert [u.remote_path for u in uploaded] == [f"{remote}/shared/{p.name}" for p in files]
    for path, up in zip(files, uploaded):
        assert (up.size, up.sha256) == sha256_file(str(path))
    assert stats.counts()[:2] == (20, sum(p.stat().st_size for p in files))

    wanted = [(u.remote_path, str(tmp_path / "back" / f"{i}.sst"), u.size, u.sha256) for i, u in enumerate(uploaded)]
    assert pool.download(remote, wanted, 3, stats=stats) == sum(u.size for u in uploaded)
    for path, (_, local, _, _) in zip(files, wanted):
        assert Path(local).read_bytes() == path.read_bytes()
    assert stats.counts()[2] == 20


def test_errors_cross_the_process_boundary_with_their_type_and_message(
    pool: TransferProcessPool, tmp_path: Path
) -> None:
    remote = (tmp_path / "remote").as_uri()
    (src,) = _files(tmp_path / "src", 1)
    (up,) = pool.upload(remote, [(str(src), f"{remote}/a.sst")], 1)
    with pytest.raises(CorruptCheckpointError, match="a.sst is damaged: sha256"):
        pool.download(remote, [(up.remote_path, str(tmp_path / "x"), up.size, "0" * 64)], 1)
    with pytest.raises(CheckpointError, match=r"missing\.sst .*does not exist"):
        pool.upload(remote, [(str(tmp_path / "missing.sst"), f"{remote}/m.sst")], 1)
    assert not (tmp_path / "x").exists()


def test_the_transfer_process_and_all_its_threads_run_at_the_configured_niceness(
    pool: TransferProcessPool, tmp_path: Path
) -> None:
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    (pid,) = pool.pids()
    assert pid != os.getpid()
    thread, _ = _stuck_upload(pool, tmp_path)  # the transfer and hashing threads exist now
    nices = _thread_nices(pid)
    assert len(nices) >= 3, nices  # main thread, the request's thread, a transfer thread
    assert all(n >= NICE for n in nices.values()), nices
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller, "the caller keeps its priority"
    os.kill(pid, signal.SIGKILL)
    thread.join(20)


def test_a_killed_transfer_process_fails_its_transfer_and_the_next_one_gets_a_new_process(
    pool: TransferProcessPool, tmp_path: Path
) -> None:
    (pid,) = pool.pids()
    thread, outcome = _stuck_upload(pool, tmp_path)
    os.kill(pid, signal.SIGKILL)
    thread.join(20)
    assert not thread.is_alive(), "the upload must not wait for a dead process"
    (error,) = outcome
    assert isinstance(error, TransferProcessLostError), error
    assert f"pid {pid}" in error.message and "SIGKILL" in error.message and "declined" in error.message
    _wait(lambda: _gone(pid), "the killed process to be reaped")

    files = _files(tmp_path / "again", 3)
    remote = (tmp_path / "remote2").as_uri()
    assert len(pool.upload(remote, [(str(p), f"{remote}/{p.name}") for p in files], 2)) == 3
    (new_pid,) = pool.pids()
    assert new_pid != pid


def test_a_cancel_stops_a_transfer_before_every_file_moved(pool: TransferProcessPool, tmp_path: Path) -> None:
    # Enough work that the cancel, sent with the request, arrives long before the last file: with
    # 1,500 files of 100 bytes a niced process on a loaded machine once moved them all first.
    files = _files(tmp_path / "src", 4000, size=4096)
    remote_dir = tmp_path / "remote"
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(TransferCancelledError) as caught:
        pool.upload(remote_dir.as_uri(), [(str(p), f"{remote_dir.as_uri()}/{p.name}") for p in files], 1, cancel)
    completed = caught.value.completed
    assert len(completed) < len(files)
    arrived = sorted(p.name for p in remote_dir.glob("*.sst")) if remote_dir.exists() else []
    assert arrived == sorted(c.rsplit("/", 1)[1] for c in completed)


def test_a_cancelled_transfer_stuck_in_storage_is_killed_after_the_grace_time(
    pool: TransferProcessPool, tmp_path: Path
) -> None:
    (pid,) = pool.pids()
    cancel = threading.Event()
    thread, outcome = _stuck_upload(pool, tmp_path, cancel=cancel)
    t0 = time.monotonic()
    cancel.set()
    thread.join(20)
    assert not thread.is_alive()
    (error,) = outcome
    assert isinstance(error, TransferProcessLostError) and "SIGKILL" in error.message, error
    assert time.monotonic() - t0 >= 0.5, "the process had its grace time to answer the cancel"
    _wait(lambda: _gone(pid), "the stuck process to be reaped")


def test_close_stops_every_transfer_process(tmp_path: Path) -> None:
    pool = TransferProcessPool(Configuration(), 2, NICE, SYSTEM_CLOCK)
    pool.start()
    pids = pool.pids()
    assert len(pids) == 2
    pool.close()
    assert all(_gone(pid) for pid in pids)
    with pytest.raises(CheckpointError, match="stopping"):
        pool.upload((tmp_path / "r").as_uri(), [], 1)


def test_close_stops_a_transfer_process_that_never_reads_its_hang_up() -> None:
    # A stopped (SIGSTOP) process stands for one that is still starting on a loaded host: it
    # reads nothing, so the hang-up alone would never end it, and close() must not wait for it.
    pool = TransferProcessPool(Configuration(), 1, NICE, SYSTEM_CLOCK)
    pool.start()
    [pid] = pool.pids()
    os.kill(pid, signal.SIGSTOP)
    try:
        pool.close()
        assert _gone(pid)
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


_OWNER = """
import os, sys, threading, time
from keyedstate.common.clock import SYSTEM_CLOCK
from keyedstate.common.config import Configuration
from keyedstate.taskmanager.snapshot.transfer_process import TransferProcessPool

root = sys.argv[1]
os.mkfifo(f"{root}/stuck.sst")
pool = TransferProcessPool(Configuration(), 1, 5, SYSTEM_CLOCK)
pool.start()
remote = "file://" + root + "/remote"
threading.Thread(target=pool.upload, args=(remote, [(f"{root}/stuck.sst", remote + "/x")], 1), daemon=True).start()
print(pool.pids()[0], flush=True)
time.sleep(600)
"""


def test_a_transfer_process_does_not_outlive_its_owner_killed_mid_upload(tmp_path: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        pid = int(owner.stdout.readline())
        # Mid-upload: the transfer process has a request thread blocked hashing the named pipe.
        _wait(lambda: len(os.listdir(f"/proc/{pid}/task")) >= 3, "the upload to start in the transfer process")
        assert not _gone(pid)
        owner.kill()  # SIGKILL: no clean-up code of the owner runs
        owner.wait(10)
        _wait(lambda: _gone(pid), "the transfer process to exit after its owner died", timeout_s=10)
    finally:
        owner.kill()
        owner.wait(10)
