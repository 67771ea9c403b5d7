"""The REST API behind the same TLS and authorization as the gRPC API.

TLS: with ``security.ssl.rest.enabled`` the REST port speaks HTTPS with the rest plane's
certificate: plain HTTP gets no answer, HTTPS trusting the cluster's client CA works, HTTPS
trusting another CA fails verification; with ``security.ssl.rest.authentication-enabled`` a
client certificate is required. Auth: with ``security.auth.enabled`` the JSON endpoints want a
bearer token of ``security.auth.tokens-file``: none or an unknown one is 401, a role or job
scope that does not allow the read is 403, the job lists show only the jobs the token covers.
"""

from __future__ import annotations

import http.client
import ssl
import urllib.error
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from keyedstate.common.client import ChannelSecurity, ClientSettings, StateClient
from tests.fixtures.cluster import InProcessCluster
from tests.fixtures.tls import Leaf, Pki
from tests.integration.rest.conftest import JOB, OPERATORS, RestCluster, complete_checkpoint, get, write_keys
from tests.integration.security._tokens import make_tokens


def _tls_rest_cluster(
    inprocess_cluster: Callable[..., InProcessCluster],
    pki: Pki,
    *,
    authentication: bool = False,
    token: str | None = None,
    jm: dict[str, Any] | None = None,
) -> RestCluster:
    jm = jm or {}
    cluster = inprocess_cluster(
        taskmanagers=0,
        slots=4,
        jm={**pki.cluster_conf("jm", authentication), "jobmanager.internal.port": 0, "rest.port": 0, **jm},
    )
    auth = {k: v for k, v in jm.items() if k.startswith("security.auth")}
    for i in range(2):
        cluster.add_taskmanager(**pki.cluster_conf(f"tm{i}", authentication), **auth)
    leaf = pki.leaf(pki.rest_ca, "grpc-client") if authentication else None
    security = ChannelSecurity.from_pem(
        ca=pki.rest_ca_file.read_bytes(),
        cert=leaf.cert.read_bytes() if leaf else None,
        key=leaf.key.read_bytes() if leaf else None,
    )
    client = StateClient(cluster.address, ClientSettings(timeout_s=10.0, max_attempts=4), security, token=token)
    cluster.clients.append(client)
    client.wait_for_taskmanagers(2, timeout_s=30)
    return RestCluster(cluster, client, f"https://127.0.0.1:{cluster.jobmanager.rest_port}")


def _trusting(ca: Path, leaf: Leaf | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    if leaf is not None:
        context.load_cert_chain(str(leaf.cert), str(leaf.key))
    return context


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki")


def test_with_tls_on_plain_http_fails_and_https_with_the_ca_works(
    inprocess_cluster: Callable[..., InProcessCluster], pki: Pki
) -> None:
    rc = _tls_rest_cluster(inprocess_cluster, pki)
    rc.client.submit_job(JOB, OPERATORS, max_parallelism=128)
    write_keys(rc.client, JOB, 100, 1)
    checkpoint = complete_checkpoint(rc.client)

    trusted = _trusting(pki.rest_ca_file)
    overview = rc.get("/overview", context=trusted)
    assert overview.status == 200 and overview.body["taskmanagers"] == 2
    history = rc.get(f"/jobs/{JOB}/checkpoints", context=trusted).body["history"]
    assert [c["id"] for c in history] == [checkpoint]
    assert rc.get("/", context=trusted).status == 200

    plain = rc.base_url.replace("https://", "http://")
    with pytest.raises((OSError, http.client.HTTPException)):
        get(plain + "/overview", timeout=10)
    with pytest.raises(urllib.error.URLError) as untrusted:
        get(rc.url("/overview"), context=_trusting(pki.other_ca_file), timeout=10)
    assert isinstance(untrusted.value.reason, ssl.SSLCertVerificationError)
    # The server still answers after the failed handshakes.
    assert rc.get("/overview", context=trusted).status == 200


def test_with_rest_authentication_a_client_certificate_is_required(
    inprocess_cluster: Callable[..., InProcessCluster], pki: Pki
) -> None:
    rc = _tls_rest_cluster(inprocess_cluster, pki, authentication=True)
    member = pki.leaf(pki.rest_ca, "browser")
    stranger = pki.leaf(pki.other_ca, "stranger")
    assert rc.get("/overview", context=_trusting(pki.rest_ca_file, member)).status == 200
    for leaf in (None, stranger):
        with pytest.raises((OSError, http.client.HTTPException)):
            get(rc.url("/overview"), context=_trusting(pki.rest_ca_file, leaf), timeout=10)


def test_with_auth_on_tokens_roles_and_job_scopes_apply(
    inprocess_cluster: Callable[..., InProcessCluster], pki: Pki, tmp_path: Path
) -> None:
    tokens = make_tokens(
        tmp_path / "auth",
        {
            "ops": ("admin", ["*"]),
            "viewer": ("reader", [JOB]),
            "stranger": ("reader", ["billing"]),
            "tm": ("taskmanager", ["*"]),
        },
    )
    auth = {"security.auth.enabled": "true", "security.auth.tokens-file": str(tokens.tokens_file)}
    rc = _tls_rest_cluster(inprocess_cluster, pki, token=tokens.tokens["ops"], jm=auth)
    rc.client.submit_job(JOB, OPERATORS, max_parallelism=128)
    rc.client.submit_job("billing", OPERATORS[:1], max_parallelism=128)
    ctx = _trusting(pki.rest_ca_file)

    def status(path: str, token: str | None) -> int:
        return rc.get(path, token=token, context=ctx).status

    # No token, or one nobody issued: 401 with a challenge and a message naming the fix.
    for token in (None, "not-a-token"):
        answer = rc.get("/overview", token=token, context=ctx)
        assert answer.status == 401
        assert answer.headers["WWW-Authenticate"].startswith("Bearer")
        assert "security.auth.tokens-file" in answer.body["errors"][0]
    # A TaskManager's token has no client permissions.
    denied = rc.get("/overview", token=tokens.tokens["tm"], context=ctx)
    assert denied.status == 403 and "cluster.view" in denied.body["errors"][0]
    # A reader of one job sees that job only.
    viewer = tokens.tokens["viewer"]
    assert status("/overview", viewer) == 200
    assert rc.get("/jobs", token=viewer, context=ctx).body == {"jobs": [{"id": JOB, "status": "RUNNING"}]}
    assert [j["jid"] for j in rc.get("/jobs/overview", token=viewer, context=ctx).body["jobs"]] == [JOB]
    assert status(f"/jobs/{JOB}/checkpoints", viewer) == 200
    assert status("/jobs/billing", viewer) == 403
    assert status(f"/jobs/{JOB}", tokens.tokens["stranger"]) == 403
    # An admin sees everything; the page and the document need no token (they hold no cluster data).
    assert {j["id"] for j in rc.get("/jobs", token=tokens.tokens["ops"], context=ctx).body["jobs"]} == {JOB, "billing"}
    assert status("/jobmanager/config", tokens.tokens["ops"]) == 200
    assert status("/", None) == 200 and status("/openapi.json", None) == 200
    # A revoked token stops working without a restart (the tokens file is re-read, as for gRPC).
    tokens.revoke("viewer")
    assert status("/overview", viewer) == 401
