"""Authentication and authorization on real gRPC servers (an in-process cluster with security.auth.enabled).

Each refusal is checked for its status code, for a message that tells the caller what is
missing, for its log line (without the token) and for the refusal metric.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common._proto.v1 import jobmanager_pb2_grpc as jm_grpc
from keyedstate.common._proto.v1 import taskmanager_pb2 as tm_pb
from keyedstate.common._proto.v1 import taskmanager_pb2_grpc as tm_grpc
from keyedstate.common.client import BatchAction, ClientSettings, StateClient, ValueState
from keyedstate.common.config import Configuration
from keyedstate.common.errors import (
    AuthenticationError,
    ConfigError,
    InvalidArgumentError,
    PermissionDeniedError,
    Reason,
)
from keyedstate.common.rpc.channels import open_channel
from keyedstate.taskmanager.daemon import TaskManager
from tests.fixtures.cluster import FAST_HEARTBEATS
from tests.integration.security._tokens import Tokens, make_tokens
from tests.integration.serving._support import OPERATOR, operators, reason, rpc_error

JOB_A, JOB_B = "job-a", "job-b"
GRANTS = {
    "ops": ("admin", ["*"]),
    "pipeline-a": ("writer", [JOB_A]),
    "dashboard-a": ("reader", [JOB_A]),
    "pipeline-b": ("writer", [JOB_B]),
    "jm": ("jobmanager", ["*"]),
    "tm": ("taskmanager", ["*"]),
}
SETTINGS = ClientSettings(timeout_s=10.0, max_attempts=2, backoff_s=0.05)


@pytest.fixture
def secured(inprocess_cluster: Any, tmp_path: Path) -> tuple[Any, Tokens]:
    tokens = make_tokens(tmp_path / "auth", GRANTS)
    auth = {"security.auth.enabled": "true", "security.auth.tokens-file": str(tokens.tokens_file)}
    cluster = inprocess_cluster(
        taskmanagers=1,
        slots=4,
        jm={**auth, "security.auth.token-file": tokens.file("jm")},
        tm={**auth, "security.auth.token-file": tokens.file("tm")},
    )
    with StateClient(cluster.address, SETTINGS, token=tokens.tokens["ops"]) as admin:
        admin.submit_job(JOB_A, operators(1))
        admin.submit_job(JOB_B, operators(1))
    return cluster, tokens


def _client(cluster: Any, tokens: Tokens, name: str) -> StateClient:
    client = StateClient(cluster.address, SETTINGS, token=tokens.tokens[name])
    cluster.clients.append(client)
    return client


def _refused(cluster: Any, method: str, code: str) -> float:
    value = cluster.jobmanager.metrics_registry.get_sample_value(
        "keyedstate_jobmanager_auth_refused_total", {"method": method, "code": code}
    )
    return value or 0.0


def test_the_right_tokens_work_within_their_role_and_jobs(secured: tuple[Any, Tokens]) -> None:
    cluster, tokens = secured
    writer = ValueState[str, int](_client(cluster, tokens, "pipeline-a"), JOB_A, OPERATOR, "last")
    writer.put_many(["k1", "k2"], [1, 2])
    reader = ValueState[str, int](_client(cluster, tokens, "dashboard-a"), JOB_A, OPERATOR, "last")
    assert reader.get_many(["k1", "k2", "k3"]) == [1, 2, None]
    # The writer runs a pipeline's epochs on its job: BeginBatch and GetRouting are allowed.
    start = _client(cluster, tokens, "pipeline-a").begin_batch(JOB_A, "q", 0)
    assert start.action is BatchAction.RUN
    # A scoped token sees only its jobs in the cluster overview.
    overview = _client(cluster, tokens, "dashboard-a").cluster()
    assert [j.job_id for j in overview.jobs] == [JOB_A]
    assert all(s.job_id in ("", JOB_A) for tm in overview.taskmanagers for s in tm.slots)
    assert sorted(j.job_id for j in _client(cluster, tokens, "ops").cluster().jobs) == [JOB_A, JOB_B]


def test_no_token_and_a_wrong_token_are_unauthenticated(
    secured: tuple[Any, Tokens], caplog: pytest.LogCaptureFixture
) -> None:
    cluster, _tokens = secured
    before = _refused(cluster, "GetJob", "UNAUTHENTICATED")
    with StateClient(cluster.address, SETTINGS) as anonymous, caplog.at_level(logging.WARNING):
        with pytest.raises(AuthenticationError) as info:
            anonymous.job_info(JOB_A)
        assert info.value.reason is Reason.UNAUTHENTICATED
        assert "carried no token" in info.value.message and "security.auth.token-file" in info.value.message
        assert "KEYEDSTATE_TOKEN" in info.value.message
    with (
        StateClient(cluster.address, SETTINGS, token="not-a-real-token") as wrong,
        caplog.at_level(logging.WARNING),
        pytest.raises(AuthenticationError, match="the token is not accepted"),
    ):
        wrong.job_info(JOB_A)
    assert _refused(cluster, "GetJob", "UNAUTHENTICATED") == before + 2
    assert "UNAUTHENTICATED /keyedstate.v1.JobManager/GetJob" in caplog.text and "unknown token sha256:" in caplog.text
    assert "not-a-real-token" not in caplog.text
    # State calls straight to a TaskManager are refused the same way.
    tm = cluster.taskmanagers[0]
    channel = grpc.insecure_channel(tm.address)
    try:
        err = rpc_error(
            lambda: tm_grpc.KeyedStateStub(channel).ValueGet(
                tm_pb.KeyedRequest(
                    target=tm_pb.StateTarget(job_id=JOB_A, operator_id=OPERATOR, state_name="last", routing_version=1),
                    keys=[b"k"],
                ),
                timeout=10,
            )
        )
        assert err.code() is grpc.StatusCode.UNAUTHENTICATED and reason(err) == "UNAUTHENTICATED"
        # Health checks stay open (load balancers and probes carry no token).
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()


def test_a_token_scoped_to_another_job_is_denied_naming_the_job(secured: tuple[Any, Tokens]) -> None:
    cluster, tokens = secured
    before = _refused(cluster, "GetJob", "PERMISSION_DENIED")
    with pytest.raises(PermissionDeniedError) as info:
        ValueState[str, int](_client(cluster, tokens, "pipeline-b"), JOB_A, OPERATOR, "last").put("k", 1)
    message = info.value.message
    assert "token 'pipeline-b' (role writer, jobs: job-b) has no access to job 'job-a'" in message
    assert "use a token whose jobs include 'job-a'" in message
    assert _refused(cluster, "GetJob", "PERMISSION_DENIED") == before + 1  # the handle's descriptor lookup
    # Straight to the TaskManager, skipping the JobManager: the TaskManager checks the job too.
    channel = open_channel(cluster.taskmanagers[0].address, token=tokens.tokens["pipeline-b"])
    try:
        err = rpc_error(
            lambda: tm_grpc.KeyedStateStub(channel).ValuePut(
                tm_pb.KeyedRequest(
                    target=tm_pb.StateTarget(job_id=JOB_A, operator_id=OPERATOR, state_name="last", routing_version=1),
                    keys=[b"k"],
                    values=[b"v"],
                ),
                timeout=10,
            )
        )
    finally:
        channel.close()
    assert err.code() is grpc.StatusCode.PERMISSION_DENIED and "no access to job 'job-a'" in err.details()
    registry = cluster.taskmanagers[0].registry
    assert (
        registry.get_sample_value(
            "keyedstate_taskmanager_auth_refused_total", {"method": "ValuePut", "code": "PERMISSION_DENIED"}
        )
        == 1.0
    )


def test_a_reader_cannot_write_and_a_writer_cannot_cancel(
    secured: tuple[Any, Tokens], caplog: pytest.LogCaptureFixture
) -> None:
    cluster, tokens = secured
    reader = ValueState[str, int](_client(cluster, tokens, "dashboard-a"), JOB_A, OPERATOR, "last")  # may read the job
    with pytest.raises(PermissionDeniedError) as info:
        reader.put("k", 1)
    assert (
        "token 'dashboard-a' (role reader, jobs: job-a) may not call ValuePut: it needs permission state.write "
        "(role writer or admin) on job 'job-a'"
    ) in info.value.message
    before = _refused(cluster, "CancelJob", "PERMISSION_DENIED")
    with caplog.at_level(logging.WARNING), pytest.raises(PermissionDeniedError) as info:
        _client(cluster, tokens, "pipeline-a").cancel_job(JOB_A)
    assert "may not call CancelJob: it needs permission job.cancel (role admin) on job 'job-a'" in info.value.message
    assert _refused(cluster, "CancelJob", "PERMISSION_DENIED") == before + 1
    assert "PERMISSION_DENIED /keyedstate.v1.JobManager/CancelJob" in caplog.text
    assert tokens.tokens["pipeline-a"] not in caplog.text
    assert _client(cluster, tokens, "ops").job_info(JOB_A).status == pb.JOB_STATUS_RUNNING  # nothing was cancelled
    with pytest.raises(PermissionDeniedError, match="job.restore \\(role admin\\)"):
        _client(cluster, tokens, "pipeline-a").submit_job(JOB_A, operators(1), restore_path="file:///tmp/chk-1")


def test_internal_calls_need_an_internal_identity(secured: tuple[Any, Tokens]) -> None:
    cluster, tokens = secured
    # Not even an admin may register a TaskManager or deploy slots: those are internal calls.
    admin_jm = open_channel(cluster.address, token=tokens.tokens["ops"])
    admin_tm = open_channel(cluster.taskmanagers[0].address, token=tokens.tokens["ops"])
    try:
        err = rpc_error(
            lambda: jm_grpc.ResourceManagerStub(admin_jm).RegisterTaskManager(
                jm_pb.RegisterTaskManagerRequest(taskmanager_id="intruder", address="127.0.0.1:1", num_slots=8),
                timeout=10,
            )
        )
        assert err.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "needs permission taskmanager.register (role taskmanager or internal)" in err.details()
        err = rpc_error(
            lambda: tm_grpc.TaskExecutorStub(admin_tm).ReleaseSlot(
                tm_pb.ReleaseSlotRequest(job_id=JOB_A, operator_id=OPERATOR, subtask_index=0), timeout=10
            )
        )
        assert err.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "needs permission slot.control (role jobmanager or internal)" in err.details()
        # Failing a job over by a task failure report is the TaskManagers' call alone.
        report = jm_pb.ReportTaskFailureRequest(
            job_id=JOB_A, taskmanager_id="tm-0", operator_id="no-such-operator", subtask_index=0, cause="test"
        )
        err = rpc_error(lambda: jm_grpc.ResourceManagerStub(admin_jm).ReportTaskFailure(report, timeout=10))
        assert err.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "needs permission checkpoint.report (role taskmanager or internal)" in err.details()
        tm_jm = open_channel(cluster.address, token=tokens.tokens["tm"])
        try:
            # The TaskManager's token passes authorization and reaches the report's own checks.
            err = rpc_error(lambda: jm_grpc.ResourceManagerStub(tm_jm).ReportTaskFailure(report, timeout=10))
            assert err.code() is grpc.StatusCode.NOT_FOUND, err.details()
            assert "no-such-operator" in err.details()
        finally:
            tm_jm.close()
    finally:
        admin_jm.close()
        admin_tm.close()
    overview = _client(cluster, tokens, "ops").cluster()
    assert [t.taskmanager_id for t in overview.taskmanagers] == ["tm-0"]
    # The real TaskManager, with its taskmanager token, still serves the job.
    assert ValueState[str, int](_client(cluster, tokens, "ops"), JOB_A, OPERATOR, "last").get("nothing") is None


def test_a_taskmanager_without_a_token_stops_at_once_naming_the_fix(
    secured: tuple[Any, Tokens], tmp_path: Path
) -> None:
    cluster, tokens = secured
    with pytest.raises(ConfigError) as info:
        cluster.add_taskmanager(**{"security.auth.token-file": tokens.file("pipeline-a")})
    assert "may not call RegisterTaskManager" in info.value.message and "role taskmanager" in info.value.message


def test_tokens_are_added_and_revoked_without_a_restart(secured: tuple[Any, Tokens]) -> None:
    cluster, tokens = secured
    token = tokens.grant("late", "reader", [JOB_B])
    with StateClient(cluster.address, SETTINGS, token=token) as late:
        assert late.job_info(JOB_B).job_id == JOB_B
        tokens.revoke("late")
        with pytest.raises(AuthenticationError, match="not accepted"):
            late.job_info(JOB_B)


def test_secrets_in_a_job_config_are_refused(secured: tuple[Any, Tokens]) -> None:
    cluster, tokens = secured
    with pytest.raises(InvalidArgumentError) as info:
        _client(cluster, tokens, "ops").submit_job("job-c", operators(1), config={"s3.secret-key": "NOT-HERE"})
    assert "must not carry secrets (s3.secret-key)" in info.value.message and "NOT-HERE" not in info.value.message


def test_a_taskmanager_of_another_cluster_is_refused_naming_both_ids(inprocess_cluster: Any, tmp_path: Path) -> None:
    cluster = inprocess_cluster(taskmanagers=0, jm={"high-availability.cluster-id": "blue"})
    tm = TaskManager(
        Configuration(
            {
                "jobmanager.rpc.port": cluster.jobmanager.port,
                "taskmanager.resource-id": "green-tm",
                "state.backend.rocksdb.localdir": str(tmp_path / "green"),
                "metrics.reporter.prom.port": "-1",
                "high-availability.cluster-id": "green",
                "taskmanager.registration.timeout": "60 s",
                **FAST_HEARTBEATS,
            }
        )
    )
    with pytest.raises(ConfigError) as info:
        tm.start()  # refused at once: no retrying for the registration timeout
    message = info.value.message
    assert "belongs to cluster 'green' but this JobManager runs cluster 'blue'" in message
    assert "high-availability.cluster-id" in message and info.value.reason is Reason.WRONG_CLUSTER
    assert cluster.jobmanager.registry.all() == []
    ok = cluster.add_taskmanager(**{"high-availability.cluster-id": "blue"})
    assert [r.taskmanager_id for r in cluster.jobmanager.registry.all()] == [ok.id]
