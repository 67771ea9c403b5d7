"""One storage object per scheme and authority, shared by everything in a process.

Storage objects hold connection pools (S3) and are thread-safe, so every checkpoint of every
slot or job on the same bucket or file system uses one.
"""

from __future__ import annotations

import threading

from keyedstate.common.config import Configuration
from keyedstate.common.retry import Waiter
from keyedstate.common.storage._base import CheckpointStorage
from keyedstate.common.storage._registry import open_storage


class StorageCache:
    def __init__(self, conf: Configuration, waiter: Waiter | None = None) -> None:
        self._conf = conf
        self._waiter = waiter
        self._cache: dict[str, CheckpointStorage] = {}
        self._lock = threading.Lock()

    def for_url(self, url: str, conf: Configuration | None = None) -> CheckpointStorage:
        """The storage for ``url``; ``conf`` (default: the cache's) configures it on first use."""
        key = "/".join(url.split("/", 3)[:3])
        with self._lock:
            storage = self._cache.get(key)
            if storage is None:
                storage = open_storage(url, conf if conf is not None else self._conf, waiter=self._waiter)
                self._cache[key] = storage
            return storage
