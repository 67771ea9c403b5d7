"""Product bugs the chaos suite found, each reproduced deterministically, and fixed: these tests keep them fixed."""

from __future__ import annotations

import time
from typing import Any

import pytest

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.client import ClientSettings, ListState, ReducingState, StateClient
from keyedstate.common.errors import KeyedStateError
from tests.integration.partitions._partitions import (
    EVENTS,
    OPERATOR,
    TOTALS,
    keys_by_subtask,
    operators,
    taskmanager_of,
)

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(180)]

JOB = "finding"


@pytest.mark.parametrize("write", ["list_append", "reduce"])
def test_a_direct_write_reaches_the_new_owner_after_its_taskmanager_died(process_cluster: Any, write: str) -> None:
    # Chaos seed 1020 (direct mode): tm1 killed with kill -9 and restarted (on a new port); the job
    # failed over in a second, but the writer of subtask 1 failed every append for the rest of the
    # run with "failed to connect ... <tm1's old address>", the outcome-unknown error the client
    # raised for a non-idempotent call, which refreshed nothing. A Spark executor's cached client
    # (foreach_batch(..., exactly_once=False)) was stuck the same way, so its tasks kept failing.
    # Fixed: such an error marks the job's cached table suspect, and the next call fetches it again.
    cluster = process_cluster(
        taskmanagers=3,
        slots=2,
        config={
            "restart-strategy.type": "fixed-delay",
            "restart-strategy.fixed-delay.attempts": "10",
            "restart-strategy.fixed-delay.delay": "100 ms",
        },
    )
    client = StateClient(cluster.jobmanager_address, ClientSettings(timeout_s=5.0, max_attempts=5, backoff_s=0.05))
    admin = StateClient(cluster.jobmanager_address, ClientSettings(timeout_s=5.0, max_attempts=5, backoff_s=0.05))
    try:
        routing = client.submit_job(JOB, operators(2))
        key = keys_by_subtask(routing, [f"k{i:03d}" for i in range(40)])[1][0]
        owner = taskmanager_of(admin, JOB, 1)[0]
        events: ListState[str, str] = ListState(
            client, JOB, OPERATOR, EVENTS, key_serializer="str", value_serializer="str"
        )
        totals: ReducingState[str] = ReducingState(client, JOB, OPERATOR, TOTALS, key_serializer="str")

        def write_once(n: int) -> None:
            if write == "list_append":
                events.append_many([key], [f"e{n}"])
            else:
                totals.add_many([key], [(1, n)])

        write_once(0)  # the client now holds the routing table that names the owner
        cluster.taskmanagers[int(owner.split("-")[1])].kill()
        deadline = time.monotonic() + 60
        while True:
            info = admin.job_info(JOB)
            if info.status == pb.JOB_STATUS_RUNNING and info.routing_version > routing.version:
                break
            assert time.monotonic() < deadline, f"the job did not run again after {owner} died: {info.status}"
            time.sleep(0.05)
        assert taskmanager_of(admin, JOB, 1)[0] != owner

        # The failover is complete and subtask 1 has a new owner; a call may fail once (its outcome
        # was unknown), but the client must find the new owner within a few tries.
        errors: list[str] = []
        for n in range(1, 21):
            try:
                write_once(n)
                break
            except KeyedStateError as exc:
                errors.append(exc.message[:200])
                time.sleep(0.2)
        else:
            pytest.fail(f"20 {write} calls after the failover all failed (4 s); the last: {errors[-1]}")
    finally:
        client.close()
        admin.close()


def test_a_direct_write_reaches_a_job_restored_after_it_was_failed_or_cancelled(process_cluster: Any) -> None:
    # Chaos seed 1071 (direct mode): the job FAILED (restart budget used up) and the operator restored
    # it from its latest checkpoint under the same job id, but every writer kept failing with "job is
    # FAILED": a client that had fetched a table saying FAILED or CANCELED never fetched it again.
    cluster = process_cluster(taskmanagers=2, slots=2)
    client = StateClient(cluster.jobmanager_address, ClientSettings(timeout_s=5.0, max_attempts=5, backoff_s=0.05))
    admin = StateClient(cluster.jobmanager_address, ClientSettings(timeout_s=5.0, max_attempts=5, backoff_s=0.05))
    try:
        client.submit_job(JOB, operators(2))
        events: ListState[str, str] = ListState(
            client, JOB, OPERATOR, EVENTS, key_serializer="str", value_serializer="str"
        )
        events.append_many(["k"], ["e0"])
        checkpoint = admin.trigger_checkpoint(JOB, timeout_s=60)
        assert checkpoint.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, checkpoint.failure_reason
        admin.cancel_job(JOB)
        with pytest.raises(KeyedStateError, match="CANCELED"):
            for _ in range(10):  # the client learns it from a refused call and a fresh table
                events.append_many(["k"], ["lost"])
                time.sleep(0.1)
        admin.submit_job(JOB, operators(2), restore_path=checkpoint.path)
        deadline = time.monotonic() + 30
        while admin.job_info(JOB).status != pb.JOB_STATUS_RUNNING:
            assert time.monotonic() < deadline, "the restored job did not run"
            time.sleep(0.05)
        errors: list[str] = []
        for n in range(1, 21):
            try:
                events.append_many(["k"], [f"e{n}"])
                break
            except KeyedStateError as exc:
                errors.append(exc.message[:200])
                time.sleep(0.2)
        else:
            pytest.fail(f"20 appends to the restored job all failed (4 s); the last: {errors[-1]}")
        assert events.get_many(["k"]) == [["e0", f"e{n}"]]
    finally:
        client.close()
        admin.close()
