"""Which storage serves which URL scheme; implementations are imported on first use.

Importing lazily keeps optional dependencies optional: a job that checkpoints to local disk
never imports s3fs, and a missing package is reported with the command that installs it.
"""

from __future__ import annotations

import importlib
import logging
import re
from dataclasses import dataclass
from typing import Any

from keyedstate.common.config import Configuration
from keyedstate.common.errors import ConfigError, InvalidArgumentError, StorageError
from keyedstate.common.retry import RetryPolicy, Waiter
from keyedstate.common.storage._base import CheckpointStorage

logger = logging.getLogger(__name__)

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


@dataclass(frozen=True)
class StorageBackend:
    target: str
    """``module:Class``; the class has ``from_url(url, config, *, retry, waiter)``."""
    install_hint: str
    """What to install when importing ``module`` fails."""


_LOCAL = StorageBackend(
    "keyedstate.common.storage._local:LocalStorage", "reinstall keyedstate (fsspec is a core dependency)"
)
_S3 = StorageBackend(
    "keyedstate.common.storage._s3:S3Storage", "pip install s3fs (or pip install keyedstate, which depends on it)"
)
_HDFS = StorageBackend(
    "keyedstate.common.storage._hdfs:HdfsStorage",
    "pip install fsspec pyarrow (hdfs://) or requests (webhdfs://)",
)
_JOBMANAGER = StorageBackend(
    "keyedstate.common.storage._memory:JobManagerMemoryStorage", "reinstall keyedstate (it is part of the runtime)"
)

_REGISTRY: dict[str, StorageBackend] = {
    "": _LOCAL,
    "file": _LOCAL,
    "s3": _S3,
    "s3a": _S3,
    "s3n": _S3,
    "hdfs": _HDFS,
    "webhdfs": _HDFS,
    # Checkpoints in the JobManager's memory (execution.checkpointing.storage: jobmanager);
    # only the JobManager process that took them can read them.
    "jobmanager": _JOBMANAGER,
}


def scheme_of(url: str) -> str:
    """The lower-case URL scheme, or ``""`` for a plain path."""
    match = _SCHEME.match(url)
    return match.group(1).lower() if match else ""


def register_storage(scheme: str, target: str, install_hint: str) -> None:
    """Serve ``scheme://`` URLs with ``target`` (``module:Class``), imported on first use."""
    if not scheme or not _SCHEME.match(f"{scheme}://"):
        raise InvalidArgumentError(f"invalid URL scheme {scheme!r}")
    if ":" not in target:
        raise InvalidArgumentError(f"storage target {target!r} must be 'module:Class'")
    _REGISTRY[scheme.lower()] = StorageBackend(target, install_hint)


def supported_schemes() -> list[str]:
    return sorted(s for s in _REGISTRY if s)


def open_storage(
    url: str,
    config: Configuration | None = None,
    *,
    retry: RetryPolicy | None = None,
    waiter: Waiter | None = None,
) -> CheckpointStorage:
    """The storage for ``url``'s scheme, configured from ``config`` (``s3.*`` keys).

    Create one per process and share it: it is thread-safe and holds connection pools.
    ``waiter`` (a ``threading.Event``, say the daemon's shutdown event) interrupts retry backoffs.
    """
    if not url or not url.strip():
        raise ConfigError("empty checkpoint storage URL; set state.checkpoints.dir to a file://, s3:// or hdfs:// URL")
    scheme = scheme_of(url)
    backend = _REGISTRY.get(scheme)
    if backend is None:
        raise ConfigError(
            f"no checkpoint storage for {scheme}:// URLs ({url}); use one of "
            f"{', '.join(s + '://' for s in supported_schemes())} or a local path"
        )
    module_name, _, attr = backend.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or str(exc)
        raise StorageError(
            f"{scheme or 'local'}:// storage needs the package {missing!r}, which is not installed: {backend.install_hint}"
        ) from exc
    cls: Any = getattr(module, attr)
    storage: CheckpointStorage = cls.from_url(url, config, retry=retry, waiter=waiter)
    logger.debug("opened %s for %s", type(storage).__name__, url)
    return storage
