"""Where checkpoint files are moved: the interface the snapshot manager uses, and the in-process mover.

The snapshot manager asks a :class:`FileMover` to upload a checkpoint's files or download a
restore's; it does not know where the bytes are moved. The TaskManager's assembly picks the
movers: by default a pool of low-priority transfer processes for checkpoints and one transfer
process at normal priority for restores
(:class:`~keyedstate.taskmanager.snapshot.transfer_process.TransferProcessPool`), or, with
``taskmanager.checkpoint.transfer.processes: 0``, :class:`InProcessMover`, which moves files on
threads of the TaskManager process itself.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

from keyedstate.common.storage import StorageCache
from keyedstate.taskmanager.snapshot.transfer import TransferStats, UploadedFile, download_files, upload_files


class FileMover(Protocol):
    """Moves checkpoint files between local disk and checkpoint storage, with the guarantees of
    :func:`~keyedstate.taskmanager.snapshot.transfer.upload_files` and ``download_files``.

    ``storage_url`` names the storage (any URL on it, say the checkpoint's target directory).
    Failures raise the same errors those functions raise; a cancelled transfer raises
    :class:`~keyedstate.taskmanager.snapshot.transfer.TransferCancelledError`.
    """

    def start(self) -> None:
        """Get ready to move files (start processes); called once, when the TaskManager starts."""

    def upload(
        self,
        storage_url: str,
        files: Sequence[tuple[str, str]],
        threads: int,
        cancel: threading.Event | None = None,
        stats: TransferStats | None = None,
    ) -> list[UploadedFile]:
        """Upload ``(local path, remote url)`` pairs; one :class:`UploadedFile` per pair, in order."""

    def download(
        self,
        storage_url: str,
        files: Sequence[tuple[str, str, int, str]],
        threads: int,
        cancel: threading.Event | None = None,
        stats: TransferStats | None = None,
    ) -> int:
        """Download and verify ``(remote url, local path, size, sha256)`` entries; the bytes moved."""

    def close(self) -> None:
        """Stop moving files (the TaskManager stops); transfers still running fail."""


class InProcessMover:
    """Moves files on low-priority threads of this process (``taskmanager.checkpoint.transfer.processes: 0``)."""

    def __init__(self, storages: StorageCache, nice: int) -> None:
        self._storages = storages
        self._nice = nice

    def start(self) -> None:
        """Nothing to start: the transfers run on the callers' threads."""

    def upload(
        self,
        storage_url: str,
        files: Sequence[tuple[str, str]],
        threads: int,
        cancel: threading.Event | None = None,
        stats: TransferStats | None = None,
    ) -> list[UploadedFile]:
        """See :meth:`FileMover.upload`."""
        storage = self._storages.for_url(storage_url)
        return upload_files(storage, files, threads, cancel, stats=stats, nice=self._nice)

    def download(
        self,
        storage_url: str,
        files: Sequence[tuple[str, str, int, str]],
        threads: int,
        cancel: threading.Event | None = None,
        stats: TransferStats | None = None,
    ) -> int:
        """See :meth:`FileMover.download`."""
        storage = self._storages.for_url(storage_url)
        return download_files(storage, files, threads, cancel, stats=stats, nice=self._nice)

    def close(self) -> None:
        """Nothing to stop: the transfers run on the callers' threads."""
