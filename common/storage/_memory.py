"""Checkpoints kept in the JobManager's memory (``jobmanager://`` URLs): Flink's JobManagerCheckpointStorage.

With ``execution.checkpointing.storage: jobmanager`` the TaskManagers send every file of a
snapshot inline in their acknowledgement, the JobManager keeps the files and ``_metadata`` here,
and hands the bytes back inline when it deploys a restore. Nothing is written to disk: the
checkpoints live exactly as long as the JobManager process, which is why this storage cannot be
combined with JobManager high availability. Retention deletes subsumed checkpoints as with files,
so the memory held is bounded by ``execution.checkpointing.num-retained``.

One store per process, shared by every instance, as a file system is shared by its clients.
Directories are implied by the files below them, as on object stores.
"""

from __future__ import annotations

import errno
import os
import tempfile
import threading
from collections.abc import Iterator

from keyedstate.common.config import Configuration
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.retry import RetryPolicy, Waiter
from keyedstate.common.storage._base import FileInfo
from keyedstate.common.storage._fsspec import join_url

SCHEME = "jobmanager://"

_files: dict[str, bytes] = {}
_lock = threading.Lock()


def _missing(path: str) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)


class JobManagerMemoryStorage:
    """``jobmanager://<jobmanager instance>/<job id>/…``: files held in this process's memory."""

    @classmethod
    def from_url(
        cls,
        url: str,
        config: Configuration | None = None,
        *,
        retry: RetryPolicy | None = None,
        waiter: Waiter | None = None,
    ) -> JobManagerMemoryStorage:
        """The process's store; the arguments are those every storage factory takes (nothing to configure)."""
        return cls()

    def _key(self, url: str) -> str:
        if not url.startswith(SCHEME) or not url[len(SCHEME) :].strip("/"):
            raise InvalidArgumentError(
                f"{url!r} is not a JobManager checkpoint storage URL (jobmanager://<instance>/<path>)"
            )
        return url.rstrip("/")

    def join(self, base: str, *parts: str) -> str:
        return join_url(base, *parts)

    def exists(self, path: str) -> bool:
        key = self._key(path)
        with _lock:
            return key in _files or any(k.startswith(key + "/") for k in _files)

    def read_bytes(self, path: str) -> bytes:
        key = self._key(path)
        with _lock:
            data = _files.get(key)
        if data is None:
            raise _missing(path)
        return data

    def write_bytes(self, path: str, data: bytes) -> None:
        key = self._key(path)
        with _lock:
            _files[key] = bytes(data)

    def create_exclusive(self, path: str, data: bytes) -> None:
        key = self._key(path)
        with _lock:
            if key in _files:
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
            _files[key] = bytes(data)

    def put_file(self, local_path: str, path: str) -> None:
        with open(local_path, "rb") as f:
            self.write_bytes(path, f.read())

    def get_file(self, path: str, local_path: str) -> None:
        directory = os.path.dirname(os.path.abspath(local_path))
        os.makedirs(directory, exist_ok=True)
        data = self.read_bytes(path)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".ks-tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, local_path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def size(self, path: str) -> int:
        return len(self.read_bytes(path))

    def list(self, path: str, recursive: bool = False) -> Iterator[FileInfo]:
        prefix = self._key(path) + "/"
        with _lock:
            below = [(k, len(v)) for k, v in _files.items() if k.startswith(prefix)]
        if recursive:
            return iter(sorted((FileInfo(k, n, False) for k, n in below), key=lambda i: i.path))
        entries: dict[str, FileInfo] = {}
        for key, n in below:
            child, sep, _ = key[len(prefix) :].partition("/")
            url = prefix + child
            entries[url] = FileInfo(url, 0, True) if sep else FileInfo(url, n, False)
        return iter(sorted(entries.values(), key=lambda i: i.path))

    def makedirs(self, path: str) -> None:
        """Nothing to do: directories are implied by the files below them."""
        self._key(path)

    def delete(self, path: str) -> None:
        key = self._key(path)
        with _lock:
            _files.pop(key, None)

    def delete_dir(self, path: str) -> None:
        key = self._key(path)
        if "/" not in key[len(SCHEME) :]:
            raise InvalidArgumentError(f"refusing to delete the root of {path!r}; pass a checkpoint directory below it")
        with _lock:
            for k in [k for k in _files if k == key or k.startswith(key + "/")]:
                del _files[k]

    def __repr__(self) -> str:
        return "JobManagerMemoryStorage()"
