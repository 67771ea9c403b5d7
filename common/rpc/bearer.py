"""The bearer token on the wire: the ``authorization`` metadata a client sends with every call.

Below ``auth`` (which decides who a token is and what it may do), so that opening a channel
(``rpc.channels``) needs nothing of the authorization layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import grpc

from keyedstate.common.errors import ConfigError

AUTHORIZATION = "authorization"
BEARER = "Bearer "


def check_token(token: str, where: str) -> str:
    if not token:
        raise ConfigError(f"{where} is empty; it must hold the token")
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        raise ConfigError(f"{where} holds more than one token-like word or non-ASCII text; it must hold only the token")
    return token


class _CallDetails(Protocol):
    """What an interceptor reads of a call's details (the grpc base class declares no attributes)."""

    method: str
    timeout: float | None
    metadata: Sequence[tuple[str, str | bytes]] | None
    credentials: grpc.CallCredentials | None


class _Details(grpc.ClientCallDetails):
    def __init__(self, details: _CallDetails, metadata: list[tuple[str, str | bytes]]) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = tuple(metadata)
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class BearerTokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to every call of a channel."""

    def __init__(self, token: str) -> None:
        self._header = (AUTHORIZATION, BEARER + check_token(token, "the token"))

    def __repr__(self) -> str:  # never show the token
        return "BearerTokenInterceptor(<token>)"

    def _details(self, details: _CallDetails) -> grpc.ClientCallDetails:
        metadata = [m for m in (details.metadata or ()) if m[0] != AUTHORIZATION]
        metadata.append(self._header)
        return _Details(details, metadata)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        """Continue the call with ``authorization: Bearer <token>`` added to its metadata."""
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        """Continue the call with ``authorization: Bearer <token>`` added to its metadata."""
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        """Continue the call with ``authorization: Bearer <token>`` added to its metadata."""
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        """Continue the call with ``authorization: Bearer <token>`` added to its metadata."""
        return continuation(self._details(details), request_iterator)
