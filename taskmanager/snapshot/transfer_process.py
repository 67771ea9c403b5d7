"""Checkpoint transfers in separate low-priority processes: the TaskManager's side.

Uploading a checkpoint in the serving process costs serving: s3fs's event loop, the request
signing and the sha256 of every file all need the GIL that serving needs (py-spy, issue 13:
0.44x serving during a 1 GB upload). A :class:`TransferProcessPool` runs
``taskmanager.checkpoint.transfer.processes`` transfer processes
(:mod:`~keyedstate.taskmanager.snapshot.transfer_worker`) at niceness
``taskmanager.checkpoint.transfer.nice``; each builds its own storage clients from the
TaskManager's configuration and moves files with the same ``upload_files``/``download_files``.
A transfer process stays in the TaskManager's session and cgroup: the scheduler weighs niceness
only against threads of the same autogroup (``kernel.sched_autogroup_enabled``) or cgroup, so
that is where a niced process yields to the serving threads (in a session of its own it would
get a full session's share of the CPU, niced or not).

What stays true:

* A checkpoint acknowledges only after its transfer process replied that every file is stored
  (the reply carries each file's size and sha256, as before).
* A transfer process that dies (killed, out of memory) fails every request it was running with
  :class:`TransferProcessLostError`, so the checkpoint is declined, never left waiting; the next
  request starts a new process.
* A cancelled request (an aborted checkpoint) starts no new file; a process that does not
  answer the cancel within ``cancel_grace_ms`` is killed, so nothing it runs outlives the abort.
* A transfer process exits as soon as its TaskManager's end of the socket closes, which the
  kernel does when the TaskManager dies in any way, so none is left behind (see the worker).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from keyedstate.common.child_process import ChildProcess
from keyedstate.common.clock import Clock
from keyedstate.common.config import Configuration
from keyedstate.common.errors import CheckpointError
from keyedstate.common.exit_status import describe_exit
from keyedstate.taskmanager.snapshot.transfer import TransferStats, UploadedFile
from keyedstate.taskmanager.snapshot.transfer_protocol import (
    CancelRequest,
    DownloadRequest,
    Reply,
    Request,
    TransferDone,
    TransferFailed,
    UploadRequest,
    WorkerSettings,
    rebuild_error,
)
from keyedstate.taskmanager.snapshot.transfer_worker import MODULE

logger = logging.getLogger(__name__)

_POLL_S = 0.1
"""How often a waiting transfer looks at its cancel event."""
_EXIT_WAIT_S = 10.0


class TransferProcessLostError(CheckpointError):
    """The transfer process running a request died (or was killed) before it replied."""


class _TransferProcess:
    """One transfer process, the socket to it, and the requests it runs."""

    def __init__(self, index: int, settings: WorkerSettings, ids: Callable[[], int], role: str) -> None:
        self.index = index
        self._ids = ids
        self._child = ChildProcess(MODULE, (role,))
        self.pid = self._child.pid
        # Lowered from here at once, not only by the process itself once it has read its settings:
        # its interpreter start and imports then run niced too (threads inherit the main thread's).
        try:
            os.setpriority(os.PRIO_PROCESS, self.pid, max(os.getpriority(os.PRIO_PROCESS, self.pid), settings.nice))
        except OSError:  # not permitted here: the process lowers its own priority
            pass
        self._conn = self._child.conn
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._pending: dict[int, Future[Reply]] = {}
        self._lost: str | None = None
        self._closing = False
        self._send(settings)  # a process that died at once fails its first request through the reader
        self._reader = threading.Thread(target=self._read, name=f"{role}-transfer-process-{index}", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        with self._lock:
            return self._lost is None

    def load(self) -> int:
        with self._lock:
            return len(self._pending)

    def submit(self, make: Callable[[int], Request]) -> tuple[int, Future[Reply]]:
        """Send the request ``make(request_id)``; its reply (or the process's death) completes the future."""
        future: Future[Reply] = Future()
        request_id = self._ids()
        with self._lock:
            if self._lost is not None:
                raise TransferProcessLostError(self._lost)
            self._pending[request_id] = future
        self._send(make(request_id))
        return request_id, future

    def cancel(self, request_id: int) -> None:
        self._send(CancelRequest(request_id))

    def kill(self, why: str) -> None:
        """SIGKILL the process; the reader then fails what it was running."""
        logger.warning("killing checkpoint transfer process %d: %s", self.pid, why)
        self._child.kill()

    def stop(self) -> None:
        """Close our end, SIGKILL the process, reap it and release the socket; requests still running fail.

        Killing loses nothing: on end-of-file the process exits at once, abandoning its transfers
        the same way. Waiting for it would only wait for a process still starting (a niced
        interpreter importing its storage clients on a loaded host takes seconds), which reads the
        hang-up after its imports.
        """
        with self._lock:
            self._closing = True
        self._child.hang_up()
        self._child.kill()
        self._child.wait_exit(_EXIT_WAIT_S)
        self._reader.join(_EXIT_WAIT_S)
        self._child.close_socket()

    def _send(self, message: object) -> None:
        with self._lock:
            if self._closing:
                return  # the reader fails every pending request once the process exits
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError):
            # The process is gone (or going): the reader fails the request with the cause.
            logger.debug("transfer process %d: could not send %s", self.pid, type(message).__name__)

    def _read(self) -> None:
        while True:
            try:
                reply: Reply = self._conn.recv()
            except (EOFError, OSError, ValueError):
                break
            with self._lock:
                future = self._pending.pop(reply.request_id, None)
            if future is not None:
                future.set_result(reply)
        if not self._child.wait_exit(_EXIT_WAIT_S):  # it closed its socket but lived on: not ours to keep
            logger.warning("killed checkpoint transfer process %d: it closed its socket but did not exit", self.pid)
        code = self._child.exit_code()
        with self._lock:
            closing = self._closing
            self._lost = (
                f"the checkpoint transfer process (pid {self.pid}) {describe_exit(code)}"
                + (" because the TaskManager is stopping" if closing else "")
                + " before it finished moving the checkpoint's files; the checkpoint is declined and "
                "the next transfer starts a new process"
            )
            pending, self._pending = self._pending, {}
        if pending or not closing:
            logger.warning("%s (%d transfers failed)", self._lost, len(pending))
        for future in pending.values():
            future.set_exception(TransferProcessLostError(self._lost))


class TransferProcessPool:
    """A fixed number of transfer processes; each request goes to the least busy one (a FileMover).

    Created and started by the TaskManager's assembly; :meth:`close` stops every process.
    """

    def __init__(
        self,
        conf: Configuration,
        processes: int,
        nice: int,
        clock: Clock,
        *,
        role: str = "checkpoint",
        cancel_grace_ms: int = 10_000,
    ) -> None:
        """``role`` names the processes' work on their command line (``ps``): checkpoint, restore."""
        if processes < 1:
            raise CheckpointError(f"a transfer process pool needs at least one process, got {processes}")
        self._settings = WorkerSettings(conf.to_dict(), nice)
        self._clock = clock
        self._cancel_grace_ms = cancel_grace_ms
        self._role = role
        self._counter = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False
        self._processes: list[_TransferProcess | None] = [None] * processes

    def start(self) -> None:
        """Start every transfer process (they load their storage clients while the TaskManager starts)."""
        for i in range(len(self._processes)):
            self._process(i)

    def pids(self) -> list[int]:
        """The process ids of the live transfer processes."""
        with self._lock:
            return [p.pid for p in self._processes if p is not None and p.alive]

    def upload(
        self,
        storage_url: str,
        files: Sequence[tuple[str, str]],
        threads: int,
        cancel: threading.Event | None = None,
        stats: TransferStats | None = None,
    ) -> list[UploadedFile]:
        """See :meth:`~keyedstate.taskmanager.snapshot.mover.FileMover.upload`."""
        pairs = tuple((str(local), str(remote)) for local, remote in files)
        reply = self._run(lambda rid: UploadRequest(rid, storage_url, pairs, threads), cancel, stats)
        return list(reply.uploaded)

    def download(
        self,
        storage_url: str,
        files: Sequence[tuple[str, str, int, str]],
        threads: int,
        cancel: threading.Event | None = None,
        stats: TransferStats | None = None,
    ) -> int:
        """See :meth:`~keyedstate.taskmanager.snapshot.mover.FileMover.download`."""
        items = tuple((str(r), str(local), int(s), str(h)) for r, local, s, h in files)
        reply = self._run(lambda rid: DownloadRequest(rid, storage_url, items, threads), cancel, stats)
        return reply.downloaded_bytes

    def close(self) -> None:
        """Stop every transfer process; transfers still running fail (the TaskManager stops).

        Each is killed, not waited for: see :meth:`_TransferProcess.stop`.
        """
        with self._lock:
            self._closed = True
            processes, self._processes = [p for p in self._processes if p is not None], []
        for process in processes:
            process.stop()

    def _run(
        self, make: Callable[[int], Request], cancel: threading.Event | None, stats: TransferStats | None
    ) -> TransferDone:
        process = self._least_busy()
        request_id, future = process.submit(make)
        cancel_sent_ms: int | None = None
        while True:
            if cancel is not None and cancel.is_set():
                cancel_sent_ms = self._forward_cancel(process, request_id, cancel_sent_ms)
            try:
                reply = future.result(timeout=_POLL_S)
                break
            except FutureTimeout:
                pass
        if stats is not None:
            stats.add(reply.counts)
        if isinstance(reply, TransferFailed):
            raise rebuild_error(reply)
        return reply

    def _forward_cancel(self, process: _TransferProcess, request_id: int, sent_ms: int | None) -> int:
        """Tell the process to stop the request; kill it if it is still running after the grace time."""
        now = self._clock.monotonic_ms()
        if sent_ms is None:
            process.cancel(request_id)
            return now
        if now - sent_ms > self._cancel_grace_ms:
            # A file stuck in storage (a hung connection) would keep the aborted checkpoint's
            # transfer alive; the process goes, and the reader fails the request once it is gone.
            process.kill(f"transfer {request_id} was cancelled {self._cancel_grace_ms} ms ago and is still running")
            return now
        return sent_ms

    def _least_busy(self) -> _TransferProcess:
        with self._lock:
            count = len(self._processes)
        if count == 0:
            raise CheckpointError("the TaskManager is stopping: its checkpoint transfer processes are stopped")
        processes = [self._process(i) for i in range(count)]
        return min(processes, key=lambda p: p.load())

    def _process(self, index: int) -> _TransferProcess:
        """The live process in position ``index``, started (again) if it is not running."""
        with self._lock:
            if self._closed:
                raise CheckpointError("the TaskManager is stopping: its checkpoint transfer processes are stopped")
            current = self._processes[index]
            if current is not None and current.alive:
                return current
            try:
                started = _TransferProcess(index, self._settings, lambda: next(self._counter), self._role)
            except OSError as exc:
                raise CheckpointError(f"cannot start a checkpoint transfer process: {exc}") from exc
            self._processes[index] = started
        if current is not None:
            logger.warning("%s transfer process %d replaced by %d", self._role, current.pid, started.pid)
        else:
            logger.info("%s transfer process %d started (nice %d)", self._role, started.pid, self._settings.nice)
        return started
