"""Server-side RPC latency: a real gRPC server, every call observed in seconds with its status code."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from keyedstate.common.rpc.server_metrics import RpcLatencyInterceptor

SERVICE = "test.Echo"
NAME = "keyedstate_taskmanager_rpc_server_handling_seconds"


def _identity(b: bytes) -> bytes:
    return b


def _ok(request: bytes, context: grpc.ServicerContext) -> bytes:
    time.sleep(0.05)
    return request


def _not_found(request: bytes, context: grpc.ServicerContext) -> bytes:
    context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")
    raise AssertionError("abort raises")


def _crash(request: bytes, context: grpc.ServicerContext) -> bytes:
    raise RuntimeError("bug")


def _stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    for _ in range(3):
        time.sleep(0.02)
        yield request


@pytest.fixture
def served() -> Iterator[tuple[grpc.Channel, CollectorRegistry]]:
    registry = CollectorRegistry()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4), interceptors=[RpcLatencyInterceptor(registry, "taskmanager")]
    )
    handlers: dict[str, Any] = {
        "Ok": grpc.unary_unary_rpc_method_handler(_ok, _identity, _identity),
        "NotFound": grpc.unary_unary_rpc_method_handler(_not_found, _identity, _identity),
        "Crash": grpc.unary_unary_rpc_method_handler(_crash, _identity, _identity),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream, _identity, _identity),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel, registry
    finally:
        channel.close()
        server.stop(0)


def _count(registry: CollectorRegistry, method: str, code: str) -> float | None:
    labels = {"grpc_service": SERVICE, "grpc_method": method, "grpc_code": code}
    return registry.get_sample_value(NAME + "_count", labels)


def _sum(registry: CollectorRegistry, method: str, code: str) -> float:
    labels = {"grpc_service": SERVICE, "grpc_method": method, "grpc_code": code}
    return registry.get_sample_value(NAME + "_sum", labels) or 0.0


def test_each_call_is_observed_in_seconds_by_method_and_code(served: tuple[grpc.Channel, CollectorRegistry]) -> None:
    channel, registry = served

    def unary(method: str) -> Any:
        return channel.unary_unary(f"/{SERVICE}/{method}")

    for _ in range(2):
        assert unary("Ok")(b"x", timeout=10) == b"x"
    for method, code in (("NotFound", grpc.StatusCode.NOT_FOUND), ("Crash", grpc.StatusCode.UNKNOWN)):
        with pytest.raises(grpc.RpcError) as info:
            unary(method)(b"x", timeout=10)
        assert info.value.code() is code
    stream: Any = channel.unary_stream(f"/{SERVICE}/Stream")
    assert list(stream(b"y", timeout=10)) == [b"y"] * 3

    assert _count(registry, "Ok", "OK") == 2
    # Seconds, not milliseconds: two calls of 50 ms each.
    assert 0.09 <= _sum(registry, "Ok", "OK") < 5
    assert _count(registry, "NotFound", "NOT_FOUND") == 1
    assert _count(registry, "Crash", "UNKNOWN") == 1
    assert _count(registry, "Ok", "UNKNOWN") is None
    # A streamed call is timed to its last message.
    assert _count(registry, "Stream", "OK") == 1
    assert _sum(registry, "Stream", "OK") >= 0.05
