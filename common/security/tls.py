"""TLS material for the two transport planes: PEM files checked at load, re-read when they change.

A plane (``internal`` or ``rest``) is configured by ``security.ssl.<plane>.cert``, ``.key`` and
``.ca``. :func:`load_material` reads and checks them (readable, a key matching the certificate,
valid now, issued by the plane's CA where the plane needs that) and raises a ConfigError that
names the key and the fix. :class:`ReloadingMaterial` keeps the current material and swaps in new
files once they load and check cleanly, so a half-written rotation never replaces good
certificates. Servers ask it on every new connection (:func:`server_credentials`); clients get
fresh credentials for each new channel, and :class:`ChannelSecurity` tells long-lived channels
when to rebuild theirs.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from keyedstate.common.errors import ConfigError
from keyedstate.common.filestamp import file_stamp

logger = logging.getLogger(__name__)

INTERNAL = "internal"
REST = "rest"

_DOCS = "docs/security.md"


def key_name(plane: str, which: str) -> str:
    return f"security.ssl.{plane}.{which}"


@dataclass(frozen=True)
class PemFiles:
    """The PEM paths of one plane, as configured (None: not set)."""

    plane: str
    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    def paths(self) -> tuple[str | None, str | None, str | None]:
        """``(cert, key, ca)`` file paths; None for the ones not configured."""
        return (self.cert, self.key, self.ca)


@dataclass(frozen=True)
class PemMaterial:
    """The bytes of one plane's files, checked; ``not_after`` is the certificate's expiry."""

    cert_chain: bytes | None
    key: bytes | None
    ca: bytes | None
    not_after: datetime.datetime | None = None


def _read(plane: str, which: str, path: str) -> bytes:
    key = key_name(plane, which)
    try:
        return open(os.path.expanduser(path), "rb").read()
    except OSError as exc:
        raise ConfigError(
            f"{key}: cannot read {path} ({exc.strerror or exc}); point {key} at a readable PEM file ({_DOCS})"
        ) from exc


def _certificates(plane: str, which: str, path: str, data: bytes) -> list[x509.Certificate]:
    key = key_name(plane, which)
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        certs = []
    if not certs:
        raise ConfigError(
            f"{key}: {path} holds no PEM certificate ('-----BEGIN CERTIFICATE-----'); a DER or keystore file must be "
            f"converted first, for example: openssl x509 -inform der -in FILE -out FILE.pem ({_DOCS})"
        )
    return certs


def _check_validity(plane: str, which: str, path: str, cert: x509.Certificate, now: datetime.datetime) -> None:
    key = key_name(plane, which)
    subject = cert.subject.rfc4514_string() or "(no subject)"
    if cert.not_valid_after_utc <= now:
        raise ConfigError(
            f"{key}: the certificate {subject} in {path} expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; "
            f"issue a new one and replace the file (no restart needed once the daemon runs; {_DOCS})"
        )
    if cert.not_valid_before_utc > now:
        raise ConfigError(
            f"{key}: the certificate {subject} in {path} is not valid before "
            f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC; check this host's clock or the certificate's dates"
        )


def _public_der(public_key: Any) -> bytes:
    der: bytes = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return der


def _check_required(files: PemFiles, *, need_identity: bool, need_ca: bool) -> None:
    # Which files a plane needs follows from its role; checked before any file is read, so the
    # message names the missing key rather than a read failure.
    plane = files.plane
    cert_key, key_key, ca_key = (key_name(plane, w) for w in ("cert", "key", "ca"))
    if need_identity and not (files.cert and files.key):
        missing = cert_key if not files.cert else key_key
        raise ConfigError(
            f"{missing} is not set; TLS on the {plane} plane needs this daemon's certificate and private key: set "
            f"{cert_key} and {key_key} to PEM files ({_DOCS} shows how to make them)"
        )
    if bool(files.cert) != bool(files.key):
        missing = cert_key if not files.cert else key_key
        raise ConfigError(
            f"{missing} is not set; {cert_key} and {key_key} go together (a certificate and its private key)"
        )
    if need_ca and not files.ca:
        raise ConfigError(
            f"{ca_key} is not set; the {plane} plane needs the CA certificate that signs its peers' certificates "
            f"({_DOCS})"
        )


def _check_private_key(files: PemFiles, key: bytes, leaf: x509.Certificate) -> None:
    # The key must parse unencrypted and belong to the certificate: a mismatch would otherwise
    # surface only as a handshake failure on the peer's side.
    cert_key, key_key = key_name(files.plane, "cert"), key_name(files.plane, "key")
    try:
        private = serialization.load_pem_private_key(key, password=None)
    except TypeError as exc:
        raise ConfigError(
            f"{key_key}: the private key in {files.key} is encrypted; give an unencrypted PEM key, for example "
            f"openssl pkey -in {files.key} -out key.pem (and protect the file with chmod 600)"
        ) from exc
    except (ValueError, Exception) as exc:  # cryptography raises ValueError or UnsupportedAlgorithm
        raise ConfigError(f"{key_key}: {files.key} holds no PEM private key ('-----BEGIN PRIVATE KEY-----')") from exc
    if _public_der(private.public_key()) != _public_der(leaf.public_key()):
        raise ConfigError(
            f"{key_key}: the private key in {files.key} does not belong to the certificate in {files.cert} "
            f"({cert_key}); configure the key that was made with that certificate"
        )


def load_material(
    files: PemFiles,
    *,
    need_identity: bool,
    need_ca: bool,
    check_issuer: bool = False,
    now: datetime.datetime | None = None,
) -> PemMaterial:
    """Read and check one plane's files; every problem is a ConfigError naming the key and the fix.

    ``need_identity``: cert and key are required (a server, or a client that must authenticate).
    ``need_ca``: the CA file is required. ``check_issuer``: the certificate must be issued by a CA
    of the CA file (the internal plane, where every peer checks it against that same file).
    """
    plane = files.plane
    now = now or datetime.datetime.now(datetime.UTC)
    cert_key, ca_key = key_name(plane, "cert"), key_name(plane, "ca")
    _check_required(files, need_identity=need_identity, need_ca=need_ca)
    cert_chain = key = ca = None
    leaf_chain: list[x509.Certificate] = []
    not_after = None
    if files.cert and files.key:
        cert_chain = _read(plane, "cert", files.cert)
        leaf_chain = _certificates(plane, "cert", files.cert, cert_chain)
        leaf = leaf_chain[0]
        _check_validity(plane, "cert", files.cert, leaf, now)
        not_after = leaf.not_valid_after_utc
        key = _read(plane, "key", files.key)
        _check_private_key(files, key, leaf)
    if files.ca:
        ca = _read(plane, "ca", files.ca)
        cas = _certificates(plane, "ca", files.ca, ca)
        valid = [c for c in cas if c.not_valid_after_utc > now]
        if not valid:
            _check_validity(plane, "ca", files.ca, cas[0], now)
        if check_issuer and leaf_chain and not _issued_by_any(leaf_chain, cas):
            raise ConfigError(
                f"{cert_key}: the certificate in {files.cert} is not issued by a CA in {ca_key} ({files.ca}); the "
                f"{plane} plane's peers check it against that file and would refuse it: sign it with the cluster's "
                f"CA or add its CA to {ca_key}"
            )
    return PemMaterial(cert_chain, key, ca, not_after)


def _issued_by_any(chain: list[x509.Certificate], cas: list[x509.Certificate]) -> bool:
    for cert in chain:
        for ca in cas:
            if cert == ca:
                return True
            try:
                cert.verify_directly_issued_by(ca)
                return True
            except Exception:  # wrong issuer, wrong signature, unsupported key type
                continue
    return False


class ReloadingMaterial:
    """The current material of one plane; re-reads its files when their size, mtime or inode change.

    New files replace the current ones only once they load and check cleanly (a rotation that has
    written the certificate but not yet the key keeps the old pair until the key arrives).
    """

    def __init__(
        self,
        files: PemFiles,
        loader: Callable[[], PemMaterial],
        check_interval_s: float = 1.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.files = files
        self._loader = loader
        self._interval = check_interval_s
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._material = loader()
        self._checked = monotonic()
        self._rejected: Any = None
        self.generation = 0
        """Counts replacements: a holder of credentials made from an older generation rebuilds them."""

    def _stat(self) -> tuple[Any, ...]:
        return tuple(
            None if path is None else (file_stamp(os.path.expanduser(path)) or "missing") for path in self.files.paths()
        )

    @property
    def material(self) -> PemMaterial:
        """The last loaded material, without checking the files (:meth:`refresh` checks them)."""
        return self._material

    def refresh(self, force: bool = False) -> PemMaterial:
        """The current material, after checking the files (at most once per interval unless ``force``)."""
        now = self._monotonic()
        if not force and now - self._checked < self._interval:
            return self._material
        with self._lock:
            self._checked = now
            stamp = self._stat()
            if stamp == self._stamp:
                return self._material
            try:
                material = self._loader()
            except ConfigError as exc:
                if stamp != self._rejected:
                    self._rejected = stamp
                    logger.warning(
                        "tls: keeping the current %s certificates: the changed files do not load: %s",
                        self.files.plane,
                        exc,
                    )
                return self._material
            self._stamp = stamp
            self._material = material
            self.generation += 1
            logger.info(
                "tls: reloaded the %s plane's certificates from %s (valid until %s)",
                self.files.plane,
                self.files.cert or self.files.ca,
                material.not_after,
            )
            return material


def server_credentials(reloading: ReloadingMaterial, require_client_auth: bool) -> grpc.ServerCredentials:
    """Credentials whose certificates follow the files: gRPC asks the fetcher before every handshake."""

    def configuration(m: PemMaterial) -> Any:
        # A server plane's material always has both (load_material refuses it otherwise).
        assert m.key is not None and m.cert_chain is not None
        return grpc.ssl_server_certificate_configuration([(m.key, m.cert_chain)], root_certificates=m.ca)

    seen = [reloading.generation]

    def fetch() -> Any:
        try:
            material = reloading.refresh(force=True)
            if reloading.generation == seen[0]:
                return None
            seen[0] = reloading.generation
            return configuration(material)
        except Exception:  # an exception here would fail the handshake; keep serving with what we have
            logger.exception("tls: certificate reload failed; keeping the current certificates")
            return None

    credentials: grpc.ServerCredentials = grpc.dynamic_ssl_server_credentials(
        configuration(reloading.material), fetch, require_client_auth
    )
    return credentials


class ChannelSecurity:
    """The client side of one plane: credentials for new channels and a generation to rebuild on.

    Pickles for PySpark executors as the paths plus the current PEM bytes: an executor that can
    read the paths follows rotations, one that cannot uses the bytes it was shipped.
    """

    def __init__(
        self,
        reloading: ReloadingMaterial | None,
        server_name: str | None = None,
        material: PemMaterial | None = None,
        plane: str = REST,
    ) -> None:
        self._reloading = reloading
        self._fixed = material
        self.server_name = server_name
        self.plane = plane

    @classmethod
    def from_pem(
        cls,
        ca: bytes | None = None,
        cert: bytes | None = None,
        key: bytes | None = None,
        server_name: str | None = None,
        plane: str = REST,
    ) -> ChannelSecurity:
        """Fixed PEM bytes (no files), e.g. given to the client API directly."""
        return cls(None, server_name, PemMaterial(cert, key, ca), plane)

    def material(self, check: bool = True) -> PemMaterial:
        """The PEM material; with files, checks them for a rotation first unless ``check`` is False."""
        if self._reloading is not None:
            return self._reloading.refresh() if check else self._reloading.material
        assert self._fixed is not None
        return self._fixed

    @property
    def generation(self) -> int:
        """Changes when the files changed (checked at most once per security.ssl.reload-interval)."""
        if self._reloading is None:
            return 0
        self._reloading.refresh()
        return self._reloading.generation

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials from the current material; a channel keeps them for every reconnect."""
        m = self.material()
        credentials: grpc.ChannelCredentials = grpc.ssl_channel_credentials(
            root_certificates=m.ca, private_key=m.key, certificate_chain=m.cert_chain
        )
        return credentials

    def options(self) -> list[tuple[str, Any]]:
        """Extra channel options: the TLS target-name override when ``server_name`` is set."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def cache_key(self) -> tuple[Any, ...]:
        """Equal for two objects that make the same channels (to share one client per process)."""
        if self._reloading is not None:
            return (self.plane, self._reloading.files, self.server_name)
        m = self.material(check=False)
        return (self.plane, m.ca, m.cert_chain, m.key, self.server_name)

    def __reduce__(self) -> Any:
        files = self._reloading.files if self._reloading is not None else None
        return (_unpickle_channel_security, (files, self.material(check=False), self.server_name, self.plane))


def _unpickle_channel_security(
    files: PemFiles | None, material: PemMaterial, server_name: str | None, plane: str
) -> ChannelSecurity:
    if files is not None and all(p is None or os.access(os.path.expanduser(p), os.R_OK) for p in files.paths()):
        try:
            loader = _client_loader(files)
            return ChannelSecurity(ReloadingMaterial(files, loader), server_name, plane=plane)
        except ConfigError as exc:
            logger.warning(
                "tls: cannot use the %s files here (%s); using the certificates shipped with the client", plane, exc
            )
    return ChannelSecurity(None, server_name, material, plane)


def _client_loader(files: PemFiles) -> Callable[[], PemMaterial]:
    return lambda: load_material(files, need_identity=False, need_ca=False)


# -- handshake failures, as a user sees them ---------------------------------------------------


def handshake_hint(details: str, plane: str = REST) -> str | None:
    """What to fix, for a connection failure whose gRPC details show a TLS problem (None: no idea)."""
    enabled, ca, cert, name = (key_name(plane, w) for w in ("enabled", "ca", "cert", "server-name"))
    text = details or ""
    if "WRONG_VERSION_NUMBER" in text:
        return (
            f"the server does not speak TLS: it is a plaintext port, or not this runtime's; set {enabled}: false "
            f"on this side or turn TLS on at the server"
        )
    if "certificate has expired" in text:
        return (
            "the server's certificate has expired: the server's operator must renew it (replacing the file is enough)"
        )
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return (
            f"the server's certificate is not issued by a CA this side trusts: set {ca} to the CA that signed "
            "the server's certificate"
        )
    if "Hostname Verification" in text or "Peer name" in text:
        return (
            f"the server's certificate does not name the host connected to: connect by a name in the "
            f"certificate or set {name}"
        )
    if "failed to connect to all addresses" in text and "Socket closed" in text:
        # The server hung up during the handshake: OpenSSL gives the client no reason.
        return (
            f"the server closed the connection during connection set-up; if it uses TLS, this side needs "
            f"{enabled}: true and {ca}, and when it requires client certificates, {cert} and "
            f"{key_name(plane, 'key')} with an unexpired certificate issued by the server's CA"
        )
    return None


__all__ = [
    "INTERNAL",
    "REST",
    "ChannelSecurity",
    "PemFiles",
    "PemMaterial",
    "ReloadingMaterial",
    "handshake_hint",
    "key_name",
    "load_material",
    "server_credentials",
]
