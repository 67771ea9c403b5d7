"""The transfer process: moves checkpoint files for its TaskManager, at low CPU priority.

Started by :class:`~keyedstate.taskmanager.snapshot.transfer_process.TransferProcessPool` as
``python -m keyedstate.taskmanager.snapshot.transfer_worker <fd> <role>``, where ``<fd>`` is its
end of a socket pair and ``<role>`` (checkpoint, restore) only shows what it is for in ``ps``. The first message is :class:`WorkerSettings`; then each upload or download
request runs on a thread of its own (``upload_files`` / ``download_files``, the same code as
in-process transfers, against this process's own storage clients) and its reply goes back on
the socket. Nothing here shares a GIL with serving.

The process lives exactly as long as its TaskManager: the main thread does nothing but read
the socket, and when the TaskManager is gone (stopped, crashed, ``kill -9``: the kernel closes
its end) the read ends and the process exits at once, in-flight transfers and all. This pipe
watch works whichever TaskManager thread started the process, unlike ``PR_SET_PDEATHSIG``,
which fires when the *thread* that forked exits.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from multiprocessing.connection import Connection

from keyedstate.common.child_process import connect_to_parent
from keyedstate.common.config import Configuration
from keyedstate.common.faults import crash_point
from keyedstate.common.storage import StorageCache
from keyedstate.taskmanager.snapshot.transfer import TransferStats, download_files, lower_priority, upload_files
from keyedstate.taskmanager.snapshot.transfer_protocol import (
    CancelRequest,
    DownloadRequest,
    Reply,
    Request,
    TransferDone,
    UploadRequest,
    WorkerSettings,
    failure,
)

logger = logging.getLogger(__name__)

MODULE = "keyedstate.taskmanager.snapshot.transfer_worker"
"""What a TaskManager runs (``python -m``) to start a transfer process."""


class _Server:
    """Runs the requests of one TaskManager; replies may go out in any order."""

    def __init__(self, conn: Connection, settings: WorkerSettings) -> None:
        self._conn = conn
        self._nice = settings.nice
        self._stop = threading.Event()
        self._storages = StorageCache(Configuration(settings.config), self._stop)
        self._cancels: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()

    def run(self) -> None:
        """Read requests until the TaskManager closes its end (or dies); then exit the process."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                # The TaskManager stopped or was killed: nobody waits for any reply any more, and
                # a checkpoint it did not acknowledge is cleaned up by the JobManager.
                self._stop.set()
                os._exit(0)
            if isinstance(message, CancelRequest):
                with self._lock:
                    cancel = self._cancels.get(message.request_id)
                if cancel is not None:
                    cancel.set()
                continue
            cancel = threading.Event()
            with self._lock:
                self._cancels[message.request_id] = cancel
            threading.Thread(
                target=self._execute, args=(message, cancel), name=f"transfer-{message.request_id}", daemon=True
            ).start()

    def _execute(self, request: Request, cancel: threading.Event) -> None:
        stats = TransferStats()
        reply: Reply
        try:
            crash_point("taskmanager.transfer.request")
            storage = self._storages.for_url(request.storage_url)
            if isinstance(request, UploadRequest):
                uploaded = upload_files(storage, request.files, request.threads, cancel, stats=stats, nice=self._nice)
                reply = TransferDone(request.request_id, tuple(uploaded), 0, stats.counts())
            else:
                assert isinstance(request, DownloadRequest)
                moved = download_files(storage, request.files, request.threads, cancel, stats=stats, nice=self._nice)
                reply = TransferDone(request.request_id, (), moved, stats.counts())
        except Exception as exc:  # every failure goes back to the TaskManager, which declines with it
            reply = failure(request.request_id, exc, stats.counts())
        finally:
            with self._lock:
                self._cancels.pop(request.request_id, None)
        try:
            with self._send_lock:
                self._conn.send(reply)
        except OSError:  # the TaskManager is gone; the main thread exits the process
            pass


def _preload_storage_clients() -> None:
    """Import the S3 client now, while the TaskManager starts, not during the first checkpoint."""
    try:
        importlib.import_module("keyedstate.common.storage._s3")
    except ImportError:  # s3fs not installed: only file:// and HDFS checkpoints here
        pass


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``transfer_worker <socket fd> [<role>]``."""
    link = connect_to_parent(
        sys.argv[1:] if argv is None else argv, MODULE, WorkerSettings, "transfer process", optional_args=("role",)
    )
    if isinstance(link, int):
        return link
    settings = link.first
    # Before any thread starts: on Linux every thread started later inherits the niceness.
    lower_priority(settings.nice)
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s transfer-process[{os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    _preload_storage_clients()
    _Server(link.conn, settings).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
