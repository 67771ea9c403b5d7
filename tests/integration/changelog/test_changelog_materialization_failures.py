"""Materializations that fail on the storage: Flink's changelog metrics and ``state.changelog.max-failures-allowed``.

The checkpoint storage is a real S3 API (moto on loopback) whose writes of materialization files
(``shared/mat-*``) are refused with S3's 403 while the fault is armed; segments and checkpoint
files still go through, so checkpoints go on completing on top of the previous materialization.
The TaskManager's Prometheus endpoint is scraped over HTTP. With ``max-failures-allowed: 2``:
two failures in a row are tolerated (the job keeps running and its failed counter reads 2), a
success resets the count, and the third failure in a row fails the job over, which restores the
latest checkpoint: no epoch lost or doubled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from keyedstate.common.client import StateClient
from tests.fixtures.s3 import RefusedWrites, boto3_client, s3_configuration
from tests.integration.failover._support import EpochWriter, key_names, operators, scrape, wait_for_job, wait_until

MAT = "flink_taskmanager_job_task_operator_ChangelogMaterialization_"
CSB = "flink_taskmanager_job_task_operator_ChangelogStateBackend_"
DSTL = "flink_taskmanager_job_ChangelogStorage_"
JOB = "cl-mat-fail"
JOB_CONFIG = {
    "state.changelog.enabled": "true",
    # Retries come after min(interval, 1 s, 2 s, ...): 2 s after a second failure, time to lift the fault.
    "state.changelog.periodic-materialize.interval": "2 s",
    "state.changelog.max-failures-allowed": "2",
    "execution.checkpointing.incremental": "true",
    "restart-strategy.type": "fixed-delay",
    "restart-strategy.fixed-delay.attempts": "5",
    "restart-strategy.fixed-delay.delay": "100 ms",
}


@pytest.fixture
def refusing_s3() -> Iterator[tuple[str, RefusedWrites]]:
    """A moto S3 server of this test's own, its writes of materialization files refused while armed."""
    from tests.fixtures.s3 import MotoS3Server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request would drown a failure's log
    faults: list[RefusedWrites] = []

    def wrap(app: Any) -> RefusedWrites:
        faults.append(RefusedWrites(app, "/shared/mat-"))
        return faults[0]

    server = MotoS3Server(wrap=wrap)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}", faults[0]
    finally:
        server.stop()


def _sample(port: int, name: str, *, missing: float | None = None, **labels: str) -> float:
    """One sample of the TaskManager's scrape (labels: a subset of the sample's); ``missing`` if not exported yet."""
    want = set(labels.items())
    found = [v for (n, ls), v in scrape(port).items() if n == name and want <= ls]
    if not found and missing is not None:
        return missing
    assert len(found) == 1, f"{name}{labels}: {found}"
    return found[0]


def test_failed_materializations_are_counted_tolerated_reset_by_a_success_and_then_fail_the_job_over(
    refusing_s3: tuple[str, RefusedWrites], inprocess_cluster: Callable[..., Any]
) -> None:
    # refusing_s3 first: fixtures are torn down in reverse, so the cluster stops while its storage still
    # answers (in the other order the teardown, its storage a closed port, took 42-44 s; now 1 s).
    endpoint, fault = refusing_s3
    bucket = "ks-mat-fail"
    boto3_client(endpoint).create_bucket(Bucket=bucket)
    s3 = s3_configuration(endpoint).to_dict()
    cluster = inprocess_cluster(
        taskmanagers=1,
        slots=2,
        jm={**s3, "state.checkpoints.dir": f"s3://{bucket}/chk"},
        tm={**s3, "metrics.reporter.prom.port": "0"},
    )
    port = cluster.taskmanagers[0].metrics_port
    assert port is not None
    client: StateClient = cluster.client(timeout_s=30)
    client.submit_job(JOB, operators(1), max_parallelism=8, config=JOB_CONFIG)
    writer = EpochWriter(client, JOB, key_names(60))

    def of_slot(name: str, missing: float | None = None) -> float:
        return _sample(port, name, missing=missing, job_id=JOB, operator_id="counts", subtask_index="0")

    def metric(name: str) -> float:
        # Exported from the slot's first materialization on: before it, what Flink's would read.
        return of_slot(MAT + name, -1.0 if name == "lastDurationOfMaterialization" else 0.0)

    def commit_until(what: str, done: Callable[[], bool], timeout_s: float = 60) -> None:
        """Commit an epoch every 0.1 s (so a materialization always has something new) until ``done``."""
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {scrape(port)}"
            writer.run(writer.committed + 1)
            time.sleep(0.1)

    writer.run(1)
    commit_until("a first background materialization", lambda: metric("lastDurationOfMaterialization") >= 0)
    assert metric("failedMaterialization") == 0
    # The sizes of the last checkpoint: it references the materialization and the segments after it.
    writer.run(writer.committed + 1)
    assert of_slot(CSB + "lastFullSizeOfMaterialization") > 0
    assert of_slot(CSB + "lastFullSizeOfNonMaterialization") > 0
    assert _sample(port, DSTL + "numberOfUploadRequests", job_id=JOB) >= 1
    assert _sample(port, DSTL + "uploadSizes_count", job_id=JOB) == _sample(
        port, DSTL + "numberOfUploadRequests", job_id=JOB
    )
    completed = metric("completedMaterialization")

    # Two failures in a row are tolerated: the counter rises, the job runs on, its checkpoints complete.
    fault.armed.set()
    commit_until("two failed materializations", lambda: metric("failedMaterialization") >= 2)
    fault.armed.clear()
    assert metric("failedMaterialization") == 2, "a third failure in a row came before the fault was lifted"
    assert fault.refused >= 2
    info = client.job_info(JOB)
    assert info.restarts == 0, info.failure_cause
    # A success resets the count.
    commit_until("a materialization after the fault", lambda: metric("completedMaterialization") > completed)
    assert client.job_info(JOB).restarts == 0

    # Two failures are tolerated again (the count was reset); the third in a row fails the job over.
    fault.armed.set()
    commit_until("two failed materializations more", lambda: metric("failedMaterialization") >= 4)
    assert client.job_info(JOB).restarts == 0, "two failures after a success must be tolerated"
    wait_until(
        lambda: metric("failedMaterialization") >= 5,
        "the third failed materialization in a row",
        timeout_s=30,
    )
    fault.armed.clear()  # the redeployed slot's first materialization comes 2 s after its restore
    info = wait_for_job(client, JOB, {"RUNNING", "RESTARTING"}, min_restarts=1, timeout_s=60)
    assert "max-failures-allowed=2" in info.failure_cause, info.failure_cause
    assert "counts[0]" in info.failure_cause, info.failure_cause
    # The failover restored the latest checkpoint: every epoch committed before it, exactly once.
    target = writer.committed + 3
    writer.run(target, timeout_s=120)
    assert writer.read() == writer.expected(target)
    assert metric("failedMaterialization") == 5
