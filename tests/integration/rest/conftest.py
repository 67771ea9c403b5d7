"""A real in-process cluster with the REST API on (rest.port 0), a job with checkpoints, and an HTTP helper.

Everything is real: JobManager and TaskManagers on 127.0.0.1 with RocksDB slots, checkpoints to
a file:// directory, the REST server on a free port. ``get`` speaks plain ``urllib`` so that what
is checked is what any HTTP client sees (status, headers, JSON body).
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.client import StateClient, ValueState
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from tests.fixtures.cluster import PATIENT, InProcessCluster

JOB = "orders"
OTHER_JOB = "billing"
OPERATORS = [
    OperatorSpec("sessions", 3, (StateDescriptor("last", StateKind.VALUE),)),
    OperatorSpec("totals", 2, (StateDescriptor("sum", StateKind.VALUE),)),
]
MAX_P = 128


@dataclass
class Answer:
    status: int
    body: Any
    headers: dict[str, str]


def get(
    url: str,
    *,
    token: str | None = None,
    method: str = "GET",
    context: ssl.SSLContext | None = None,
    timeout: float = 20.0,
) -> Answer:
    """One request; any HTTP status comes back as an Answer (never raised), the body parsed if JSON."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    request = urllib.request.Request(url, method=method, headers=headers, data=b"{}" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            raw, status, hdrs = response.read(), response.status, dict(response.headers)
    except urllib.error.HTTPError as exc:
        raw, status, hdrs = exc.read(), exc.code, dict(exc.headers)
    kind = hdrs.get("Content-Type", "")
    body: Any = json.loads(raw) if kind.startswith("application/json") and raw else raw
    return Answer(status, body, hdrs)


def write_keys(client: StateClient, job_id: str, n: int, tag: int) -> None:
    """Put ``n`` keys into each operator's value state (so every subtask has something to snapshot)."""
    keys = [f"user-{i:05d}" for i in range(n)]
    sessions: ValueState[str, int] = ValueState(client, job_id, "sessions", "last", value_serializer="int")
    sessions.put_many(keys, [tag * 1000 + i for i in range(n)])
    totals: ValueState[str, int] = ValueState(client, job_id, "totals", "sum", value_serializer="int")
    totals.put_many(keys, [tag + i for i in range(n)])


def complete_checkpoint(client: StateClient, job_id: str = JOB) -> int:
    """Trigger a checkpoint, wait for it, and return its id (failing the test if it did not complete)."""
    info = client.trigger_checkpoint(job_id, timeout_s=120)
    assert info.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, info.failure_reason
    return int(info.checkpoint_id)


def failed_savepoint(client: StateClient, job_id: str = JOB) -> int:
    """A savepoint into a directory nobody can create: it fails in the TaskManagers' upload."""
    info = client.trigger_checkpoint(
        job_id, savepoint=True, target_directory="file:///proc/keyedstate-no-such-dir", timeout_s=120
    )
    assert info.status == jm_pb.CHECKPOINT_STATUS_FAILED, info
    return int(info.checkpoint_id)


@dataclass
class RestCluster:
    cluster: InProcessCluster
    client: StateClient
    base_url: str

    def url(self, path: str) -> str:
        return self.base_url + path

    def get(self, path: str, **kw: Any) -> Answer:
        return get(self.url(path), **kw)


def start_rest_cluster(
    inprocess_cluster: Callable[..., InProcessCluster],
    jm: dict[str, Any] | None = None,
    scheme: str = "http",
    **client_kw: Any,
) -> RestCluster:
    cluster = inprocess_cluster(taskmanagers=2, slots=4, jm={"rest.port": 0, **PATIENT, **(jm or {})})
    client = cluster.client(**client_kw)
    client.wait_for_taskmanagers(2)
    port = cluster.jobmanager.rest_port
    assert port, "the JobManager did not start its REST server"
    return RestCluster(cluster, client, f"{scheme}://127.0.0.1:{port}")


def _orders_cluster(factory: Callable[..., InProcessCluster]) -> RestCluster:
    rc = start_rest_cluster(factory)
    rc.client.submit_job(JOB, OPERATORS, max_parallelism=MAX_P)
    write_keys(rc.client, JOB, 300, 1)
    complete_checkpoint(rc.client)
    write_keys(rc.client, JOB, 600, 2)
    complete_checkpoint(rc.client)
    failed_savepoint(rc.client)
    return rc


@pytest.fixture
def rest_cluster(inprocess_cluster: Callable[..., InProcessCluster]) -> RestCluster:
    """A cluster whose job ``orders`` has two completed checkpoints and one failed savepoint."""
    return _orders_cluster(inprocess_cluster)


@pytest.fixture(scope="module")
def _module_rest_cluster(module_inprocess_cluster: Callable[..., InProcessCluster]) -> RestCluster:
    return _orders_cluster(module_inprocess_cluster)


def _what_tests_may_not_change(rc: RestCluster) -> Any:
    """The cluster's jobs, their status, restarts and routing, and every checkpoint: what a reading test leaves alone."""
    jobs = rc.get("/jobs").body
    checkpoints = {
        job["id"]: [
            (c["id"], c["status"], c["is_savepoint"]) for c in rc.get(f"/jobs/{job['id']}/checkpoints").body["history"]
        ]
        for job in jobs["jobs"]
    }
    infos = {job["id"]: rc.client.job_info(job["id"]) for job in jobs["jobs"]}
    states = {job: (i.status, i.restarts, i.routing_version, i.latest_checkpoint_id) for job, i in infos.items()}
    return jobs, checkpoints, states


@pytest.fixture
def shared_rest_cluster(_module_rest_cluster: RestCluster) -> Iterator[RestCluster]:
    """``rest_cluster``'s state, set up once per module for the tests that only read it.

    A test that changes it (submits, cancels, restores, checkpoints) fails here: it must take
    ``rest_cluster``, its own cluster, so that every test sees exactly the state set up above.
    """
    before = _what_tests_may_not_change(_module_rest_cluster)
    yield _module_rest_cluster
    assert _what_tests_may_not_change(_module_rest_cluster) == before, (
        "a test changed the shared REST cluster; give it the rest_cluster fixture instead"
    )
