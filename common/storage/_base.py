"""The checkpoint storage interface: one protocol over fsspec for file://, s3:// and hdfs://."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

MAX_FILE_NAME = 255


def is_plain_file_name(name: str) -> bool:
    """True for a single path component that stays in the directory it is joined to.

    Not empty, no separator (``/`` or ``\\``), not ``.`` or ``..``, no NUL, at most 255 characters:
    checkpoint file names (``local_name``) come from ``_metadata`` and from DeploySlot, and a
    restore writes each file under its name inside the restore directory.
    """
    return (
        0 < len(name) <= MAX_FILE_NAME and name not in (".", "..") and not any(c in name for c in ("/", "\\", "\x00"))
    )


@dataclass(frozen=True)
class FileInfo:
    path: str
    """Absolute URL, same scheme as the storage root (``s3://bucket/a/b``, ``file:///x/y``)."""
    size: int
    """Bytes; 0 for directories."""
    is_dir: bool


class CheckpointStorage(Protocol):
    """What the runtime needs from a file system; every path is an absolute URL.

    Contract (tested against file:// and S3 by tests/contract/test_storage_contract.py):
    * ``put_file``/``write_bytes`` never leave a partial object visible under the final name.
    * ``create_exclusive`` writes the whole object under a name that must not exist yet and
      raises ``FileExistsError`` if it does (S3: If-None-Match, local: O_EXCL + link).
    * Missing paths raise ``FileNotFoundError``; throttling and 5xx answers are retried
      with backoff, and what still fails is raised as ``StorageError`` naming the path.
    * Writes create missing parent directories (object-store semantics everywhere).
    * Implementations are thread-safe: one instance is shared by all transfer threads.
    """

    def join(self, base: str, *parts: str) -> str:
        """``base`` + ``/`` + parts; parts must not contain ``..`` or ``.`` segments."""

    def exists(self, path: str) -> bool:
        """True if a file or directory is at ``path``; a failure to ask raises, it never reads as False."""

    def read_bytes(self, path: str) -> bytes:
        """The whole object in memory; FileNotFoundError if missing (:meth:`get_file` for large files)."""

    def write_bytes(self, path: str, data: bytes) -> None:
        """Create or replace the object atomically: readers see the old bytes or all the new ones."""

    def create_exclusive(self, path: str, data: bytes) -> None:
        """Write the object only if ``path`` is free, else raise FileExistsError: for files two writers race for."""

    def put_file(self, local_path: str, path: str) -> None:
        """Upload the local file ``local_path`` to ``path`` atomically (parents created)."""

    def get_file(self, path: str, local_path: str) -> None:
        """Download to ``local_path`` (replaced atomically; parents created)."""

    def size(self, path: str) -> int:
        """Bytes of the file at ``path``; FileNotFoundError if missing."""

    def list(self, path: str, recursive: bool = False) -> Iterator[FileInfo]:
        """Entries under ``path``, sorted by path; a missing path lists as empty.

        Non-recursive: the immediate children, directories included. Recursive: every file
        below ``path``, no directory entries. URLs keep the form of ``path`` (scheme included).
        """

    def makedirs(self, path: str) -> None:
        """Create the directory ``path`` and its parents; existing is not an error.

        Object stores have no directories (writes create prefixes), so there it does nothing.
        """

    def delete(self, path: str) -> None:
        """Delete a file; a missing file is not an error."""

    def delete_dir(self, path: str) -> None:
        """Delete a directory tree (or every object under a prefix); missing is not an error."""
