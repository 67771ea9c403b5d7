"""Taking snapshots of slot state and moving their files to and from checkpoint storage."""

from __future__ import annotations

from keyedstate.taskmanager.snapshot.transfer import (
    DownloadFile,
    TransferCancelledError,
    TransferStats,
    UploadedFile,
    download_files,
    sha256_file,
    upload_files,
)

__all__ = [
    "DownloadFile",
    "TransferCancelledError",
    "TransferStats",
    "UploadedFile",
    "download_files",
    "sha256_file",
    "upload_files",
]
