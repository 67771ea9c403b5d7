"""The messages between a TaskManager and its transfer processes (pickled over a socket pair).

Both ends run the same code (the TaskManager starts the process from its own interpreter), so
the messages are plain frozen dataclasses. Errors cross as their type name and message and are
rebuilt on the TaskManager's side (:func:`rebuild_error`), so a decline says what it said when
the transfer ran in-process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from keyedstate.common.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    InvalidArgumentError,
    KeyedStateError,
    StorageError,
)
from keyedstate.taskmanager.snapshot.transfer import TransferCancelledError, UploadedFile

Counts = tuple[int, int, int, int]
"""(files uploaded, bytes uploaded, files downloaded, bytes downloaded)"""


@dataclass(frozen=True)
class WorkerSettings:
    """The first message: everything a transfer process needs to build its own storage clients."""

    config: dict[str, Any]
    """The TaskManager's raw configuration (``s3.*`` keys and credentials, HDFS, retries). Sent over
    the socket, never on a command line or in the environment, where other users could read it."""
    nice: int
    """CPU niceness the process takes before it starts any thread."""


@dataclass(frozen=True)
class UploadRequest:
    request_id: int
    storage_url: str
    files: tuple[tuple[str, str], ...]
    threads: int


@dataclass(frozen=True)
class DownloadRequest:
    request_id: int
    storage_url: str
    files: tuple[tuple[str, str, int, str], ...]
    threads: int


@dataclass(frozen=True)
class CancelRequest:
    """Stop the request: no new file starts; the reply is a TransferCancelledError."""

    request_id: int


Request = UploadRequest | DownloadRequest


@dataclass(frozen=True)
class TransferDone:
    request_id: int
    uploaded: tuple[UploadedFile, ...]
    downloaded_bytes: int
    counts: Counts


@dataclass(frozen=True)
class TransferFailed:
    request_id: int
    error_type: str
    message: str
    completed: tuple[str, ...]
    """For a cancelled transfer: the remote paths that were transferred before it stopped."""
    counts: Counts


Reply = TransferDone | TransferFailed

_REBUILT: dict[str, type[KeyedStateError]] = {
    cls.__name__: cls
    for cls in (CheckpointError, CorruptCheckpointError, StorageError, InvalidArgumentError, ConfigError)
}


def failure(request_id: int, exc: BaseException, counts: Counts) -> TransferFailed:
    """The reply for a request that raised ``exc``."""
    message = exc.message if isinstance(exc, KeyedStateError) else repr(exc)
    completed = tuple(exc.completed) if isinstance(exc, TransferCancelledError) else ()
    return TransferFailed(request_id, type(exc).__name__, message, completed, counts)


def rebuild_error(reply: TransferFailed) -> KeyedStateError:
    """The error the transfer raised in its process, as the same type where it is one of ours."""
    if reply.error_type == TransferCancelledError.__name__:
        return TransferCancelledError(reply.message, completed=reply.completed)
    cls = _REBUILT.get(reply.error_type)
    if cls is not None:
        return cls(reply.message)
    return CheckpointError(f"checkpoint transfer failed: {reply.message}")
