"""Prometheus metrics: one registry per daemon, served over HTTP(S) on a configured port or range.

With TLS on the rest plane the endpoint serves HTTPS with security.ssl.rest.cert (and requires
a client certificate with security.ssl.rest.authentication-enabled). Each connection is wrapped
with the context current at accept time, so a rotated certificate applies to the next scrape.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from keyedstate.common.errors import ConfigError
from keyedstate.common.security.transport import HttpTls

logger = logging.getLogger(__name__)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


def _server_class(host: str, tls: HttpTls | None) -> type[ThreadingWSGIServer]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    class Server(ThreadingWSGIServer):
        address_family = family

        def get_request(self) -> tuple[socket.socket, Any]:
            """Accept a connection, wrapped in TLS when configured; the handshake runs later, in the request's thread."""
            sock, addr = super().get_request()
            if tls is None:
                return sock, addr
            # The handshake runs on first read, in the request's own thread: a slow or broken
            # client cannot stall the accept loop.
            return tls.context().wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

        def handle_error(self, request: Any, client_address: Any) -> None:
            """Log the failure at debug level instead of printing a traceback to stderr, as socketserver would."""
            # A scraper without a valid client certificate fails its handshake: not a server error.
            logger.debug("metrics: request from %s failed", client_address, exc_info=True)

    return Server


class MetricsServer:
    """Serves ``registry`` on the first free port of ``port_range`` (``(-1, -1)`` disables it)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        port_range: tuple[int, int],
        host: str = "0.0.0.0",
        tls: HttpTls | None = None,
    ) -> None:
        self.registry = registry
        self.port: int | None = None
        self.scheme = "https" if tls is not None else "http"
        self._server: Any = None
        self._thread: Any = None
        low, high = port_range
        if low < 0:
            return
        if tls is not None:
            tls.context()  # a certificate the ssl module cannot load fails the start, not the first scrape
        app = make_wsgi_app(registry)
        last: OSError | None = None
        for port in range(low, high + 1):
            try:
                self._server = make_server(host, port, app, _server_class(host, tls), handler_class=_QuietHandler)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from exc
                last = exc
                continue
            self.port = self._server.server_port
            self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
            self._thread.start()
            logger.info("metrics: serving Prometheus metrics on %s://%s:%d/metrics", self.scheme, host, self.port)
            return
        raise ConfigError(
            f"every port of metrics.reporter.prom.port {low}-{high} is in use; widen the range or use 0"
        ) from last

    def close(self) -> None:
        """Stop serving and free the port; a no-op when already closed."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
