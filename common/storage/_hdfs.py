"""Checkpoint storage on HDFS, natively (``hdfs://``) or over the WebHDFS REST API (``webhdfs://``).

What a user must install:

* ``hdfs://namenode:8020/path`` goes through ``pyarrow.fs.HadoopFileSystem``, which loads the
  JVM and libhdfs: ``pip install pyarrow`` plus a Hadoop client on the host, with
  ``JAVA_HOME`` set, ``HADOOP_HOME`` set, ``CLASSPATH=$(hadoop classpath --glob)`` exported and,
  if ``libhdfs.so`` is not under ``$HADOOP_HOME/lib/native``, ``ARROW_LIBHDFS_DIR``.
  ``hdfs:///path`` (no host) uses ``fs.defaultFS`` from the Hadoop configuration.
* ``webhdfs://namenode:9870/path`` needs only ``requests`` (already a dependency of most
  environments) and a NameNode with WebHDFS enabled (``dfs.webhdfs.enabled``, the default).
  The user is ``HADOOP_USER_NAME`` when set.

Writes go to a temporary file in the target directory and are then renamed, since an HDFS
file is visible while it is being written. An exclusive create refuses an existing name
before the rename and checks that the rename happened: WebHDFS reports a refused rename only
as ``{"boolean": false}``, and pyarrow's move replaces an existing file. Two writers racing
for the same new name can therefore both succeed; the checkpoint layout has one writer per
name (the JobManager writes ``_metadata``). No HDFS is available to this project's tests, so
only the URL routing is tested here.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from urllib.parse import urlsplit

from fsspec import AbstractFileSystem

from keyedstate.common.config import Configuration
from keyedstate.common.errors import InvalidArgumentError, StorageError
from keyedstate.common.retry import RetryPolicy, Waiter
from keyedstate.common.storage._fsspec import FsspecStorage, temp_sibling
from keyedstate.common.storage._retry import is_transient_os_error

logger = logging.getLogger(__name__)

SCHEMES = ("hdfs", "webhdfs")
DEFAULT_WEBHDFS_PORT = 9870

INSTALL_HINT_HDFS = (
    "hdfs:// needs pyarrow and a Hadoop client: pip install pyarrow, then set JAVA_HOME and HADOOP_HOME, "
    "export CLASSPATH=$(hadoop classpath --glob) and, if libhdfs.so is elsewhere, ARROW_LIBHDFS_DIR; "
    "or use webhdfs://namenode:9870/path, which needs only the requests package"
)
INSTALL_HINT_WEBHDFS = "webhdfs:// needs the requests package: pip install requests"


class HdfsStorage(FsspecStorage):
    """``hdfs://`` (pyarrow/libhdfs) or ``webhdfs://`` (REST) URLs of one NameNode."""

    def __init__(
        self,
        scheme: str,
        netloc: str,
        *,
        fs: AbstractFileSystem | None = None,
        retry: RetryPolicy | None = None,
        waiter: Waiter | None = None,
    ) -> None:
        super().__init__(retry=retry, waiter=waiter)
        if scheme not in SCHEMES:
            raise InvalidArgumentError(f"HDFS storage serves hdfs:// and webhdfs:// URLs, not {scheme}://")
        self.scheme = scheme
        self.netloc = netloc
        self._fs = fs
        self._fs_lock = threading.Lock()

    @classmethod
    def from_url(
        cls,
        url: str,
        config: Configuration | None = None,
        *,
        retry: RetryPolicy | None = None,
        waiter: Waiter | None = None,
    ) -> HdfsStorage:
        """Storage for the scheme and NameNode (``netloc``) of ``url``; connects only on first use of :attr:`fs`."""
        parts = urlsplit(url)
        return cls(parts.scheme.lower(), parts.netloc, retry=retry, waiter=waiter)

    @property
    def fs(self) -> AbstractFileSystem:
        """The HDFS file system, connected on first use (loads a JVM for hdfs://, reaches the NameNode);
        thread-safe, and may block or raise there rather than at construction.
        """
        # Connecting to HDFS loads a JVM (hdfs://) or needs the NameNode; do it on first use so
        # that building the storage from configuration never blocks.
        with self._fs_lock:
            if self._fs is None:
                self._fs = self._connect()
            return self._fs

    def _connect(self) -> AbstractFileSystem:
        host, _, port = self.netloc.rpartition(":") if ":" in self.netloc else (self.netloc, "", "")
        try:
            if self.scheme == "webhdfs":
                from fsspec.implementations.webhdfs import WebHDFS

                return WebHDFS(
                    host=host or "localhost",
                    port=int(port or DEFAULT_WEBHDFS_PORT),
                    user=os.environ.get("HADOOP_USER_NAME"),
                    skip_instance_cache=True,
                )
            from fsspec.implementations.arrow import HadoopFileSystem

            return HadoopFileSystem(host=host or "default", port=int(port or 0), skip_instance_cache=True)
        except ImportError as exc:
            hint = INSTALL_HINT_WEBHDFS if self.scheme == "webhdfs" else INSTALL_HINT_HDFS
            raise StorageError(f"cannot open {self.scheme}://{self.netloc}: {exc}; {hint}") from exc
        except ValueError as exc:
            raise InvalidArgumentError(f"{self.scheme}://{self.netloc}: the port must be a number") from exc
        except Exception as exc:  # pyarrow raises OSError when libjvm or libhdfs cannot be loaded
            # pyarrow lists every JVM path it tried; the first line says what failed.
            first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise StorageError(
                f"cannot connect to {self.scheme}://{self.netloc}: {first_line}; {INSTALL_HINT_HDFS}"
            ) from exc

    def __repr__(self) -> str:
        return f"HdfsStorage({self.scheme}://{self.netloc})"

    def _split(self, url: str) -> tuple[str, str]:
        parts = urlsplit(url)
        if parts.scheme.lower() != self.scheme or parts.netloc != self.netloc:
            raise InvalidArgumentError(
                f"{url!r} is not served by this storage ({self.scheme}://{self.netloc}); open a storage for its NameNode"
            )
        path = parts.path or "/"
        return f"{self.scheme}://{self.netloc}", path

    def _write(self, fs_path: str, data: bytes) -> None:
        tmp = temp_sibling(fs_path)
        self.fs.pipe_file(tmp, data)
        self._publish(tmp, fs_path, exclusive=False)

    def _create_exclusive(self, fs_path: str, data: bytes) -> None:
        if self.fs.exists(fs_path):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), fs_path)
        tmp = temp_sibling(fs_path)
        self.fs.pipe_file(tmp, data)
        self._publish(tmp, fs_path, exclusive=True)

    def _upload(self, local_path: str, fs_path: str) -> None:
        tmp = temp_sibling(fs_path)
        self.fs.put_file(local_path, tmp)
        self._publish(tmp, fs_path, exclusive=False)

    def _publish(self, tmp: str, fs_path: str, *, exclusive: bool) -> None:
        try:
            if not exclusive and self.fs.exists(fs_path):
                # HDFS rename refuses an existing target; an overwrite removes it first.
                self.fs.rm_file(fs_path)
            self.fs.mv(tmp, fs_path)
            if self.fs.exists(tmp):  # WebHDFS: the rename was refused without an error
                if self.fs.exists(fs_path):
                    raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), fs_path)
                raise OSError(errno.EIO, "the NameNode refused the rename of the temporary file", fs_path)
        except BaseException:
            try:
                self.fs.rm_file(tmp)
            except Exception:  # already renamed or never created; nothing to clean up
                pass
            raise

    def _is_transient(self, exc: BaseException) -> bool:
        if is_transient_os_error(exc):
            return True
        try:
            import requests
        except ImportError:
            return False
        if isinstance(exc, (requests.ConnectionError, requests.Timeout)):
            return True
        response = getattr(exc, "response", None)
        return response is not None and getattr(response, "status_code", 0) >= 500

    def _hint(self, exc: BaseException) -> str:
        if isinstance(exc, PermissionError):
            return "HDFS denied access; check HADOOP_USER_NAME / Kerberos and the directory permissions"
        return f"check that the NameNode {self.netloc or '(fs.defaultFS)'} is reachable and out of safe mode"
