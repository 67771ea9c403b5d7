"""One grpc.health.v1 check of a daemon's port: what probes and `statectl health` ask.

Here, not in the client package, so that a probe run every few seconds imports gRPC and the TLS
settings only (the client package loads numpy and pyarrow for its columnar wire).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from keyedstate.common.errors import UnavailableError
from keyedstate.common.rpc.channels import open_channel
from keyedstate.common.rpc.status import from_rpc_error
from keyedstate.common.security.tls import ChannelSecurity


def check_health(
    address: str, *, service: str = "", security: ChannelSecurity | None = None, timeout_s: float = 5.0
) -> str:
    """The health status of ``service`` ("" = the whole daemon) at ``address``: ``SERVING``, ``NOT_SERVING``, ...

    One call, not retried: a probe asks again on its own period. Health needs no token (the
    daemons allow it without an identity); with ``security`` the call speaks TLS. Fails fast
    when the port refuses connections. Raises UnavailableError when nothing answers within
    ``timeout_s``, another KeyedStateError when the
    port answers with an error (an unknown ``service`` is NotFound).
    """
    channel = open_channel(address, private=True, security=security)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s, wait_for_ready=False
        )
    except grpc.RpcError as err:
        error = from_rpc_error(err, f"health check of {address}")
        if isinstance(error, UnavailableError):
            raise UnavailableError(f"no daemon answers health checks at {address}: {error.message}") from None
        raise error from None
    finally:
        channel.close()
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
