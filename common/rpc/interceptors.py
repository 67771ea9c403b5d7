"""The shape every server interceptor of the runtime shares: replace a method's handler by a wrapped one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc


class HandlerWrappingInterceptor(grpc.ServerInterceptor):
    """A server interceptor that wraps each method's handler, building the wrapper once per method.

    A server's handlers do not change, so the wrapper built for a method is reused for as long
    as gRPC hands out the same handler (a plain dict: two threads racing build two equal
    wrappers, one of which is kept). Subclasses say which handlers they wrap and how.
    """

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler[Any, Any], grpc.RpcMethodHandler[Any, Any]]] = {}

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        """gRPC's hook: the wrapped handler for the call's method, built on first use and then reused.

        Handlers that :meth:`wraps` declines, and unknown methods (None), pass through unchanged.
        """
        handler = continuation(details)
        if handler is None or not self.wraps(handler):
            return handler  # None: UNIMPLEMENTED, as without the interceptor
        method = details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self.wrap(method, handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def wraps(self, handler: grpc.RpcMethodHandler[Any, Any]) -> bool:
        """Whether ``handler`` is one this interceptor wraps (default: all)."""
        return True

    def wrap(self, method: str, handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        """The handler to serve ``method`` with instead of ``handler``."""
        raise NotImplementedError
