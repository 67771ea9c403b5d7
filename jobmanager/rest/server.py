"""The HTTP(S) server of ``rest.port``: one thread per request, TLS of the rest plane when it is on.

The threaded, optionally TLS-wrapped server of :mod:`keyedstate.common.http_server` (the one the
metrics endpoint uses) with the WSGI application of :mod:`.routes`: a slow browser holds only its
own thread and never a JobManager lock. With ``security.ssl.rest.authentication-enabled`` a client
certificate is required, as on the gRPC client plane.
"""

from __future__ import annotations

import errno
import logging
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from keyedstate.common.errors import ConfigError
from keyedstate.common.http_server import wsgi_server_class
from keyedstate.common.security.transport import HttpTls
from keyedstate.jobmanager.rest.routes import RestApi

logger = logging.getLogger(__name__)


class _Handler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        logger.debug("rest: %s %s", self.address_string(), format % args)


class RestServer:
    """Serves the REST API and web page on ``host:port`` (0: a free port, read back from ``port``)."""

    def __init__(self, api: RestApi, host: str, port: int, tls: HttpTls | None = None) -> None:
        self.scheme = "https" if tls is not None else "http"
        if tls is not None:
            tls.context()  # a certificate the ssl module cannot load fails the start, not the first request
        try:
            self._server = make_server(host, port, api, wsgi_server_class(host, tls, "rest"), handler_class=_Handler)
        except OSError as exc:
            hint = (
                "choose another rest.port or 0 for a free one" if exc.errno == errno.EADDRINUSE else "check rest.port"
            )
            raise ConfigError(f"cannot serve the REST API on {host}:{port}: {exc.strerror}; {hint}") from exc
        self.port: int = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="rest-http", daemon=True)

    def start(self) -> None:
        """Accept requests on a background thread."""
        self._thread.start()

    def close(self) -> None:
        """Stop accepting, free the port; requests under way finish on their own threads."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
