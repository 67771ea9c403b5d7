"""Prometheus metrics: one registry per daemon, served over HTTP on a configured port or range."""

from __future__ import annotations

import errno
import logging
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from keyedstate.common.errors import ConfigError

logger = logging.getLogger(__name__)


class MetricsServer:
    """Serves ``registry`` on the first free port of ``port_range`` (``(-1, -1)`` disables it)."""

    def __init__(self, registry: CollectorRegistry, port_range: tuple[int, int], host: str = "0.0.0.0") -> None:
        self.registry = registry
        self.port: int | None = None
        self._server: Any = None
        self._thread: Any = None
        low, high = port_range
        if low < 0:
            return
        last: OSError | None = None
        for port in range(low, high + 1):
            try:
                self._server, self._thread = start_http_server(port, addr=host, registry=registry)
                self.port = self._server.server_port
                logger.info("metrics: serving Prometheus metrics on %s:%d/metrics", host, self.port)
                return
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from exc
                last = exc
        raise ConfigError(
            f"every port of metrics.reporter.prom.port {low}-{high} is in use; widen the range or use 0"
        ) from last

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
