"""Checkpoint storage on S3 and S3-compatible stores (MinIO, Ceph, moto) through s3fs.

An S3 object appears atomically when its PUT (or multipart completion) succeeds, so writes go
straight to the final key. Exclusive creates use a conditional PUT (``If-None-Match: *``), which
S3 answers with 412 when the key exists; s3fs's rename is a copy plus delete and is never used.

Configuration (Flink's keys; each unset key falls back to the AWS standard):

=====================  ======================================================
``s3.endpoint``        ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``
``s3.access-key``      the AWS credential chain (``AWS_ACCESS_KEY_ID``, profiles, roles)
``s3.secret-key``      (set together with ``s3.access-key``)
``s3.region``          ``AWS_REGION`` / ``AWS_DEFAULT_REGION``
``s3.path.style.access``  virtual-hosted addressing
=====================  ======================================================

Retries: botocore retries each HTTP request (standard mode, 3 attempts), which keeps a failed
part of a multipart upload from restarting the whole file; the storage layer then retries the
whole operation per its RetryPolicy. s3fs's own retry loop is switched off so that the layers
do not multiply.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

import s3fs

from keyedstate.common.config import Configuration, options
from keyedstate.common.errors import ConfigError, InvalidArgumentError
from keyedstate.common.retry import RetryPolicy, Waiter
from keyedstate.common.storage._fsspec import FsspecStorage
from keyedstate.common.storage._retry import is_transient_os_error

logger = logging.getLogger(__name__)

SCHEMES = ("s3", "s3a", "s3n")

_THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
    }
)


def _network_errors() -> tuple[type[BaseException], ...]:
    from botocore import exceptions as bx

    errors: list[type[BaseException]] = [
        bx.HTTPClientError,
        bx.ConnectionError,
        bx.IncompleteReadError,
        bx.ResponseStreamingError,
    ]
    try:
        import aiohttp

        errors += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
    except ImportError:  # aiobotocore may use another HTTP client
        pass
    return tuple(errors)


_NETWORK_ERRORS = _network_errors()


def s3fs_options(config: Configuration | None = None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The keyword arguments for ``s3fs.S3FileSystem`` from Flink's ``s3.*`` keys and AWS env vars."""
    conf = config if config is not None else Configuration()
    env = os.environ if environ is None else environ
    endpoint = conf.get(options.S3_ENDPOINT) or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint and "://" not in endpoint:
        endpoint = "https://" + endpoint
    key, secret = conf.get(options.S3_ACCESS_KEY), conf.get(options.S3_SECRET_KEY)
    if bool(key) != bool(secret):
        raise ConfigError(
            "s3.access-key and s3.secret-key must be set together; or leave both unset to use "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the AWS credential chain"
        )
    region = conf.get(options.S3_REGION) or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    config_kwargs: dict[str, Any] = {"retries": {"mode": "standard", "max_attempts": 3}}
    if conf.get(options.S3_PATH_STYLE):
        config_kwargs["s3"] = {"addressing_style": "path"}
    opts: dict[str, Any] = {
        # A private instance whose listings are never cached: another process (a TaskManager,
        # the JobManager) may have written since, and a stale listing would hide its files.
        "skip_instance_cache": True,
        "use_listings_cache": False,
        "config_kwargs": config_kwargs,
        "client_kwargs": {"region_name": region} if region else {},
    }
    if endpoint:
        opts["endpoint_url"] = endpoint
    if key:
        opts["key"], opts["secret"] = key, secret
    return opts


def _single_attempt(fs: s3fs.S3FileSystem) -> s3fs.S3FileSystem:
    # s3fs's retry loop (5 attempts, fixed sleeps) would multiply botocore's and ours.
    fs.retries = 1
    return fs


class S3Storage(FsspecStorage):
    """``s3://bucket/key`` (also ``s3a://`` and ``s3n://``, as Flink and Hadoop users write them)."""

    def __init__(
        self,
        s3_options: Mapping[str, Any] | None = None,
        *,
        fs: s3fs.S3FileSystem | None = None,
        retry: RetryPolicy | None = None,
        waiter: Waiter | None = None,
    ) -> None:
        super().__init__(retry=retry, waiter=waiter)
        if s3_options is not None:
            self._options = dict(s3_options)
        else:
            self._options = {} if fs is not None else s3fs_options()
        self._fs = _single_attempt(fs) if fs is not None else None
        self._fs_lock = threading.Lock()

    @classmethod
    def from_url(
        cls,
        url: str,
        config: Configuration | None = None,
        *,
        retry: RetryPolicy | None = None,
        waiter: Waiter | None = None,
    ) -> S3Storage:
        """Storage for ``s3://`` URLs from Flink's ``s3.*`` keys and the AWS environment; makes no network call."""
        return cls(s3fs_options(config), retry=retry, waiter=waiter)

    @property
    def fs(self) -> s3fs.S3FileSystem:
        """The s3fs file system, built on first use (reads credentials, no network); thread-safe."""
        # Built on first use: creating the client reads credentials but needs no network.
        with self._fs_lock:
            if self._fs is None:
                self._fs = _single_attempt(s3fs.S3FileSystem(**self._options))
            return self._fs

    def __repr__(self) -> str:
        return f"S3Storage(endpoint={self._options.get('endpoint_url') or 'AWS'})"

    def _split(self, url: str) -> tuple[str, str]:
        scheme, sep, rest = url.partition("://")
        if not sep or scheme.lower() not in SCHEMES:
            raise InvalidArgumentError(f"{url!r} is not an S3 URL; S3 storage serves s3://bucket/key")
        if not rest.split("/", 1)[0]:
            raise InvalidArgumentError(f"{url!r} names no bucket; use s3://bucket/path")
        return f"{scheme}://", rest

    def _write(self, fs_path: str, data: bytes) -> None:
        self.fs.pipe_file(fs_path, data)

    def _create_exclusive(self, fs_path: str, data: bytes) -> None:
        self.fs.pipe_file(fs_path, data, mode="create")

    def _upload(self, local_path: str, fs_path: str) -> None:
        self.fs.put_file(local_path, fs_path)
        self.fs.invalidate_cache(fs_path)

    def makedirs(self, path: str) -> None:
        """Nothing to do: S3 has no directories, and s3fs would create a missing bucket instead."""
        self._split(path)

    def delete_dir(self, path: str) -> None:
        """Delete every object under the prefix ``path`` in bulk requests of 1000 keys.

        Unlike ``fs.rm(recursive=True)``: a bucket root is refused (InvalidArgumentError), glob
        characters in keys are taken literally, and a key that fails to delete raises.
        """
        # Not fs.rm(recursive=True): on a bucket root it deletes the bucket, it expands glob
        # characters in keys, and its bulk delete ignores per-key errors.
        _, p = self._split(path)
        self._refuse_root(path, p.partition("/")[2])
        bucket = p.partition("/")[0]

        def remove_tree() -> None:
            try:
                found = self.fs.find(p)
            except FileNotFoundError:
                return
            keys = [name.partition("/")[2] for name in found]
            for i in range(0, len(keys), 1000):
                batch = keys[i : i + 1000]
                answer = self.fs.call_s3(
                    "delete_objects", Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )
                failed = answer.get("Errors") or []
                if failed:
                    codes = {e.get("Code", "") for e in failed}
                    detail = ", ".join(f"{e.get('Key')}: {e.get('Code')}" for e in failed[:5])
                    if codes <= _THROTTLE_CODES:
                        raise OSError(errno.EBUSY, f"{len(failed)} objects not deleted ({detail})")
                    raise OSError(errno.EIO, f"{len(failed)} objects not deleted ({detail})")
            self.fs.invalidate_cache(p)

        self._call("delete", path, remove_tree)

    def _is_transient(self, exc: BaseException) -> bool:
        if is_transient_os_error(exc) or isinstance(exc, _NETWORK_ERRORS):
            return True
        response = getattr(exc, "response", None)
        if isinstance(response, Mapping):  # an untranslated botocore ClientError
            code = str(response.get("Error", {}).get("Code", ""))
            status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            return code in _THROTTLE_CODES or status >= 500
        return False

    def _hint(self, exc: BaseException) -> str:
        from botocore import exceptions as bx

        if isinstance(exc, (bx.NoCredentialsError, bx.PartialCredentialsError)):
            return (
                "no S3 credentials found; set s3.access-key and s3.secret-key, or AWS_ACCESS_KEY_ID "
                "and AWS_SECRET_ACCESS_KEY, or give this host an IAM role"
            )
        if isinstance(exc, PermissionError):
            return "S3 denied access; check the credentials (s3.access-key / AWS_ACCESS_KEY_ID) and the bucket policy"
        if isinstance(exc, (*_NETWORK_ERRORS, ConnectionError, TimeoutError)):
            endpoint = (
                self._options.get("endpoint_url") or getattr(self._fs, "endpoint_url", None) or "the AWS S3 endpoint"
            )
            return f"cannot reach {endpoint}; check s3.endpoint (or AWS_ENDPOINT_URL) and the network"
        if isinstance(exc, OSError) and exc.errno == errno.EBUSY:
            return "S3 kept throttling (SlowDown/503); spread checkpoints out or raise the request-rate limits"
        return "check the S3 endpoint, bucket and credentials (s3.* configuration keys)"

    def _missing_parent_message(self, url: str) -> str:
        bucket = self._split(url)[1].partition("/")[0]
        return (
            f"cannot write {url}: bucket {bucket!r} does not exist or is not visible with these credentials; "
            f"create the bucket or fix the path (state.checkpoints.dir)"
        )
