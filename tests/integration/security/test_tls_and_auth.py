"""TLS and authentication together, as a secured production cluster runs.

The daemons carry no tokens: on the internal mutual-TLS plane their certificates from the
cluster's CA are their identity (role internal). Clients reach the client plane over TLS and
authenticate with tokens; an internal certificate does not make a client an admin.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common._proto.v1 import jobmanager_pb2_grpc as jm_grpc
from keyedstate.common.client import ChannelSecurity, ClientSettings, StateClient, ValueState
from keyedstate.common.errors import AuthenticationError, PermissionDeniedError
from keyedstate.common.rpc.channels import open_channel
from tests.fixtures.tls import Pki
from tests.integration.security._tokens import make_tokens
from tests.integration.serving._support import OPERATOR, operators, rpc_error

JOB = "secured"
SETTINGS = ClientSettings(timeout_s=10.0, max_attempts=1)


def test_daemons_authenticate_by_certificate_and_clients_by_token(inprocess_cluster: Any, tmp_path: Path) -> None:
    pki = Pki(tmp_path / "pki")
    tokens = make_tokens(tmp_path / "auth", {"ops": ("admin", ["*"]), "pipeline": ("writer", [JOB])})
    auth = {"security.auth.enabled": "true", "security.auth.tokens-file": str(tokens.tokens_file)}
    cluster = inprocess_cluster(
        taskmanagers=0, slots=2, jm={**pki.cluster_conf("jm"), **auth, "jobmanager.internal.port": 0}
    )
    for i in range(2):  # no security.auth.token-file: the internal certificate is the identity
        cluster.add_taskmanager(**pki.cluster_conf(f"tm{i}"), **auth)
    rest = ChannelSecurity.from_pem(ca=pki.rest_ca_file.read_bytes())

    with StateClient(cluster.address, SETTINGS, rest, token=tokens.tokens["ops"]) as admin:
        admin.wait_for_taskmanagers(2, slots=4, timeout_s=20)
        admin.submit_job(JOB, operators(2))
        with StateClient(cluster.address, SETTINGS, rest, token=tokens.tokens["pipeline"]) as writer:
            state = ValueState[str, int](writer, JOB, OPERATOR, "last")
            keys = [f"k{i}" for i in range(200)]
            state.put_many(keys, list(range(200)))
            assert state.get_many(keys) == list(range(200))
            with pytest.raises(PermissionDeniedError) as denied:
                writer.cancel_job(JOB)
            assert "job.cancel" in denied.value.message
        checkpoint = admin.trigger_checkpoint(JOB, timeout_s=60)  # barriers and acks ride the internal plane
        assert checkpoint.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, checkpoint.failure_reason

    # TLS without a token: the transport alone is no identity on the client plane.
    with (
        StateClient(cluster.address, SETTINGS, rest) as anonymous,  # no token in this environment
        pytest.raises(AuthenticationError),
    ):
        ValueState[str, int](anonymous, JOB, OPERATOR, "last").get("k1")

    # A client holding a cluster (internal) certificate is still not a TaskManager on the client
    # port: the internal services are not served there at all.
    leaf = pki.leaf(pki.cluster_ca, "stolen-internal")
    stolen = ChannelSecurity.from_pem(
        ca=pki.rest_ca_file.read_bytes(), cert=leaf.cert.read_bytes(), key=leaf.key.read_bytes()
    )
    channel = open_channel(cluster.address, security=stolen, token=tokens.tokens["ops"])
    try:
        err = rpc_error(
            lambda: jm_grpc.ResourceManagerStub(channel).RegisterTaskManager(
                jm_pb.RegisterTaskManagerRequest(taskmanager_id="intruder", address="127.0.0.1:1", num_slots=8),
                timeout=10,
            )
        )
        assert err.code() is grpc.StatusCode.UNIMPLEMENTED
    finally:
        channel.close()
