"""Threaded WSGI serving over optional TLS: the metrics endpoint and the JobManager's REST API.

Both serve with wsgiref's threading server (prometheus_client's ``ThreadingWSGIServer``): every
request runs on its own daemon thread, so a slow or stalled client holds only its own thread. With
TLS each accepted connection is wrapped with the context current at accept time (a rotated
certificate applies to the next connection), and the handshake runs on the first read, in the
request's thread, never in the accept loop.
"""

from __future__ import annotations

import logging
import socket
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client.exposition import ThreadingWSGIServer

from keyedstate.common.security.transport import HttpTls

logger = logging.getLogger(__name__)


def wsgi_server_class(host: str, tls: HttpTls | None, what: str) -> type[WSGIServer]:
    """The server class for ``make_server`` on ``host`` (IPv4 or IPv6), TLS-wrapped with ``tls`` when given.

    ``what`` names the server in the debug line a failed request leaves.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    class Server(ThreadingWSGIServer):
        address_family = family

        def get_request(self) -> tuple[socket.socket, Any]:
            """Accept a connection, wrapped in TLS when configured; the handshake runs later, in the request's thread."""
            sock, addr = super().get_request()
            if tls is None:
                return sock, addr
            return tls.context().wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

        def handle_error(self, request: Any, client_address: Any) -> None:
            """Log the failure at debug level instead of printing a traceback to stderr, as socketserver would."""
            # A plain-HTTP client on a TLS port, or one without the client certificate, fails its
            # handshake: worth a debug line, not a server error.
            logger.debug("%s: request from %s failed", what, client_address, exc_info=True)

    return Server
