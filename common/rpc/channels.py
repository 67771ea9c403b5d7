"""gRPC channels and servers with the options every component shares."""

from __future__ import annotations

import errno
import logging
import socket
from concurrent import futures
from typing import Sequence

import grpc

from keyedstate.common.errors import ConfigError, UnavailableError

logger = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE = 256 << 20


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Notice a dead peer (kill -9, cable pulled) within seconds, not at the TCP timeout.
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Reconnect fast after a peer restarts (the default backoff grows to 2 minutes).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_ping_strikes", 0),
        # A second process must not silently share the port (SO_REUSEPORT would allow it).
        ("grpc.so_reuseport", 0),
    ]


def open_channel(
    address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE, *, private: bool = False, token: str | None = None
) -> grpc.Channel:
    """A channel to ``address``.

    ``private``: do not share connections with other channels to the same address. gRPC pools
    subchannels process-wide; a channel to a dead process that is backing off its reconnects
    would then fail the first calls of a fresh channel to a new process on the same port.
    ``token``: sent with every call as ``authorization: Bearer <token>`` (security.auth.enabled).
    """
    options = channel_options(max_message_bytes)
    if private:
        options = [*options, ("grpc.use_local_subchannel_pool", 1)]
    channel = grpc.insecure_channel(address, options=options)
    if token is None:
        return channel
    from keyedstate.common.auth import BearerTokenInterceptor

    return grpc.intercept_channel(channel, BearerTokenInterceptor(token))


def create_server(
    bind_host: str, port: int, *, threads: int, max_message_bytes: int, what: str, port_key: str,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
) -> tuple[grpc.Server, int]:
    """Create and bind a server; a taken or unbindable port is a ConfigError naming the key.

    ``interceptors`` run on every call of this server (authentication and authorization of its plane).
    """
    if port:
        _check_port_free(bind_host, port, what, port_key)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"{what}-rpc"),
        options=server_options(max_message_bytes),
        maximum_concurrent_rpcs=threads * 64,
        interceptors=list(interceptors) or None,
    )
    try:
        bound = server.add_insecure_port(f"{_bracket(bind_host)}:{port}")
    except RuntimeError as exc:
        raise ConfigError(
            f"{what} cannot listen on {bind_host}:{port} ({exc}); choose a free port with {port_key} (0 picks any)"
        ) from exc
    if bound == 0:
        raise ConfigError(f"{what} cannot listen on {bind_host}:{port}; choose a free port with {port_key} (0 picks any)")
    return server, bound


def _check_port_free(host: str, port: int, what: str, port_key: str) -> None:
    # grpc's own bind error says only "Failed to bind"; probe first to name the cause.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As gRPC does: without SO_REUSEADDR the connections a killed predecessor left in
        # TIME_WAIT would block a restart on the same port; a live listener still fails the bind.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"{what} port {port} on {host} is already in use; stop the other process or set {port_key} "
                    "to a free port (0 picks any)"
                ) from exc
            raise ConfigError(f"{what} cannot bind {host}:{port}: {exc.strerror}; check {port_key} and the bind host") from exc


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def wait_ready(channel: grpc.Channel, timeout_s: float, what: str) -> None:
    ready = grpc.channel_ready_future(channel)
    try:
        ready.result(timeout=timeout_s)
    except grpc.FutureTimeoutError as exc:
        raise UnavailableError(f"{what} did not answer within {timeout_s:.0f} s") from exc
    finally:
        # A pending ready-future keeps the channel subscribed; once the channel is closed,
        # gRPC's connectivity poller would fail in its thread ("Channel closed!").
        ready.cancel()
