"""Server-side RPC latency: a histogram in seconds per service, method and status code, for each daemon.

The interceptor is the outermost of a served plane, so the time counted is what the caller's
call spent in the server: authentication, request decoding and the servicer, refusals included.
Labels follow go-grpc-prometheus (``grpc_service``, ``grpc_method``, ``grpc_code``), which
existing gRPC dashboards already use.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Histogram

from keyedstate.common.metrics import MetricKind, MetricSpec, Unit
from keyedstate.common.rpc.interceptors import HandlerWrappingInterceptor

# From 100 µs (a cached point read) to 60 s (a savepoint or a restore waiting on storage).
LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
)
_LABELS = ("grpc_service", "grpc_method", "grpc_code")


def rpc_latency_spec(component: str) -> MetricSpec:
    """The latency histogram of ``component`` (``jobmanager`` or ``taskmanager``)."""
    return MetricSpec(
        f"keyedstate_{component}_rpc_server_handling_seconds",
        MetricKind.HISTOGRAM,
        Unit.SECONDS,
        "Time from a call's arrival to its response (the last message of a streamed one), by service, method and "
        "gRPC status code.",
        _LABELS,
        LATENCY_BUCKETS,
    )


class RpcLatencyInterceptor(HandlerWrappingInterceptor):
    """Observes every call's duration into ``keyedstate_<component>_rpc_server_handling_seconds``."""

    def __init__(self, registry: CollectorRegistry, component: str) -> None:
        super().__init__()
        self._histogram: Histogram = rpc_latency_spec(component).histogram(registry)

    def wrap(self, method: str, handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        """The handler timed: unary responses when returned, streamed ones when the stream ends."""
        service, _, name = method.lstrip("/").rpartition("/")
        observe = self._observer(service, name)
        h: Any = handler
        if h.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _timed_unary(h.unary_unary, observe), h.request_deserializer, h.response_serializer
            )
        if h.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                _timed_unary(h.stream_unary, observe), h.request_deserializer, h.response_serializer
            )
        inner_stream = h.unary_stream if h.unary_stream is not None else h.stream_stream
        timed = _timed_stream(inner_stream, observe)
        if h.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(timed, h.request_deserializer, h.response_serializer)
        return grpc.stream_stream_rpc_method_handler(timed, h.request_deserializer, h.response_serializer)

    def _observer(self, service: str, method: str) -> Callable[[float, grpc.ServicerContext, bool], None]:
        children: dict[str, Any] = {}

        def observe(started: float, context: grpc.ServicerContext, raised: bool) -> None:
            # perf_counter, not the injected clock: the clock counts milliseconds, and most calls take less.
            elapsed = time.perf_counter() - started
            # Set by abort() or set_code(); None means the servicer did not say. (grpc-stubs lacks code().)
            code = getattr(context, "code", lambda: None)()
            label = code.name if isinstance(code, grpc.StatusCode) else ("UNKNOWN" if raised else "OK")
            child = children.get(label)
            if child is None:
                child = children[label] = self._histogram.labels(service, method, label)
            child.observe(elapsed)

        return observe


def _timed_unary(
    inner: Callable[[Any, grpc.ServicerContext], Any], observe: Callable[[float, grpc.ServicerContext, bool], None]
) -> Callable[[Any, grpc.ServicerContext], Any]:
    def call(request: Any, context: grpc.ServicerContext) -> Any:
        started = time.perf_counter()
        raised = True
        try:
            response = inner(request, context)
            raised = False
            return response
        finally:
            observe(started, context, raised)

    return call


def _timed_stream(
    inner: Callable[[Any, grpc.ServicerContext], Iterator[Any]],
    observe: Callable[[float, grpc.ServicerContext, bool], None],
) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
    def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        started = time.perf_counter()
        raised = True
        try:
            yield from inner(request, context)
            raised = False
        finally:
            observe(started, context, raised)

    return call
