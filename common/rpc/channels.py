"""gRPC channels and servers with the options every component shares."""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc

from keyedstate.common.errors import ConfigError, UnavailableError
from keyedstate.common.rpc.bearer import BearerTokenInterceptor
from keyedstate.common.rpc.decoding import MalformedRequestInterceptor
from keyedstate.common.security.tls import ChannelSecurity

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
    address: str,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE,
    *,
    private: bool = False,
    security: ChannelSecurity | None = None,
    token: str | None = None,
) -> grpc.Channel:
    """A channel to ``address``; TLS with ``security`` (None: plaintext).

    ``private``: do not share connections with other channels to the same address. gRPC pools
    subchannels process-wide; a channel to a dead process that is backing off its reconnects
    would then fail the first calls of a fresh channel to a new process on the same port.

    A TLS channel rebuilds itself with the current certificate files after they changed (a
    gRPC channel keeps the credentials it was made with for every reconnect), so a long-lived
    client follows a rotation of its own certificate or of the CA it trusts.

    ``token``: sent with every call as ``authorization: Bearer <token>`` (security.auth.enabled).
    """
    options = channel_options(max_message_bytes)
    if private:
        options = [*options, ("grpc.use_local_subchannel_pool", 1)]
    if security is None:
        channel: grpc.Channel = grpc.insecure_channel(address, options=options)
    else:
        channel = ReloadingChannel(
            lambda: grpc.secure_channel(address, security.credentials(), options=[*options, *security.options()]),
            lambda: security.generation,
        )
    if token is None:
        return channel
    intercepted: grpc.Channel = grpc.intercept_channel(channel, BearerTokenInterceptor(token))
    return intercepted


class ReloadingChannel(grpc.Channel):
    """A channel that swaps in a new inner channel when its credentials' generation changes.

    Stubs bind multi-callables at construction, so the ones handed out here resolve the current
    inner channel on every call (a cached lookup). The replaced channel is closed after a grace
    period, so calls in flight on it finish; subscriptions move to the new channel.
    """

    RETIRE_AFTER_S = 120.0

    def __init__(self, make: Callable[[], grpc.Channel], generation: Callable[[], int]) -> None:
        self._make = make
        self._generation_of = generation
        self._lock = threading.Lock()
        self._generation = generation()
        self._channel = make()
        self._subscriptions: list[tuple[Callable[[grpc.ChannelConnectivity], None], bool]] = []
        self._closed = False

    def current(self) -> grpc.Channel:
        """The inner channel for the current credentials, rebuilt first if their generation changed.

        Thread-safe; the replaced channel is closed after :attr:`RETIRE_AFTER_S` seconds.
        """
        generation = self._generation_of()
        if generation == self._generation or self._closed:
            return self._channel
        with self._lock:
            if generation != self._generation and not self._closed:
                old = self._channel
                self._channel = self._make()
                self._generation = generation
                for callback, connect in self._subscriptions:
                    old.unsubscribe(callback)
                    self._channel.subscribe(callback, try_to_connect=connect)
                logger.info(
                    "tls: certificates changed; new connections use them (old channel closes in %.0f s)",
                    self.RETIRE_AFTER_S,
                )
                timer = threading.Timer(self.RETIRE_AFTER_S, old.close)
                timer.daemon = True
                timer.start()
            return self._channel

    def subscribe(self, callback: Callable[[grpc.ChannelConnectivity], None], try_to_connect: bool = False) -> None:
        """As ``grpc.Channel.subscribe``; the subscription moves to every replacement channel."""
        with self._lock:
            self._subscriptions.append((callback, try_to_connect))
            self._channel.subscribe(callback, try_to_connect=try_to_connect)

    def unsubscribe(self, callback: Callable[[grpc.ChannelConnectivity], None]) -> None:
        """As ``grpc.Channel.unsubscribe``; the callback no longer follows replacement channels either."""
        with self._lock:
            self._subscriptions = [s for s in self._subscriptions if s[0] is not callback]
            self._channel.unsubscribe(callback)

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A multi-callable that resolves the current inner channel on every call (stubs survive a rotation)."""
        return _DynamicCallable(self, "unary_unary", method, args, kwargs)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A multi-callable that resolves the current inner channel on every call (stubs survive a rotation)."""
        return _DynamicCallable(self, "unary_stream", method, args, kwargs)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A multi-callable that resolves the current inner channel on every call (stubs survive a rotation)."""
        return _DynamicCallable(self, "stream_unary", method, args, kwargs)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A multi-callable that resolves the current inner channel on every call (stubs survive a rotation)."""
        return _DynamicCallable(self, "stream_stream", method, args, kwargs)

    def close(self) -> None:
        """Close the current inner channel and stop replacing it; retired channels close on their own timers."""
        with self._lock:
            self._closed = True
            self._channel.close()

    def __enter__(self) -> ReloadingChannel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _DynamicCallable:
    """A multi-callable of whichever inner channel is current (rebuilt after a swap)."""

    def __init__(
        self, owner: ReloadingChannel, kind: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self._owner = owner
        self._factory = (kind, method, args, kwargs)
        self._bound: tuple[grpc.Channel, Any] | None = None

    def _target(self) -> Any:
        channel = self._owner.current()
        bound = self._bound
        if bound is None or bound[0] is not channel:
            kind, method, args, kwargs = self._factory
            bound = (channel, getattr(channel, kind)(method, *args, **kwargs))
            self._bound = bound
        return bound[1]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._target()(*args, **kwargs)

    def with_call(self, *args: Any, **kwargs: Any) -> Any:
        return self._target().with_call(*args, **kwargs)

    def future(self, *args: Any, **kwargs: Any) -> Any:
        return self._target().future(*args, **kwargs)


def create_server(
    bind_host: str,
    port: int,
    *,
    threads: int,
    max_message_bytes: int,
    what: str,
    port_key: str,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
) -> tuple[grpc.Server, int]:
    """Create and bind a server; a taken or unbindable port is a ConfigError naming the key.

    ``credentials``: TLS (see TransportSecurity.server_credentials); None serves plaintext.
    ``interceptors`` run on every call of this server, so each plane can get its own (the
    authentication layer reads the peer certificate through ``context.auth_context()``).
    """
    if port:
        _check_port_free(bind_host, port, what, port_key)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"{what}-rpc"),
        options=server_options(max_message_bytes),
        maximum_concurrent_rpcs=threads * 64,
        # Innermost: the plane's own interceptors (authentication) see a call first.
        interceptors=[*interceptors, MalformedRequestInterceptor()],
    )
    address = f"{_bracket(bind_host)}:{port}"
    try:
        bound = (
            server.add_secure_port(address, credentials)
            if credentials is not None
            else server.add_insecure_port(address)
        )
    except RuntimeError as exc:
        raise ConfigError(
            f"{what} cannot listen on {bind_host}:{port} ({exc}); choose a free port with {port_key} (0 picks any)"
        ) from exc
    if bound == 0:
        raise ConfigError(
            f"{what} cannot listen on {bind_host}:{port}; choose a free port with {port_key} (0 picks any)"
        )
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
            raise ConfigError(
                f"{what} cannot bind {host}:{port}: {exc.strerror}; check {port_key} and the bind host"
            ) from exc


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
