"""Checkpoint storage: one interface over local disks, S3 and HDFS.

``open_storage(url, config)`` picks the implementation by URL scheme. S3 and HDFS classes are
imported only when used (``keyedstate.common.storage.S3Storage`` imports s3fs on access).
"""

from __future__ import annotations

from typing import Any

from keyedstate.common.retry import RetryPolicy, Waiter
from keyedstate.common.storage._base import MAX_FILE_NAME, CheckpointStorage, FileInfo, is_plain_file_name
from keyedstate.common.storage._cache import StorageCache
from keyedstate.common.storage._fsspec import FsspecStorage, join_url
from keyedstate.common.storage._local import LocalStorage
from keyedstate.common.storage._registry import open_storage, register_storage, scheme_of, supported_schemes

__all__ = [
    "MAX_FILE_NAME",
    "CheckpointStorage",
    "FileInfo",
    "FsspecStorage",
    "HdfsStorage",
    "LocalStorage",
    "RetryPolicy",
    "S3Storage",
    "StorageCache",
    "Waiter",
    "is_plain_file_name",
    "join_url",
    "open_storage",
    "register_storage",
    "s3fs_options",
    "scheme_of",
    "supported_schemes",
]

_LAZY = {
    "S3Storage": "keyedstate.common.storage._s3",
    "s3fs_options": "keyedstate.common.storage._s3",
    "HdfsStorage": "keyedstate.common.storage._hdfs",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
