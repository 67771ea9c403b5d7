"""The generic part of every storage: URL handling, retries, error mapping, reads and listings.

Reads, listings and deletes are the same over any fsspec file system. What differs is how a
write becomes visible atomically, so :class:`FsspecStorage` leaves ``_write``,
``_create_exclusive`` and ``_upload`` to one subclass per file system (local, S3, HDFS).
"""

from __future__ import annotations

import abc
import errno
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from fsspec import AbstractFileSystem

from keyedstate.common.errors import InvalidArgumentError, KeyedStateError, StorageError
from keyedstate.common.retry import RetryPolicy, Waiter, call_with_retries
from keyedstate.common.storage._base import FileInfo
from keyedstate.common.storage._retry import is_transient_os_error, storage_interrupted

logger = logging.getLogger(__name__)

T = TypeVar("T")

TEMP_PREFIX = ".ks-tmp-"
"""Names of in-progress temporary files start with this; listings hide them."""


def join_url(base: str, *parts: str) -> str:
    """Join URL path segments with ``/``, refusing ``..``/``.`` segments and empty parts."""
    if not base:
        raise InvalidArgumentError(
            "cannot join onto an empty base path; pass an absolute URL such as s3://bucket/checkpoints"
        )
    cleaned: list[str] = []
    for part in parts:
        segments = [s for s in part.split("/") if s]
        if not segments or any(s in (".", "..") for s in segments):
            raise InvalidArgumentError(
                f"invalid path part {part!r} to join onto {base!r}: parts must be non-empty and must not contain '.' or '..'"
            )
        cleaned.append("/".join(segments))
    if not cleaned:
        return base
    head = base if base.endswith("/") else base + "/"
    return head + "/".join(cleaned)


def temp_sibling(path: str) -> str:
    """A unique temporary name next to ``path`` (same directory, so a rename stays local)."""
    head, _, name = path.rpartition("/")
    return f"{head}/{TEMP_PREFIX}{name}.{uuid.uuid4().hex[:12]}"


class FsspecStorage(abc.ABC):
    """A :class:`~keyedstate.common.storage.CheckpointStorage` over one fsspec file system.

    Every call retries transient errors (throttling, 5xx, connection trouble) per the
    :class:`RetryPolicy`, waiting on ``waiter`` so that a shutdown interrupts a backoff.
    Missing files raise ``FileNotFoundError`` naming the URL; anything else that fails is a
    :class:`StorageError` naming the URL, with the original error as ``__cause__``.
    """

    def __init__(self, *, retry: RetryPolicy | None = None, waiter: Waiter | None = None) -> None:
        self._retry = retry or RetryPolicy()
        self._waiter: Waiter = waiter if waiter is not None else threading.Event()

    # -- what a subclass provides ----------------------------------------------------------
    @property
    @abc.abstractmethod
    def fs(self) -> AbstractFileSystem:
        """The underlying fsspec file system."""

    @abc.abstractmethod
    def _split(self, url: str) -> tuple[str, str]:
        """``(prefix, fs_path)`` with ``prefix + fs_path`` naming the same file as ``url``.

        Raises InvalidArgumentError for a URL this storage does not serve.
        """

    @abc.abstractmethod
    def _write(self, fs_path: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def _create_exclusive(self, fs_path: str, data: bytes) -> None:
        """Write ``data`` only if nothing exists at ``fs_path``; else raise FileExistsError."""

    @abc.abstractmethod
    def _upload(self, local_path: str, fs_path: str) -> None: ...

    def _is_transient(self, exc: BaseException) -> bool:
        return is_transient_os_error(exc)

    def _hint(self, exc: BaseException) -> str:
        """What the operator can do about a failure that retries did not fix."""
        if isinstance(exc, PermissionError):
            return "check that this process may read and write the checkpoint directory"
        return "check that the storage is reachable and healthy; the operation can be retried"

    def _missing_parent_message(self, url: str) -> str:
        return f"cannot write {url}: its parent location does not exist and could not be created"

    # -- the protocol ------------------------------------------------------------------------
    def join(self, base: str, *parts: str) -> str:
        """``base`` + ``/`` + parts, without I/O; InvalidArgumentError for empty parts or ``.``/``..`` segments."""
        return join_url(base, *parts)

    def exists(self, path: str) -> bool:
        """True if a file or directory is at ``path``.

        Unlike fsspec's ``exists``, a network or permission failure raises StorageError instead of
        answering False: a storage outage must not look like a missing checkpoint.
        """
        _, p = self._split(path)

        def probe() -> bool:
            # fsspec's generic exists() answers False on *any* error; a network failure must
            # not look like a missing file, so ask info() and treat only "not found" as False.
            try:
                self.fs.info(p)
            except FileNotFoundError:
                return False
            return True

        return self._call("exists", path, probe)

    def read_bytes(self, path: str) -> bytes:
        """The whole object in memory; FileNotFoundError if missing (:meth:`get_file` for large files)."""
        _, p = self._split(path)
        return bytes(self._call("read", path, lambda: self.fs.cat_file(p)))

    def size(self, path: str) -> int:
        """Bytes of the file at ``path``; FileNotFoundError if missing, StorageError for a directory."""
        _, p = self._split(path)
        info = self._call("stat", path, lambda: self.fs.info(p))
        if info.get("type") != "file":
            raise StorageError(f"{path} is a directory, not a file; pass the path of a file")
        return int(info["size"])

    def write_bytes(self, path: str, data: bytes) -> None:
        """Create or replace the object atomically (readers never see it half-written); parents are created."""
        _, p = self._split(path)
        self._call_write("write", path, lambda: self._write(p, bytes(data)))

    def create_exclusive(self, path: str, data: bytes) -> None:
        """Write ``data`` only if nothing is at ``path``, else raise FileExistsError.

        Safe to retry: when an attempt's answer was lost, finding our own identical bytes at ``path``
        counts as success, not as FileExistsError.
        """
        _, p = self._split(path)
        payload = bytes(data)
        tried = False

        def attempt() -> None:
            nonlocal tried
            if tried:
                # The previous attempt failed transiently, possibly after the object was
                # stored (the answer got lost). Our own bytes already there mean success.
                try:
                    if bytes(self.fs.cat_file(p)) == payload:
                        return
                except FileNotFoundError:
                    pass
            tried = True
            self._create_exclusive(p, payload)

        self._call_write("create", path, attempt)

    def put_file(self, local_path: str, path: str) -> None:
        """Upload ``local_path`` to ``path`` atomically; FileNotFoundError naming the local path if it is missing."""
        local = os.fspath(local_path)
        if not os.path.isfile(local):
            # Raised here, outside the storage call, so a missing *local* file is never
            # reported as a missing remote one.
            raise FileNotFoundError(errno.ENOENT, "local file to upload does not exist", local)
        _, p = self._split(path)
        self._call_write("upload", path, lambda: self._upload(local, p))

    def get_file(self, path: str, local_path: str) -> None:
        """Download ``path`` to ``local_path`` through a temporary sibling, so the local file is replaced
        atomically; parent directories are created and a directory at ``path`` is refused.
        """
        _, p = self._split(path)
        local = os.path.abspath(os.fspath(local_path))
        os.makedirs(os.path.dirname(local), exist_ok=True)

        def fetch() -> None:
            tmp = temp_sibling(local)
            try:
                self.fs.get_file(p, tmp)
                if not os.path.isfile(tmp):
                    raise IsADirectoryError(errno.EISDIR, "is a directory, not a file", path)
                os.replace(tmp, local)
            finally:
                _remove_quietly(tmp)

        self._call("download", path, fetch)

    def list(self, path: str, recursive: bool = False) -> Iterator[FileInfo]:
        """Entries under ``path``, sorted by URL; hides in-progress temporary files; a missing path is empty.

        The listing is complete before the iterator is returned. ``recursive``: every file below
        ``path``, without directory entries.
        """
        prefix, p = self._split(path)

        def listing() -> list[dict[str, Any]]:
            try:
                if recursive:
                    return list(self.fs.find(p, detail=True, withdirs=False).values())
                return list(self.fs.ls(p, detail=True))
            except FileNotFoundError:
                return []

        infos = []
        for entry in self._call("list", path, listing):
            name = str(entry["name"]).rstrip("/")
            if name.rpartition("/")[2].startswith(TEMP_PREFIX):
                continue
            is_dir = entry.get("type") == "directory"
            infos.append(FileInfo(prefix + name, 0 if is_dir else int(entry.get("size") or 0), is_dir))
        return iter(sorted(infos, key=lambda i: i.path))

    def makedirs(self, path: str) -> None:
        """Create the directory ``path`` with its parents; an existing one is not an error."""
        _, p = self._split(path)
        self._call("makedirs", path, lambda: self.fs.makedirs(p, exist_ok=True))

    def delete(self, path: str) -> None:
        """Delete the file at ``path``; a missing file is not an error."""
        _, p = self._split(path)

        def remove() -> None:
            try:
                self.fs.rm_file(p)
            except FileNotFoundError:
                pass

        self._call("delete", path, remove)

    def delete_dir(self, path: str) -> None:
        """Delete the tree at ``path``; missing is not an error; InvalidArgumentError for a file system root."""
        _, p = self._split(path)
        self._refuse_root(path, p)

        def remove_tree() -> None:
            try:
                self.fs.rm(p, recursive=True)
            except FileNotFoundError:
                pass

        self._call("delete", path, remove_tree)

    # -- shared machinery --------------------------------------------------------------------
    def _refuse_root(self, url: str, fs_path: str) -> None:
        if fs_path.strip("/") == "":
            raise InvalidArgumentError(f"refusing to delete the root of {url!r}; pass a checkpoint directory below it")

    def _call_write(self, op: str, url: str, fn: Callable[[], None]) -> None:
        try:
            self._call(op, url, fn)
        except FileNotFoundError as exc:
            raise StorageError(self._missing_parent_message(url)) from exc

    def _call(self, op: str, url: str, fn: Callable[[], T]) -> T:
        try:
            return call_with_retries(
                fn,
                what=f"{op} {url}",
                policy=self._retry,
                waiter=self._waiter,
                is_transient=self._is_transient,
                interrupted=storage_interrupted,
            )
        except KeyedStateError:
            raise
        except FileNotFoundError as exc:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), url) from exc
        except FileExistsError as exc:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), url) from exc
        except Exception as exc:
            if self._is_transient(exc):
                message = (
                    f"{op} {url} failed after {self._retry.max_attempts} attempts: {_describe(exc)}; {self._hint(exc)}"
                )
            else:
                message = f"{op} {url} failed: {_describe(exc)}; {self._hint(exc)}"
            raise StorageError(message) from exc

    def __repr__(self) -> str:
        # Never touches self.fs: building it may connect (HDFS) or load credentials.
        return f"{type(self).__name__}()"


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        # fsspec's local get_file turns a remote directory into a local one.
        shutil.rmtree(path, ignore_errors=True)
