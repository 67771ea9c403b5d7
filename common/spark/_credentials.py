"""Credentials for Spark executors: a token file shipped with the application, never one in user code.

Two ways, both ending in a file on every executor that ``worker_client`` reads (docs/security.md,
"Identity and authorization"):

* ``spark-submit --files /secure/pipeline.token --conf spark.keyedstate.tokenFile=pipeline.token``:
  Spark ships the file; the driver reads the conf key and tells the tasks the file's name.
* ``KeyedStateRuntime(..., executor_token_file="/secure/pipeline.token")``: the driver ships it
  with ``SparkContext.addFile``.

On the executor the name is resolved with ``SparkFiles.get``. Only the file's *name* travels in
the task closure; the token itself moves through Spark's file distribution (enable
``spark.authenticate`` and ``spark.network.crypto.enabled`` where other users share the cluster).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from keyedstate.common.errors import ConfigError

logger = logging.getLogger(__name__)

TOKEN_FILE_CONF = "spark.keyedstate.tokenFile"
"""Spark conf key: the name (or path) of the token file shipped with ``--files`` for the executors."""

_lock = threading.Lock()
_shipped: dict[tuple[str, str], str] = {}


def ship_token_file(sc: Any, path: str) -> str:
    """Ship ``path`` to every executor of ``sc``'s application; returns the name tasks resolve it by."""
    if not os.path.isfile(path):
        raise ConfigError(
            f"executor token file {path} does not exist; write the executors' token (role writer) into it"
        )
    name = os.path.basename(path)
    key = (str(sc.applicationId), os.path.abspath(path))
    with _lock:
        if key not in _shipped:
            sc.addFile(os.path.abspath(path))
            _shipped[key] = name
            logger.info("shipped the executors' token file %s to Spark application %s", name, sc.applicationId)
    return name


def executor_token_name(spark: Any, executor_token_file: str | None) -> str | None:
    """The token file name the executors resolve: shipped now from ``executor_token_file``, else
    the one ``spark.keyedstate.tokenFile`` names (shipped with ``--files``); None without either."""
    if executor_token_file:
        return ship_token_file(spark.sparkContext, executor_token_file)
    try:
        configured = spark.conf.get(TOKEN_FILE_CONF, None)
    except Exception:  # a conf the session cannot read: as if unset
        configured = None
    return os.path.basename(configured) if configured else None


def spark_file(name: str) -> str:
    """The local path of a file shipped to this executor (``--files`` or ``addFile``)."""
    try:
        from pyspark import SparkFiles
    except ImportError:
        raise ConfigError(f"token file {name} is not a path here and pyspark is not importable to look it up") from None
    path = SparkFiles.get(name)
    if not os.path.exists(path):
        raise ConfigError(
            f"token file {name!r} was not shipped to this executor ({path} does not exist); ship it with "
            f"spark-submit --files /path/{name} (and --conf {TOKEN_FILE_CONF}={name}) or "
            "KeyedStateRuntime(executor_token_file=...)"
        )
    return path
