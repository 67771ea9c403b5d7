"""The checkpoint storage interface: one protocol over fsspec for file://, s3:// and hdfs://."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol


@dataclass(frozen=True)
class FileInfo:
    path: str
    """Absolute URL, same scheme as the storage root (``s3://bucket/a/b``, ``file:///x/y``)."""
    size: int
    is_dir: bool


class CheckpointStorage(Protocol):
    """What the runtime needs from a file system; every path is an absolute URL.

    Contract (tested against file:// and S3 by tests/contract/test_storage_contract.py):
    * ``put_file``/``write_bytes`` never leave a partial object visible under the final name.
    * ``create_exclusive`` writes the whole object under a name that must not exist yet and
      raises ``FileExistsError`` if it does (S3: If-None-Match, local: O_EXCL + rename).
    * Missing paths raise ``FileNotFoundError``; throttling and 5xx answers are retried
      with backoff, and what still fails is raised as ``StorageError`` naming the path.
    """

    def join(self, base: str, *parts: str) -> str: ...
    def exists(self, path: str) -> bool: ...
    def read_bytes(self, path: str) -> bytes: ...
    def write_bytes(self, path: str, data: bytes) -> None: ...
    def create_exclusive(self, path: str, data: bytes) -> None: ...
    def put_file(self, local_path: str, path: str) -> None: ...
    def get_file(self, path: str, local_path: str) -> None: ...
    def size(self, path: str) -> int: ...
    def list(self, path: str, recursive: bool = False) -> Iterator[FileInfo]: ...
    def delete(self, path: str) -> None:
        """Delete a file; a missing file is not an error."""
    def delete_dir(self, path: str) -> None:
        """Delete a directory tree (or every object under a prefix); missing is not an error."""
