"""Parallel upload and download of checkpoint files, with sha256 digests and verification.

Uploads record each file's size and sha256 (hashed on a helper thread while a large file
uploads, so the digest costs little time), which go into the checkpoint metadata; downloads verify both before a file appears under its
local name, so a restore never opens a truncated or damaged file. Retries of transient errors
happen in the storage layer; a cancelled transfer (an aborted checkpoint) starts no new file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from keyedstate.common.errors import CheckpointError, CorruptCheckpointError, InvalidArgumentError
from keyedstate.common.storage import CheckpointStorage
from keyedstate.common.storage._fsspec import TEMP_PREFIX

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20
_OVERLAP_HASH_BYTES = 8 << 20
BACKGROUND_NICE = 10
"""Default niceness of the transfer and hashing threads: checkpoint transfers yield the CPU to serving."""


def lower_priority(nice: int) -> None:
    """Lower the calling thread's CPU priority to at least ``nice``; a no-op where not allowed.

    On Linux niceness is per thread, and threads started afterwards by this thread inherit it.
    Hashing releases the GIL, so a low-priority hashing thread never holds the serving threads
    back; it only gets less of a contended CPU. On an idle machine it costs nothing.
    """
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except (AttributeError, OSError):  # not Linux, or not permitted: run at normal priority
        pass


@dataclass(frozen=True)
class UploadedFile:
    remote_path: str
    size: int
    sha256: str
    """Lower-case hex digest of the uploaded bytes."""


class DownloadFile(NamedTuple):
    """One file to restore; a plain 4-tuple in this order works as well."""

    remote_path: str
    local_path: str
    size: int
    sha256: str


class TransferStats:
    """Thread-safe counters of files moved; downloads count every read from storage."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.files_uploaded = 0
        self.bytes_uploaded = 0
        self.files_downloaded = 0
        self.bytes_downloaded = 0

    def record_upload(self, size: int) -> None:
        """Count one uploaded file of ``size`` bytes (thread-safe)."""
        with self._lock:
            self.files_uploaded += 1
            self.bytes_uploaded += size

    def record_download(self, size: int) -> None:
        """Count one file of ``size`` bytes read from storage (thread-safe)."""
        with self._lock:
            self.files_downloaded += 1
            self.bytes_downloaded += size

    def add(self, counts: tuple[int, int, int, int]) -> None:
        """Add ``(files uploaded, bytes uploaded, files downloaded, bytes downloaded)`` (thread-safe)."""
        with self._lock:
            self.files_uploaded += counts[0]
            self.bytes_uploaded += counts[1]
            self.files_downloaded += counts[2]
            self.bytes_downloaded += counts[3]

    def counts(self) -> tuple[int, int, int, int]:
        """``(files uploaded, bytes uploaded, files downloaded, bytes downloaded)``, read together."""
        with self._lock:
            return (self.files_uploaded, self.bytes_uploaded, self.files_downloaded, self.bytes_downloaded)

    def __repr__(self) -> str:
        return (
            f"TransferStats(uploaded={self.files_uploaded} files/{self.bytes_uploaded} B, "
            f"downloaded={self.files_downloaded} files/{self.bytes_downloaded} B)"
        )


class TransferCancelledError(CheckpointError):
    """The transfer was cancelled (checkpoint aborted, slot released) before every file moved."""

    def __init__(self, message: str, *, completed: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.completed = list(completed)
        """Remote paths transferred before the cancellation (uploads: for the caller to clean up)."""


class _Skipped(Exception):
    """A queued file not started because the transfer was cancelled or another file failed."""


def upload_files(
    storage: CheckpointStorage,
    files: Sequence[tuple[str, str]],
    threads: int,
    cancel: threading.Event | None = None,
    *,
    stats: TransferStats | None = None,
    nice: int = BACKGROUND_NICE,
) -> list[UploadedFile]:
    """Upload ``(local_path, remote_path)`` pairs with at most ``threads`` in flight.

    Returns one :class:`UploadedFile` per pair, in input order. No partial object is ever
    visible under a remote name (the storage writes atomically). The first failure stops the
    files not yet started and is raised once the running ones finish; ``cancel`` does the
    same and raises :class:`TransferCancelledError`. The transfer threads run at niceness
    ``nice`` or above.
    """
    _check_threads("upload", threads)
    items = [(os.fspath(local), remote) for local, remote in files]
    _check_unique("remote path", (remote for _, remote in items))

    with ThreadPoolExecutor(
        max_workers=max(1, min(threads, len(items))),
        thread_name_prefix="ks-sha256",
        initializer=lower_priority,
        initargs=(nice,),
    ) as hashers:

        def upload(item: tuple[str, str]) -> UploadedFile:
            uploaded = _upload_one(storage, item[0], item[1], hashers)
            if stats is not None:
                stats.record_upload(uploaded.size)
            return uploaded

        return _run_parallel("upload", items, upload, threads, cancel, name=lambda item: item[1], nice=nice)


def download_files(
    storage: CheckpointStorage,
    files: Sequence[tuple[str, str, int, str]],
    threads: int,
    cancel: threading.Event | None = None,
    *,
    stats: TransferStats | None = None,
    nice: int = BACKGROUND_NICE,
) -> int:
    """Download ``(remote_path, local_path, expected_size, expected_sha256)`` entries; return bytes.

    Each file is verified before it is moved to its local name. A missing, truncated or
    damaged remote file raises :class:`CorruptCheckpointError` naming it; no unverified file
    is left behind locally.
    """
    _check_threads("download", threads)
    items = [
        DownloadFile(str(r), os.path.abspath(os.fspath(local)), int(s), str(h).lower()) for r, local, s, h in files
    ]
    _check_unique("local path", (item.local_path for item in items))
    for item in items:
        if item.size < 0 or not _SHA256_HEX.match(item.sha256):
            raise InvalidArgumentError(
                f"download of {item.remote_path}: expected a size >= 0 and a 64-digit hex sha256, "
                f"got {item.size} and {item.sha256!r}"
            )

    def download(item: DownloadFile) -> int:
        return _download_one(storage, item, stats)

    return sum(
        _run_parallel("download", items, download, threads, cancel, name=lambda item: item.remote_path, nice=nice)
    )


def sha256_file(path: str) -> tuple[int, str]:
    """``(size, hex sha256)`` of a local file, read in one pass."""
    with open(path, "rb") as f:
        digest = hashlib.sha256()
        size = 0
        while chunk := f.read(_CHUNK):
            digest.update(chunk)  # hashlib releases the GIL for large buffers
            size += len(chunk)
    return size, digest.hexdigest()


def _upload_one(storage: CheckpointStorage, local: str, remote: str, hashers: ThreadPoolExecutor) -> UploadedFile:
    try:
        before = os.stat(local)
        if before.st_size >= _OVERLAP_HASH_BYTES:
            # Hash on a helper thread while the storage reads the same file (from the page
            # cache) to upload it: the digest then costs almost no extra time.
            hashing = hashers.submit(sha256_file, local)
            try:
                storage.put_file(local, remote)
            finally:
                wait([hashing])
            size, digest = hashing.result()
        else:
            size, digest = sha256_file(local)
            storage.put_file(local, remote)
        after = os.stat(local)
    except FileNotFoundError as exc:
        if exc.filename not in (local, os.path.abspath(local)):
            raise
        raise CheckpointError(f"cannot upload {local} to {remote}: the local file does not exist") from exc
    except OSError as exc:  # the storage raises StorageError; an OSError comes from the local file
        raise CheckpointError(f"cannot upload {local} to {remote}: cannot read the local file: {exc}") from exc
    # Checkpoint files are immutable; a change while uploading would make the digest lie.
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns) or size != after.st_size:
        raise CheckpointError(
            f"{local} changed while it was uploaded to {remote}; checkpoint files must not be modified"
        )
    logger.debug("uploaded %s to %s (%d bytes, sha256 %s)", local, remote, size, digest)
    return UploadedFile(remote, size, digest)


def _download_one(storage: CheckpointStorage, item: DownloadFile, stats: TransferStats | None) -> int:
    remote, local, size, expected = item
    os.makedirs(os.path.dirname(local), exist_ok=True)
    head, name = os.path.split(local)
    tmp = os.path.join(head, f"{TEMP_PREFIX}{name}.{uuid.uuid4().hex[:12]}")
    try:
        try:
            storage.get_file(remote, tmp)
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(
                f"checkpoint file {remote} is missing; the checkpoint is incomplete or was deleted: "
                f"restore from another checkpoint"
            ) from exc
        actual_size, actual = sha256_file(tmp)
        if stats is not None:
            stats.record_download(actual_size)
        if actual_size != size:
            kind = "truncated" if actual_size < size else "longer than recorded"
            raise CorruptCheckpointError(
                f"checkpoint file {remote} is {kind}: {actual_size} bytes, the checkpoint recorded {size}; "
                f"restore from another checkpoint"
            )
        if actual != expected:
            raise CorruptCheckpointError(
                f"checkpoint file {remote} is damaged: sha256 {actual} does not match the recorded {expected}; "
                f"restore from another checkpoint"
            )
        os.replace(tmp, local)
    finally:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
    logger.debug("downloaded %s to %s (%d bytes, verified)", remote, local, size)
    return size


def _run_parallel(
    kind: str,
    items: Sequence[T],
    fn: Callable[[T], R],
    threads: int,
    cancel: threading.Event | None,
    *,
    name: Callable[[T], str],
    nice: int,
) -> list[R]:
    if not items:
        return []
    failed = threading.Event()

    def guarded(item: T) -> R:
        if failed.is_set() or (cancel is not None and cancel.is_set()):
            raise _Skipped()
        try:
            return fn(item)
        except BaseException:
            failed.set()  # here, not in the collecting loop, so the next queued file sees it
            raise

    results: dict[int, R] = {}
    errors: list[tuple[int, BaseException]] = []
    skipped = 0
    with ThreadPoolExecutor(
        max_workers=min(threads, len(items)),
        thread_name_prefix=f"ks-{kind}",
        initializer=lower_priority,
        initargs=(nice,),
    ) as pool:
        futures: dict[Future[R], int] = {pool.submit(guarded, item): i for i, item in enumerate(items)}
        for future in as_completed(futures):
            index = futures[future]
            try:
                results[index] = future.result()
            except _Skipped:
                skipped += 1
            except BaseException as exc:
                errors.append((index, exc))
    if errors:
        index, first = min(errors, key=lambda e: e[0])
        if len(errors) > 1:
            logger.warning("%s: %d files failed; raising the first (%s)", kind, len(errors), name(items[index]))
        raise first
    if skipped:
        completed = [name(items[i]) for i in sorted(results)]
        raise TransferCancelledError(
            f"{kind} cancelled after {len(completed)} of {len(items)} files", completed=completed
        )
    return [results[i] for i in range(len(items))]


def _check_threads(kind: str, threads: int) -> None:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise InvalidArgumentError(f"{kind}: threads must be a positive integer, got {threads!r}")


def _check_unique(what: str, values: Iterable[str]) -> None:
    seen: set[str] = set()
    for value in values:
        if value in seen:
            raise InvalidArgumentError(f"the same {what} {value!r} appears twice in one transfer")
        seen.add(value)
