"""Transport security of one process: which plane uses TLS, with which files, and protected mode.

Built once from the Configuration (:meth:`TransportSecurity.from_config`), which loads and checks
every certificate the process will use, so a bad file stops a daemon at start-up with a message
naming the key. The daemons and clients take it as a collaborator and ask it for server
credentials (:meth:`server_credentials`) and channel security (:meth:`channel_security`) per plane.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import ssl
from dataclasses import dataclass

import grpc

from keyedstate.common.config import ConfigOption, Configuration
from keyedstate.common.config import options as o
from keyedstate.common.errors import ConfigError
from keyedstate.common.security.tls import (
    INTERNAL,
    REST,
    ChannelSecurity,
    PemFiles,
    PemMaterial,
    ReloadingMaterial,
    load_material,
    server_credentials,
)

logger = logging.getLogger(__name__)

DEFAULT_JOBMANAGER_INTERNAL_PORT = 6124


@dataclass(frozen=True)
class PlaneSettings:
    plane: str
    enabled: bool
    files: PemFiles
    server_name: str | None
    require_client_auth: bool
    """Servers of this plane require a client certificate issued by the plane's CA."""


def plane_settings(conf: Configuration) -> tuple[PlaneSettings, PlaneSettings]:
    both = conf.get(o.SSL_ENABLED)
    internal_on = conf.get(o.SSL_INTERNAL_ENABLED)
    rest_on = conf.get(o.SSL_REST_ENABLED)
    internal = PlaneSettings(
        INTERNAL,
        both if internal_on is None else internal_on,
        PemFiles(INTERNAL, conf.get(o.SSL_INTERNAL_CERT), conf.get(o.SSL_INTERNAL_KEY), conf.get(o.SSL_INTERNAL_CA)),
        conf.get(o.SSL_INTERNAL_SERVER_NAME),
        True,
    )
    rest = PlaneSettings(
        REST,
        both if rest_on is None else rest_on,
        PemFiles(REST, conf.get(o.SSL_REST_CERT), conf.get(o.SSL_REST_KEY), conf.get(o.SSL_REST_CA)),
        conf.get(o.SSL_REST_SERVER_NAME),
        conf.get(o.SSL_REST_AUTHENTICATION),
    )
    return internal, rest


def internal_plane_separate(conf: Configuration, port_option: ConfigOption[int] | None = None) -> bool:
    """Whether the internal services get their own server (and port) rather than sharing the client one.

    They do whenever TLS is on for either plane: a gRPC port either requires client certificates
    or does not ask for them, so mutual-TLS internal services and client services cannot share
    one; and with only the client plane on TLS, TaskManagers need no client-plane certificates.
    Setting the internal port asks for the separation with TLS off too.
    """
    internal, rest = plane_settings(conf)
    return internal.enabled or rest.enabled or (port_option is not None and conf.is_set(port_option))


def jobmanager_internal_port(conf: Configuration) -> int:
    """The port of the JobManager's internal services, as its TaskManagers must dial it."""
    if not internal_plane_separate(conf, o.JOBMANAGER_INTERNAL_PORT):
        client_port: int = conf.get(o.JOBMANAGER_PORT)
        return client_port
    port = conf.get(o.JOBMANAGER_INTERNAL_PORT)
    return DEFAULT_JOBMANAGER_INTERNAL_PORT if port is None else port


class TransportSecurity:
    """The TLS settings and live certificate material of one process (daemon or client)."""

    def __init__(
        self,
        internal: PlaneSettings,
        rest: PlaneSettings,
        *,
        auth_enabled: bool = False,
        protected_mode: bool = True,
        reload_interval_s: float = 1.0,
        role: str = "daemon",
    ) -> None:
        self.internal = internal
        self.rest = rest
        self.auth_enabled = auth_enabled
        self.protected_mode = protected_mode
        self.reload_interval_s = reload_interval_s
        self.role = role
        self._material: dict[str, ReloadingMaterial] = {}
        for plane in (internal, rest):
            if plane.enabled:
                self._material[plane.plane] = ReloadingMaterial(
                    plane.files, self._loader(plane), check_interval_s=reload_interval_s
                )
        if (
            role == "daemon"
            and internal.enabled
            and rest.enabled
            and internal.files.ca
            and internal.files.ca == rest.files.ca
        ):
            logger.warning(
                "tls: security.ssl.internal.ca and security.ssl.rest.ca are the same file: a client certificate of "
                "that CA can reach the internal services; give the internal plane a CA of its own (docs/security.md)"
            )

    def _loader(self, plane: PlaneSettings):  # type: ignore[no-untyped-def]
        if self.role == "daemon":
            need_identity, need_ca = True, plane.require_client_auth
            check_issuer = plane.plane == INTERNAL
        else:
            # A client: it trusts its CA file (default: the system's roots) and shows a
            # certificate when it has one; servers that require one refuse it otherwise.
            need_identity, need_ca, check_issuer = plane.require_client_auth, False, False
        return lambda: load_material(
            plane.files, need_identity=need_identity, need_ca=need_ca, check_issuer=check_issuer
        )

    @classmethod
    def from_config(cls, conf: Configuration, role: str = "daemon") -> TransportSecurity:
        """``role``: ``daemon`` (servers on both planes) or ``client`` (the rest plane's client side)."""
        internal, rest = plane_settings(conf)
        if role == "client":
            internal = PlaneSettings(INTERNAL, False, internal.files, None, True)
        return cls(
            internal,
            rest,
            auth_enabled=conf.get(o.AUTH_ENABLED),
            protected_mode=conf.get(o.PROTECTED_MODE),
            reload_interval_s=conf.get(o.SSL_RELOAD_INTERVAL) / 1000.0,
            role=role,
        )

    @classmethod
    def plaintext(cls) -> TransportSecurity:
        """No TLS on either plane, no authentication, no protected mode: for tests and local runs."""
        off = PemFiles(REST)
        return cls(
            PlaneSettings(INTERNAL, False, PemFiles(INTERNAL), None, True),
            PlaneSettings(REST, False, off, None, False),
            protected_mode=False,
        )

    def _plane(self, plane: str) -> PlaneSettings:
        return self.internal if plane == INTERNAL else self.rest

    def enabled(self, plane: str) -> bool:
        """True if TLS is on for ``plane`` (``internal`` or ``rest``)."""
        return self._plane(plane).enabled

    def material(self, plane: str) -> ReloadingMaterial | None:
        """The reloading PEM material of ``plane``; None when that plane has no TLS."""
        return self._material.get(plane)

    def server_credentials(self, plane: str) -> grpc.ServerCredentials | None:
        """None: plaintext. Else credentials that follow the certificate files."""
        material = self._material.get(plane)
        if material is None:
            return None
        return server_credentials(material, self._plane(plane).require_client_auth)

    def channel_security(self, plane: str) -> ChannelSecurity | None:
        """None: plaintext channels. Else the security new channels of this plane use."""
        material = self._material.get(plane)
        if material is None:
            return None
        return ChannelSecurity(material, self._plane(plane).server_name, plane=plane)

    def http_context(self) -> HttpTls | None:
        """TLS for HTTP endpoints (metrics): the rest plane's certificate."""
        material = self._material.get(REST)
        if material is None:
            return None
        return HttpTls(material, self.rest.require_client_auth)

    def check_protected_mode(self, what: str, host: str, plane: str, port_key: str) -> None:
        """Protected mode: refuse to listen beyond loopback with neither TLS on ``plane`` nor authentication."""
        if not self.protected_mode or self.auth_enabled or self.enabled(plane) or is_loopback(host):
            return
        keys = (
            "security.ssl.internal.enabled with security.ssl.internal.cert, .key and .ca"
            if plane == INTERNAL
            else "security.ssl.rest.enabled with security.ssl.rest.cert and .key"
        )
        raise ConfigError(
            f"protected mode: the {what} would listen on {host} ({port_key}) without TLS or authentication, so anyone "
            f"who can reach it could read and change state. Set security.ssl.enabled: true ({keys}; "
            f"docs/security.md) or security.auth.enabled: true; or bind to 127.0.0.1; or, only on a network where "
            f"every host is trusted, set security.protected-mode: false"
        )


def is_loopback(host: str) -> bool:
    """True when every address ``host`` stands for is a loopback address (unresolvable: False)."""
    name = host.strip("[]")
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    if name == "localhost":
        return True
    try:
        infos = socket.getaddrinfo(name, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


class HttpTls:
    """An ``ssl.SSLContext`` for an HTTP server, rebuilt when the certificate files change."""

    def __init__(self, material: ReloadingMaterial, require_client_auth: bool) -> None:
        self._material = material
        self._require = require_client_auth
        self._generation = -1
        self._context: ssl.SSLContext | None = None

    def context(self) -> ssl.SSLContext:
        """The SSL context for the metrics endpoint, rebuilt when the certificate files changed.

        A bad new file keeps the previous context (with a warning); ConfigError only if there never
        was a good one.
        """
        self._material.refresh(force=True)
        if self._context is None or self._material.generation != self._generation:
            generation = self._material.generation
            try:
                self._context = _ssl_context(self._material.files, self._material.material, self._require)
                self._generation = generation
            except (ssl.SSLError, OSError) as exc:
                if self._context is None:
                    raise ConfigError(f"security.ssl.rest.cert: cannot serve HTTPS: {exc}") from exc
                logger.warning("tls: keeping the metrics endpoint's certificate: %s", exc)
        return self._context


def _ssl_context(files: PemFiles, material: PemMaterial, require_client_auth: bool) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    assert files.cert and files.key
    context.load_cert_chain(files.cert, files.key)
    if material.ca:
        context.load_verify_locations(cadata=material.ca.decode("ascii", errors="replace"))
    if require_client_auth:
        context.verify_mode = ssl.CERT_REQUIRED
    return context


__all__ = [
    "DEFAULT_JOBMANAGER_INTERNAL_PORT",
    "HttpTls",
    "PlaneSettings",
    "TransportSecurity",
    "internal_plane_separate",
    "is_loopback",
    "jobmanager_internal_port",
    "plane_settings",
]
