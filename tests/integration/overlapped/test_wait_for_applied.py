"""StateClient.wait_for_applied: after an overlapped commit returns, reads outside an epoch see the batch once it returns.

Overlapped commits apply behind the driver, so a read right after a commit returned may see the
state before it (README, "Overlapped commits"). ``wait_for_applied`` is the documented wait. The
batches here write 20,000 keys each, so each apply takes a noticeable time behind its commit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from keyedstate.common._proto.v1 import common_pb2
from keyedstate.common.client import BatchAction, EpochScope, ValueState
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.errors import InvalidArgumentError, JobStateError
from tests.fixtures.cluster import InProcessCluster

JOB = "applied"
OPS = [OperatorSpec("counts", 2, (StateDescriptor("total", StateKind.VALUE),))]
KEYS = [f"user-{i}" for i in range(20_000)]


@pytest.fixture
def cluster(inprocess_cluster: Callable[..., InProcessCluster]) -> InProcessCluster:
    c = inprocess_cluster(taskmanagers=2, slots=1)
    c.client().submit_job(JOB, OPS, config={"execution.checkpointing.commit-mode": "overlapped"})
    return c


def _run_batch(cluster: InProcessCluster, batch: int) -> Any:
    client = cluster.clients[0]
    start = client.begin_batch(JOB, "q", batch)
    assert start.action is BatchAction.RUN, start
    scope = EpochScope(common_pb2.EpochContext(epoch=start.epoch, partition=0, attempt=1), start.routing.version)
    totals: ValueState[str, int] = ValueState(client, JOB, "counts", "total", value_serializer="int", epoch=scope)
    totals.put_many(KEYS, [batch] * len(KEYS))
    outcome = client.commit_epoch(
        JOB,
        start.epoch,
        [scope.winner()],
        query_id="q",
        batch_id=batch,
        expected_routing_version=start.routing.version,
        checkpoint=False,
        wait_for_checkpoint=False,
        timeout_s=60,
    )
    return start.epoch, outcome


def test_reads_after_the_wait_see_every_key_of_the_batch(cluster: InProcessCluster) -> None:
    client = cluster.client()
    totals: ValueState[str, int] = ValueState(client, JOB, "counts", "total", value_serializer="int")
    for batch in range(4):
        epoch, outcome = _run_batch(cluster, batch)
        assert outcome.decided, "an overlapped commit returns once the epoch's decision is written"
        progress = client.wait_for_applied(JOB)  # the epoch committed now
        assert progress.applied_epoch >= epoch and progress.committed_epoch == epoch, progress
        assert set(totals.get_many(KEYS)) == {batch}, f"a read after the wait missed batch {batch}"
    assert client.wait_for_applied(JOB, 1).applied_epoch == 3  # an earlier epoch: at once


def test_an_epoch_not_committed_and_a_cancelled_job_are_refused_naming_why(cluster: InProcessCluster) -> None:
    client = cluster.client()
    epoch, _ = _run_batch(cluster, 0)
    with pytest.raises(InvalidArgumentError) as bad:
        client.wait_for_applied(JOB, epoch + 1, timeout_s=5)
    assert bad.value.message == (
        f"job 'applied' has committed epoch {epoch}, not {epoch + 1}: wait for an epoch the job has committed "
        "(JobProgress.committed_epoch)"
    )
    client.cancel_job(JOB)
    with pytest.raises(JobStateError, match=r"^job 'applied' is CANCELED with epoch -?\d+ of 0 applied: "):
        client.wait_for_applied(JOB, epoch, timeout_s=5)
