"""Certificates are checked when the configuration is loaded; every problem names the key and the fix."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from keyedstate.common.config import Configuration
from keyedstate.common.errors import ConfigError
from keyedstate.common.security import TransportSecurity, handshake_hint
from keyedstate.common.security.transport import is_loopback
from tests.fixtures.tls import Pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def _load(conf: dict[str, object], role: str = "daemon") -> TransportSecurity:
    return TransportSecurity.from_config(Configuration(conf), role=role)


def _refused(conf: dict[str, object], *fragments: str, role: str = "daemon") -> None:
    with pytest.raises(ConfigError) as info:
        _load(conf, role)
    for fragment in fragments:
        assert fragment in info.value.message, f"{fragment!r} not in {info.value.message!r}"


def test_right_files_load_and_plaintext_is_the_default(pki: Pki) -> None:
    security = _load(pki.cluster_conf("jm", authentication=True))
    assert security.enabled("internal") and security.enabled("rest")
    assert security.server_credentials("internal") is not None and security.channel_security("internal") is not None
    plain = _load({})
    assert not plain.enabled("internal") and not plain.enabled("rest")
    assert plain.server_credentials("rest") is None and plain.channel_security("internal") is None


def test_security_ssl_enabled_sets_both_planes_and_a_plane_key_wins(pki: Pki) -> None:
    conf = {**pki.cluster_conf("both"), "security.ssl.enabled": True}
    del conf["security.ssl.internal.enabled"], conf["security.ssl.rest.enabled"]
    assert _load(conf).enabled("internal") and _load(conf).enabled("rest")
    only_internal = {**conf, "security.ssl.rest.enabled": False}
    assert _load(only_internal).enabled("internal") and not _load(only_internal).enabled("rest")


def test_a_missing_setting_names_the_key(pki: Pki) -> None:
    _refused(
        {"security.ssl.internal.enabled": True}, "security.ssl.internal.cert is not set", "security.ssl.internal.key"
    )
    conf = pki.internal_conf(pki.leaf(pki.cluster_ca, "no-ca"))
    del conf["security.ssl.internal.ca"]
    _refused(conf, "security.ssl.internal.ca is not set")
    rest = pki.rest_server_conf(pki.leaf(pki.rest_ca, "auth-no-ca"), authentication=True)
    del rest["security.ssl.rest.ca"]
    _refused(rest, "security.ssl.rest.ca is not set")


def test_a_missing_or_unreadable_file_names_the_key_and_the_path(pki: Pki, tmp_path: Path) -> None:
    conf = pki.internal_conf(pki.leaf(pki.cluster_ca, "gone"))
    conf["security.ssl.internal.key"] = str(tmp_path / "nope.key")
    _refused(conf, "security.ssl.internal.key", "nope.key", "No such file", "readable PEM file")
    not_pem = tmp_path / "cert.der"
    not_pem.write_bytes(b"\x30\x82garbage")
    conf = pki.internal_conf(pki.leaf(pki.cluster_ca, "der"))
    conf["security.ssl.internal.cert"] = str(not_pem)
    _refused(conf, "security.ssl.internal.cert", "no PEM certificate", "openssl x509")


def test_a_key_that_does_not_belong_to_the_certificate_is_refused(pki: Pki) -> None:
    a, b = pki.leaf(pki.cluster_ca, "pair-a"), pki.leaf(pki.cluster_ca, "pair-b")
    conf = pki.internal_conf(a)
    conf["security.ssl.internal.key"] = str(b.key)
    _refused(conf, "security.ssl.internal.key", "does not belong to the certificate", str(a.cert))


def test_an_encrypted_key_is_refused_with_the_command_that_decrypts_it(pki: Pki, tmp_path: Path) -> None:
    leaf = pki.leaf(pki.cluster_ca, "encrypted")
    key = serialization.load_pem_private_key(leaf.key.read_bytes(), password=None)
    locked = tmp_path / "locked.key"
    locked.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    conf = {**pki.internal_conf(leaf), "security.ssl.internal.key": str(locked)}
    _refused(conf, "security.ssl.internal.key", "encrypted", "openssl pkey")


def test_an_expired_certificate_is_refused_with_its_expiry_date(pki: Pki) -> None:
    conf = pki.internal_conf(pki.leaf(pki.cluster_ca, "expired", expired=True))
    _refused(conf, "security.ssl.internal.cert", "expired on 2021-01-01", "issue a new one")
    rest = pki.rest_server_conf(pki.leaf(pki.rest_ca, "expired-rest", expired=True))
    _refused(rest, "security.ssl.rest.cert", "expired")


def test_an_internal_certificate_of_another_ca_is_refused_at_load(pki: Pki) -> None:
    conf = pki.internal_conf(pki.leaf(pki.other_ca, "stranger"))
    _refused(conf, "security.ssl.internal.cert", "not issued by a CA in security.ssl.internal.ca", "cluster's CA")


def test_a_client_needs_no_certificate_unless_authentication_is_required(pki: Pki) -> None:
    client = _load({"security.ssl.rest.enabled": True, "security.ssl.rest.ca": str(pki.rest_ca_file)}, role="client")
    assert client.channel_security("rest") is not None
    _refused(
        {
            "security.ssl.rest.enabled": True,
            "security.ssl.rest.authentication-enabled": True,
            "security.ssl.rest.ca": str(pki.rest_ca_file),
        },
        "security.ssl.rest.cert is not set",
        role="client",
    )


def test_a_half_written_rotation_keeps_the_old_certificates(pki: Pki) -> None:
    leaf = pki.leaf(pki.cluster_ca, "rotating")
    security = _load(pki.internal_conf(leaf))
    material = security.material("internal")
    assert material is not None
    before = material.material.cert_chain
    # The new certificate arrived, its key not yet: the pair does not match, the old one stays.
    other = pki.leaf(pki.cluster_ca, "rotating-next")
    leaf.cert.write_bytes(other.cert.read_bytes())
    os.utime(leaf.cert, ns=(1, 1))
    assert material.refresh(force=True).cert_chain == before and material.generation == 0
    leaf.key.write_bytes(other.key.read_bytes())
    assert material.refresh(force=True).cert_chain == other.cert.read_bytes() and material.generation == 1


@pytest.mark.parametrize(
    "host,loopback",
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
        ("no-such-host.invalid", False),
    ],
)
def test_loopback_detection(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_protected_mode_names_the_keys_and_the_opt_out() -> None:
    security = _load({})
    with pytest.raises(ConfigError) as info:
        security.check_protected_mode("JobManager", "0.0.0.0", "rest", "jobmanager.bind-host")
    for fragment in (
        "protected mode",
        "0.0.0.0",
        "security.ssl.enabled: true",
        "security.auth.enabled: true",
        "security.protected-mode: false",
        "127.0.0.1",
    ):
        assert fragment in info.value.message
    security.check_protected_mode("JobManager", "127.0.0.1", "rest", "jobmanager.bind-host")
    _load({"security.protected-mode": False}).check_protected_mode("JobManager", "0.0.0.0", "rest", "x")
    _load({"security.auth.enabled": True}).check_protected_mode("JobManager", "0.0.0.0", "internal", "x")


@pytest.mark.parametrize(
    "details,fragment",
    [
        (
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Tls handshake failed "
            "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: "
            "unable to get local issuer certificate",
            "set security.ssl.rest.ca to the CA",
        ),
        ("...CERTIFICATE_VERIFY_FAILED: certificate has expired: OK", "expired"),
        ("...OPENSSL_internal:WRONG_VERSION_NUMBER: Invalid certificate verification context", "does not speak TLS"),
        (
            "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed",
            "security.ssl.rest.cert",
        ),
        (
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Custom verification check failed "
            "with error: UNAUTHENTICATED: Hostname Verification Check failed.",
            "security.ssl.rest.server-name",
        ),
    ],
)
def test_handshake_hints(details: str, fragment: str) -> None:
    hint = handshake_hint(details)
    assert hint is not None and fragment in hint
    assert handshake_hint("Deadline Exceeded") is None
