"""Requests that do not parse are refused as INVALID_ARGUMENT, like any other bad input.

gRPC's Python server answers a request body that is not a valid protobuf of the method's
request type (truncated, corrupted, a string field that is not UTF-8) with INTERNAL
"Exception deserializing request!", which reads as a server bug. The interceptor installed by
:func:`keyedstate.common.rpc.channels.create_server` decodes the body itself and answers
INVALID_ARGUMENT with the usual reason trailer and a message naming the fix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, cast

import grpc
from google.protobuf.message import DecodeError

from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.rpc.interceptors import HandlerWrappingInterceptor
from keyedstate.common.rpc.status import abort_with

logger = logging.getLogger(__name__)


class _Handler(Protocol):
    """The fields of a method handler read here (grpc declares them on its namedtuple, not on the base class)."""

    request_streaming: bool
    response_streaming: bool
    request_deserializer: Callable[[bytes], Any] | None
    response_serializer: Callable[[Any], bytes] | None
    unary_unary: Callable[[Any, grpc.ServicerContext], Any]
    unary_stream: Callable[[Any, grpc.ServicerContext], Any]


class _Malformed:
    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(body: bytes) -> Any:
        try:
            return deserializer(body)
        except (DecodeError, ValueError, TypeError) as exc:
            return _Malformed(exc)

    return decode


def _refuse(method: str, malformed: _Malformed, context: grpc.ServicerContext) -> None:
    abort_with(
        context,
        InvalidArgumentError(
            f"the request to {method} is not a valid protobuf message of its request type ({malformed.error}); "
            "send a message built with the keyedstate.v1 protocol (the client library or the generated stubs)"
        ),
    )


class MalformedRequestInterceptor(HandlerWrappingInterceptor):
    """Wraps unary-request handlers so a body that does not decode is INVALID_ARGUMENT, not INTERNAL."""

    def wraps(self, handler: grpc.RpcMethodHandler[Any, Any]) -> bool:
        """Only methods with a single request message are wrapped; streamed requests pass through."""
        return not cast(_Handler, handler).request_streaming

    def wrap(self, method: str, rpc_handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        """The handler with a lenient request deserializer: a body that does not parse is refused as
        INVALID_ARGUMENT naming the method, before the servicer runs.
        """
        handler = cast(_Handler, rpc_handler)
        wrapped: grpc.RpcMethodHandler[Any, Any]
        if handler.response_streaming:
            inner_stream = handler.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Any:
                if isinstance(request, _Malformed):
                    _refuse(method, request, context)
                return inner_stream(request, context)

            wrapped = grpc.unary_stream_rpc_method_handler(
                unary_stream,
                request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
            return wrapped
        inner = handler.unary_unary

        def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                _refuse(method, request, context)
            return inner(request, context)

        wrapped = grpc.unary_unary_rpc_method_handler(
            unary_unary,
            request_deserializer=_lenient(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
        return wrapped
