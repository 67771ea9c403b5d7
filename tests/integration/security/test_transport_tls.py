"""TLS on both planes with real servers and certificates made in the test (trustme).

The internal plane (JobManager <-> TaskManagers) is mutual TLS with the cluster's CA on ports of
its own; the client plane is TLS, with client certificates when
security.ssl.rest.authentication-enabled. Every refusal a user can meet is checked for the
message that names the fix.
"""

from __future__ import annotations

import os
import socket
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, TypedDict, cast

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common._proto.v1 import jobmanager_pb2_grpc as jm_grpc
from keyedstate.common.client import ChannelSecurity, ClientSettings, StateClient, ValueState
from keyedstate.common.config import Configuration
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.errors import ConfigError, UnavailableError
from keyedstate.common.ids import JobId, KeyGroupRange
from keyedstate.common.rpc.channels import create_server
from keyedstate.jobmanager.daemon import JobManager
from keyedstate.jobmanager.taskmanager_gateway import SlotDeployment, TaskManagerGateways
from keyedstate.taskmanager.daemon import TaskManager
from tests.fixtures.tls import Leaf, Pki
from tests.integration.serving._support import JOB, OPERATOR, operators


class _Quick(TypedDict):
    max_attempts: int
    timeout_s: float


QUICK: _Quick = {"max_attempts": 1, "timeout_s": 5.0}


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki")


def _client_security(pki: Pki, leaf: Leaf | None = None, ca: Path | None = None) -> ChannelSecurity:
    return ChannelSecurity.from_pem(
        ca=(ca or pki.rest_ca_file).read_bytes(),
        cert=leaf.cert.read_bytes() if leaf else None,
        key=leaf.key.read_bytes() if leaf else None,
    )


def _tls_cluster(inprocess_cluster: Any, pki: Pki, authentication: bool = False, taskmanagers: int = 2) -> Any:
    jm = {**pki.cluster_conf("jm", authentication), "jobmanager.internal.port": 0}
    cluster = inprocess_cluster(taskmanagers=0, slots=2, jm=jm)
    for i in range(taskmanagers):
        cluster.add_taskmanager(**pki.cluster_conf(f"tm{i}", authentication))
    return cluster


def _peer_certificate(port: int) -> bytes:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, context.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def _der(leaf: Leaf) -> bytes:
    return ssl.PEM_cert_to_DER_cert(
        leaf.cert.read_text().split("-----END CERTIFICATE-----")[0] + "-----END CERTIFICATE-----\n"
    )


def test_both_planes_on_tls_end_to_end(inprocess_cluster: Any, pki: Pki) -> None:
    cluster = _tls_cluster(inprocess_cluster, pki, authentication=True)
    jm, tms = cluster.jobmanager, cluster.taskmanagers
    # The internal services moved to ports of their own.
    assert jm.internal_port != jm.port
    assert all(tm.internal_address != tm.address for tm in tms)
    client = cluster.client(security=_client_security(pki, pki.leaf(pki.rest_ca, "client")))
    overview = client.wait_for_taskmanagers(2, slots=4, timeout_s=20)
    assert sorted(t.address for t in overview.taskmanagers) == sorted(tm.address for tm in tms)
    client.submit_job(JOB, operators(4), max_parallelism=32)
    state = ValueState[str, str](client, JOB, OPERATOR, "last", value_serializer="str")
    keys = [f"k{i}" for i in range(500)]
    state.put_many(keys, [f"v{i}" for i in range(500)])
    assert state.get_many(keys) == [f"v{i}" for i in range(500)]
    checkpoint = client.trigger_checkpoint(JOB, timeout_s=30)  # barriers to, acknowledgements from every TaskManager
    assert checkpoint.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, checkpoint.failure_reason


def test_clients_cannot_reach_internal_services(inprocess_cluster: Any, pki: Pki) -> None:
    cluster = _tls_cluster(inprocess_cluster, pki, taskmanagers=1)
    jm, tm = cluster.jobmanager, cluster.taskmanagers[0]
    rest = _client_security(pki)
    # The client port does not serve them at all.
    with grpc.secure_channel(jm.address, rest.credentials()) as channel, pytest.raises(grpc.RpcError) as info:
        jm_grpc.ResourceManagerStub(channel).RegisterTaskManager(
            jm_pb.RegisterTaskManagerRequest(taskmanager_id="intruder", address="127.0.0.1:1", num_slots=8), timeout=5
        )
    assert cast(grpc.Call, info.value).code() is grpc.StatusCode.UNIMPLEMENTED
    # The internal port wants a certificate of the cluster's CA: a client-plane one is refused.
    client_leaf = pki.leaf(pki.rest_ca, "client-at-internal")
    creds = grpc.ssl_channel_credentials(
        pki.cluster_ca_file.read_bytes(), client_leaf.key.read_bytes(), client_leaf.cert.read_bytes()
    )
    for target in (f"127.0.0.1:{jm.internal_port}", tm.internal_address):
        with grpc.secure_channel(target, creds) as channel, pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert cast(grpc.Call, info.value).code() is grpc.StatusCode.UNAVAILABLE
    assert len(jm.registry.all()) == 1


def test_a_taskmanager_of_another_ca_cannot_register(inprocess_cluster: Any, pki: Pki) -> None:
    cluster = _tls_cluster(inprocess_cluster, pki, taskmanagers=0)
    # A complete, self-consistent configuration, but of another cluster's CA.
    stranger = {
        **pki.internal_conf(pki.leaf(pki.other_ca, "stranger"), ca=pki.other_ca_file),
        **pki.rest_server_conf(pki.leaf(pki.rest_ca, "stranger-rest")),
        "taskmanager.registration.timeout": "1 s",
    }
    with pytest.raises(UnavailableError) as info:
        cluster.add_taskmanager(**stranger)
    message = info.value.message
    assert "cannot reach the JobManager" in message and "security.ssl.internal.ca" in message, message
    assert cluster.jobmanager.registry.all() == []


_STOLEN = SlotDeployment(
    job_id=JobId("stolen"),
    operator=OperatorSpec("op", 1, (StateDescriptor("s", StateKind.VALUE),)),
    subtask_index=0,
    key_groups=KeyGroupRange(0, 127),
    max_parallelism=128,
    slot_index=0,
    routing_version=1,
    checkpoint_base="",
    incremental=False,
)


def test_a_jobmanager_without_the_cluster_certificate_cannot_deploy(inprocess_cluster: Any, pki: Pki) -> None:
    cluster = _tls_cluster(inprocess_cluster, pki, taskmanagers=1)
    tm = cluster.taskmanagers[0]
    impostors = {
        "no certificate": ChannelSecurity.from_pem(ca=pki.cluster_ca_file.read_bytes(), plane="internal"),
        "another CA's certificate": ChannelSecurity.from_pem(
            ca=pki.cluster_ca_file.read_bytes(),
            cert=(leaf := pki.leaf(pki.other_ca, "fake-jm")).cert.read_bytes(),
            key=leaf.key.read_bytes(),
            plane="internal",
        ),
    }
    for what, security in impostors.items():
        gateways = TaskManagerGateways(64 << 20, deploy_timeout_s=5, security=security)
        gateways.route(tm.address, tm.internal_address)
        try:
            with pytest.raises(UnavailableError) as info:
                gateways.deploy(tm.address, _STOLEN)
        finally:
            gateways.close()
        assert (
            "DeploySlot on TaskManager" in info.value.message and "security.ssl.internal.cert" in info.value.message
        ), what
    assert all(slot.subtask is None or slot.subtask.job_id != "stolen" for slot in tm.slots.all())


def test_rest_authentication_requires_a_client_certificate(inprocess_cluster: Any, pki: Pki) -> None:
    cluster = _tls_cluster(inprocess_cluster, pki, authentication=True, taskmanagers=1)
    anonymous = cluster.client(security=_client_security(pki), **QUICK)
    with pytest.raises(UnavailableError) as info:
        anonymous.wait_for_taskmanagers(1, timeout_s=2)
    assert "security.ssl.rest.cert" in info.value.message, info.value.message
    foreign = cluster.client(security=_client_security(pki, pki.leaf(pki.other_ca, "foreign")), **QUICK)
    with pytest.raises(UnavailableError):
        foreign.wait_for_taskmanagers(1, timeout_s=2)
    member = cluster.client(security=_client_security(pki, pki.leaf(pki.rest_ca, "member")), **QUICK)
    assert len(member.wait_for_taskmanagers(1, timeout_s=10).taskmanagers) == 1


def test_wrong_ca_plaintext_and_tls_mismatch_say_what_to_fix(inprocess_cluster: Any, pki: Pki) -> None:
    cluster = _tls_cluster(inprocess_cluster, pki, taskmanagers=1)
    cases = [
        (
            cluster.client(security=_client_security(pki, ca=pki.other_ca_file), **QUICK),
            "set security.ssl.rest.ca to the CA",
        ),
        (cluster.client(**QUICK), "security.ssl.rest.enabled: true"),  # plaintext against TLS
    ]
    plain = inprocess_cluster(taskmanagers=0)
    cases.append((StateClient(plain.address, ClientSettings(**QUICK), _client_security(pki)), "does not speak TLS"))
    for client, fragment in cases:
        with pytest.raises(UnavailableError) as info:
            client.wait_for_taskmanagers(1, timeout_s=2)
        assert "UNAVAILABLE" in info.value.message and fragment in info.value.message, info.value.message
    cases[-1][0].close()


def test_an_expired_server_certificate_is_named(pki: Pki) -> None:
    expired = pki.leaf(pki.rest_ca, "expired-server", expired=True)
    credentials = grpc.ssl_server_credentials([(expired.key.read_bytes(), expired.cert.read_bytes())])
    server, port = create_server(
        "127.0.0.1",
        0,
        threads=2,
        max_message_bytes=1 << 20,
        what="expired",
        port_key="test.port",
        credentials=credentials,
    )
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server.start()
    try:
        client = StateClient(f"127.0.0.1:{port}", ClientSettings(**QUICK), _client_security(pki))
        with pytest.raises(UnavailableError) as info:
            client.wait_for_taskmanagers(1, timeout_s=2)
        client.close()
        assert "certificate has expired" in info.value.message and "renew" in info.value.message
    finally:
        server.stop(0)


def test_rotation_needs_no_restart(inprocess_cluster: Any, pki: Pki, tmp_path: Path) -> None:
    cluster = _tls_cluster(inprocess_cluster, pki, taskmanagers=1)
    jm = cluster.jobmanager
    rest_cert = Path(jm.conf.get_raw("security.ssl.rest.cert"))
    rest_key = Path(jm.conf.get_raw("security.ssl.rest.key"))
    assert _peer_certificate(jm.port) == ssl.PEM_cert_to_DER_cert(rest_cert.read_text())
    # A long-lived client whose CA file is read from disk.
    client_ca = tmp_path / "client-ca.pem"
    client_ca.write_bytes(pki.rest_ca_file.read_bytes())
    conf = Configuration(
        {
            "security.ssl.rest.enabled": True,
            "security.ssl.rest.ca": str(client_ca),
            "security.ssl.reload-interval": "0 ms",
        }
    )
    from keyedstate.common.client import client_security

    old_client = cluster.client(security=client_security(conf), **QUICK)
    old_client.wait_for_taskmanagers(1, timeout_s=10)

    # 1. A renewed certificate of the same CA: new connections get it, existing clients go on.
    renewed = pki.leaf(pki.rest_ca, "renewed")
    _replace(rest_key, renewed.key)
    _replace(rest_cert, renewed.cert)
    assert _peer_certificate(jm.port) == ssl.PEM_cert_to_DER_cert(renewed.cert.read_text())
    assert len(old_client.wait_for_taskmanagers(1, timeout_s=10).taskmanagers) == 1
    fresh = cluster.client(security=_client_security(pki), **QUICK)
    assert len(fresh.wait_for_taskmanagers(1, timeout_s=10).taskmanagers) == 1

    # 2. A new CA: the server moves to it, and so does the long-lived client once its CA file changes.
    new_ca = __import__("trustme").CA()
    moved = pki.leaf(new_ca, "new-ca-server")
    _replace(rest_key, moved.key)
    _replace(rest_cert, moved.cert)
    assert _peer_certificate(jm.port) == ssl.PEM_cert_to_DER_cert(moved.cert.read_text())
    new_ca.cert_pem.write_to_path(str(tmp_path / "new-ca.pem"))
    before = old_client._jm_channel.current()
    _replace(client_ca, tmp_path / "new-ca.pem")
    # Its open connection was made under the old CA: the client rebuilds its channel with the new
    # CA file, and that channel's handshake verifies the server's new certificate.
    assert len(old_client.wait_for_taskmanagers(1, timeout_s=10).taskmanagers) == 1
    assert old_client._jm_channel.current() is not before
    stale = cluster.client(security=_client_security(pki), **QUICK)
    with pytest.raises(UnavailableError):
        stale.wait_for_taskmanagers(1, timeout_s=2)


def _replace(target: Path, source: Path) -> None:
    # As a rotation tool does: write beside, rename over (atomic), so readers never see half a file.
    tmp = target.with_suffix(".new")
    tmp.write_bytes(source.read_bytes())
    os.replace(tmp, target)


def test_metrics_over_https_with_client_certificates(pki: Pki, tmp_path: Path) -> None:
    conf = {
        **pki.cluster_conf("jm", authentication=True),
        "jobmanager.rpc.port": 0,
        "jobmanager.internal.port": 0,
        "metrics.reporter.prom.port": "0",
        "rest.port": -1,
    }
    jm = JobManager(Configuration(conf))
    jm.start()
    try:
        port = jm._metrics_server.port if jm._metrics_server else None
        assert port
        url = f"https://127.0.0.1:{port}/metrics"
        member = pki.leaf(pki.rest_ca, "scraper")
        context = ssl.create_default_context(cafile=str(pki.rest_ca_file))
        context.load_cert_chain(str(member.cert), str(member.key))
        body = urllib.request.urlopen(url, context=context, timeout=5).read().decode()
        assert "flink_jobmanager_numRegisteredTaskManagers" in body
        anonymous = ssl.create_default_context(cafile=str(pki.rest_ca_file))
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            urllib.request.urlopen(url, context=anonymous, timeout=5).read()
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    finally:
        jm.stop(grace_s=0)


def test_protected_mode_refuses_an_open_plaintext_daemon_and_can_be_turned_off(pki: Pki) -> None:
    open_conf = {
        "jobmanager.rpc.port": 0,
        "jobmanager.bind-host": "0.0.0.0",
        "metrics.reporter.prom.port": "-1",
        "rest.port": -1,
    }
    jm = JobManager(Configuration(open_conf))
    with pytest.raises(ConfigError) as info:
        jm.start()
    for fragment in (
        "protected mode",
        "0.0.0.0",
        "jobmanager.bind-host",
        "security.ssl.enabled: true",
        "security.auth.enabled: true",
        "security.protected-mode: false",
    ):
        assert fragment in info.value.message
    for opened in (
        {**open_conf, "security.protected-mode": False},
        {**open_conf, **pki.cluster_conf("open-jm"), "jobmanager.internal.port": 0},
    ):
        jm = JobManager(Configuration(opened))
        jm.start()
        jm.stop(grace_s=0)
    tm = TaskManager(
        Configuration(
            {
                "jobmanager.rpc.port": 1,
                "taskmanager.bind-host": "0.0.0.0",
                "metrics.reporter.prom.port": "-1",
                "state.backend.rocksdb.localdir": str(pki.base / "tm-open"),
            }
        )
    )
    with pytest.raises(ConfigError, match="protected mode: the TaskManager would listen on 0.0.0.0"):
        tm.start()


def test_a_bad_certificate_stops_the_daemon_process_with_exit_2(pki: Pki, tmp_path: Path) -> None:
    from tests.integration.serving._support import run_module

    result = run_module(
        "keyedstate.jobmanager",
        "-D",
        "jobmanager.rpc.port=0",
        "-D",
        "metrics.reporter.prom.port=-1",
        "-D",
        "security.ssl.internal.enabled=true",
        "-D",
        f"security.ssl.internal.cert={tmp_path / 'missing.crt'}",
        "-D",
        f"security.ssl.internal.key={tmp_path / 'missing.key'}",
        "-D",
        f"security.ssl.internal.ca={pki.cluster_ca_file}",
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "security.ssl.internal.cert" in last and "missing.crt" in last and "Traceback" not in result.stderr


def test_statectl_over_tls(inprocess_cluster: Any, pki: Pki, capsys: pytest.CaptureFixture[str]) -> None:
    from keyedstate.cli import statectl

    cluster = _tls_cluster(inprocess_cluster, pki, taskmanagers=1)
    base = ["cluster", "--json", "--jobmanager", cluster.address]
    assert (
        statectl.main([*base, "-D", "security.ssl.rest.enabled=true", "-D", f"security.ssl.rest.ca={pki.rest_ca_file}"])
        == 0
    )
    assert cluster.taskmanagers[0].id in capsys.readouterr().out
    assert statectl.main(base) == 1  # plaintext against the TLS port
    assert "security.ssl.rest.enabled: true" in capsys.readouterr().err
