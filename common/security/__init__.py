"""Transport security: TLS per plane (internal, rest), certificate reloading, protected mode."""

from keyedstate.common.security.tls import INTERNAL, REST, ChannelSecurity, handshake_hint
from keyedstate.common.security.transport import TransportSecurity, internal_plane_separate, jobmanager_internal_port

__all__ = [
    "INTERNAL",
    "REST",
    "ChannelSecurity",
    "TransportSecurity",
    "handshake_hint",
    "internal_plane_separate",
    "jobmanager_internal_port",
]
