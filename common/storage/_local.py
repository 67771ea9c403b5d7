"""Checkpoint storage on a local or mounted file system (``file://`` URLs and plain paths).

Every write goes to a temporary file in the target directory, is fsynced, and then appears
under its final name in one step: ``os.replace`` for overwrites, ``os.link`` (which refuses an
existing name) for exclusive creates, with ``renameat2(RENAME_NOREPLACE)`` where hard links are
not supported. The directory is fsynced too, so a completed checkpoint survives a power cut.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from keyedstate.common.config import Configuration
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.retry import RetryPolicy, Waiter
from keyedstate.common.storage._fsspec import FsspecStorage, temp_sibling

logger = logging.getLogger(__name__)

# Errors of os.link on file systems without hard links (some FUSE, SMB, FAT mounts).
_NO_HARDLINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS})


class LocalStorage(FsspecStorage):
    """``file:///abs/path`` URLs and plain paths (relative ones are made absolute)."""

    def __init__(
        self, *, fs: LocalFileSystem | None = None, retry: RetryPolicy | None = None, waiter: Waiter | None = None
    ) -> None:
        super().__init__(retry=retry, waiter=waiter)
        self._fs = fs if fs is not None else LocalFileSystem()

    @classmethod
    def from_url(
        cls,
        url: str,
        config: Configuration | None = None,
        *,
        retry: RetryPolicy | None = None,
        waiter: Waiter | None = None,
    ) -> LocalStorage:
        """Storage for ``file://`` URLs; ``url`` and ``config`` are unused (the factory signature all storages share)."""
        return cls(retry=retry, waiter=waiter)

    @property
    def fs(self) -> LocalFileSystem:
        return self._fs

    def _split(self, url: str) -> tuple[str, str]:
        if url.startswith("file://"):
            rest = url[len("file://") :]
            if not rest.startswith("/"):
                raise InvalidArgumentError(
                    f"{url!r}: a file URL needs an absolute path after file://, for example file:///var/lib/checkpoints"
                )
            return "file://", os.path.abspath(rest)
        if "://" in url:
            raise InvalidArgumentError(
                f"{url!r} is not a local path; local storage serves file:// URLs and plain paths"
            )
        if not url:
            raise InvalidArgumentError("empty path; pass a file:// URL or a directory path")
        return "", os.path.abspath(url)

    def _write(self, fs_path: str, data: bytes) -> None:
        _atomic_publish(fs_path, lambda f: f.write(data), exclusive=False)

    def _create_exclusive(self, fs_path: str, data: bytes) -> None:
        _atomic_publish(fs_path, lambda f: f.write(data), exclusive=True)

    def _upload(self, local_path: str, fs_path: str) -> None:
        def copy(dst: Any) -> None:
            with open(local_path, "rb") as src:
                shutil.copyfileobj(src, dst, 1 << 20)

        _atomic_publish(fs_path, copy, exclusive=False)

    def _hint(self, exc: BaseException) -> str:
        if isinstance(exc, PermissionError):
            return "check the permissions of the checkpoint directory for the user running this process"
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return "the disk is full; free space or point state.checkpoints.dir elsewhere"
        return "check the local file system (disk errors, mount status)"


def _atomic_publish(path: str, fill: Callable[[Any], Any], *, exclusive: bool) -> None:
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, exist_ok=True)
    except FileExistsError as exc:
        # A file where a parent directory should be: not the "target exists" of an exclusive create.
        raise NotADirectoryError(errno.ENOTDIR, "a parent of the target is a file, not a directory", directory) from exc
    tmp = temp_sibling(path)
    # O_EXCL: the temporary name is ours alone even if two writers picked the same one.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        if exclusive:
            _link_no_replace(tmp, path)
        else:
            os.replace(tmp, path)
        _fsync_dir(directory)
    finally:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass


def _link_no_replace(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in _NO_HARDLINKS:
            raise
        logger.debug("hard links unsupported for %s (%s); using renameat2(RENAME_NOREPLACE)", dst, exc)
        rename_no_replace(src, dst)


def rename_no_replace(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst`` atomically, raising FileExistsError if ``dst`` exists (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        raise OSError(errno.ENOTSUP, "this platform offers neither hard links nor renameat2 for exclusive creates", dst)
    at_fdcwd, rename_noreplace = -100, 1
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), rename_noreplace) != 0:
        code = ctypes.get_errno()
        # OSError(EEXIST, ...) is constructed as FileExistsError.
        raise OSError(code, os.strerror(code), dst)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
