"""What a storage backend retries: transient OS errors (throttling, 5xx, network).

The retry loop and policy are the project's one mechanism, :mod:`keyedstate.common.retry`;
this module only says which storage errors are worth another attempt.
"""

from __future__ import annotations

import errno

from keyedstate.common.errors import Reason, StorageError

__all__ = ["is_transient_os_error", "storage_interrupted"]

# OSError numbers that mean "try again": throttling (s3fs maps SlowDown/503 to EBUSY),
# server errors (500 → EREMOTEIO) and network trouble.
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EBUSY,
        errno.EAGAIN,
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.EPIPE,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.EREMOTEIO,
        # A recursive delete that raced a writer still adding files (an upload of an aborted
        # checkpoint landing during the deletion): the next walk removes them.
        errno.ENOTEMPTY,
    }
)
# Definite answers: retrying cannot change them.
_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


def is_transient_os_error(exc: BaseException) -> bool:
    """Whether an error from a file system is worth retrying (throttling, 5xx, network)."""
    if isinstance(exc, _PERMANENT):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS


def storage_interrupted(what: str) -> StorageError:
    """The error a storage call ends with when shutdown interrupts its backoff."""
    return StorageError(
        f"storage {what} abandoned while waiting to retry because the process is shutting down",
        reason=Reason.SHUTTING_DOWN,
    )
