"""A Spark-like driver without Spark: epochs of staged writes, committed and checkpointed.

Each epoch adds, per key, a counter (ReducingState SUM) and appends an event (ListState), so a
lost update shows as a smaller count and a doubled one as a larger count or a repeated event.
The driver behaves as KeyedStateRuntime.foreach_batch does: a batch whose job restarted in the
middle is run again under a new attempt id; a batch already committed is skipped.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

from keyedstate.common._proto.v1 import common_pb2
from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common.client import (
    BatchAction,
    CheckpointStatus,
    ClientSettings,
    EpochScope,
    ListState,
    ReducingState,
    StateClient,
)
from keyedstate.common.descriptors import OperatorSpec, ReduceField, StateDescriptor, StateKind
from keyedstate.common.errors import EpochGapError, KeyedStateError

JOB = "ha-job"
OP = "agg"


def operators(parallelism: int) -> list[OperatorSpec]:
    return [
        OperatorSpec(
            OP,
            parallelism,
            (
                StateDescriptor("sums", StateKind.REDUCING, reduce_fields=(ReduceField("n"), ReduceField("amount"))),
                StateDescriptor("events", StateKind.LIST),
            ),
        )
    ]


@dataclass
class EpochDriver:
    address: str
    keys: int = 2_000
    events_per_epoch: int = 3_000
    seed: int = 7
    job: str = JOB
    reference: dict[str, list[int]] = field(default_factory=dict)
    events: dict[str, list[str]] = field(default_factory=dict)
    attempts: int = 0
    reruns: int = 0
    client: StateClient = field(init=False)

    def __post_init__(self) -> None:
        self.client = StateClient(self.address, ClientSettings(timeout_s=20, max_attempts=8, backoff_s=0.1))

    def batch(self, epoch: int) -> list[tuple[str, int]]:
        rng = random.Random(self.seed * 1_000_003 + epoch)
        return [(f"user-{rng.randrange(self.keys)}", rng.randrange(1, 1000)) for _ in range(self.events_per_epoch)]

    def wait_running(self, timeout_s: float = 120.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                info = self.client.job_info(self.job)
                if info.status == pb.JOB_STATUS_RUNNING:
                    return info
                if info.status in (pb.JOB_STATUS_FAILED, pb.JOB_STATUS_CANCELED):
                    raise AssertionError(f"job {info.status}: {info.failure_cause}")
            except KeyedStateError:
                pass  # the JobManager is restarting
            if time.monotonic() > deadline:
                raise AssertionError(f"job not RUNNING within {timeout_s} s")
            time.sleep(0.1)

    def run_epoch(self, epoch: int) -> Any:
        """Run one batch until a completed checkpoint holds it; returns the CommitEpochResponse.

        As ``foreach_batch`` does: ask where the batch stands, run it (again) when the job lost
        it, only wait for durability when the state holds it already.
        """
        rows = self.batch(epoch)
        while True:
            try:
                start = self.client.begin_batch(self.job, "", epoch)
            except KeyedStateError:
                time.sleep(0.1)  # the JobManager is restarting
                continue
            if start.action is BatchAction.STOP:
                raise AssertionError(f"job {start.job_status}: {start.failure_cause}")
            if start.action is BatchAction.WAIT:
                time.sleep(0.1)
                continue
            winners = []
            if start.action is BatchAction.RUN:
                self.attempts += 1
                scope = EpochScope(
                    common_pb2.EpochContext(epoch=start.epoch, partition=0, attempt=self.attempts),
                    routing_version=start.routing.version,
                )
                try:
                    self._stage(rows, epoch, scope)
                except KeyedStateError:
                    self.reruns += 1  # the job restarted under the batch: run it again
                    time.sleep(0.1)
                    continue
                winners = [scope.winner()]
            try:
                response = self.client.commit_epoch(
                    self.job, start.epoch, winners, batch_id=epoch, expected_routing_version=start.routing.version
                )
            except EpochGapError:
                raise
            except KeyedStateError:
                if winners:
                    self.reruns += 1
                time.sleep(0.1)
                continue
            # Durable: a completed checkpoint holds the epoch, or (overlapped commits) its decision does.
            assert (response.decided and response.committed_epoch >= start.epoch) or (
                response.checkpoint is not None
                and response.checkpoint.status is CheckpointStatus.COMPLETED
                and response.checkpoint.epoch >= start.epoch
            ), response
            self._apply_reference(epoch, rows)
            return response

    def _stage(self, rows: list[tuple[str, int]], epoch: int, scope: EpochScope) -> None:
        agg: dict[str, list[int]] = {}
        for key, amount in rows:
            a = agg.setdefault(key, [0, 0])
            a[0] += 1
            a[1] += amount
        keys = sorted(agg)
        ReducingState[str](self.client, self.job, OP, "sums", epoch=scope).add_many(keys, [agg[k] for k in keys])
        ListState[str, str](self.client, self.job, OP, "events", value_serializer="str", epoch=scope).append_many(
            [k for k, _ in rows], [f"{epoch}:{i}:{amount}" for i, (_, amount) in enumerate(rows)]
        )

    def _apply_reference(self, epoch: int, rows: list[tuple[str, int]]) -> None:
        for i, (key, amount) in enumerate(rows):
            ref = self.reference.setdefault(key, [0, 0])
            ref[0] += 1
            ref[1] += amount
            self.events.setdefault(key, []).append(f"{epoch}:{i}:{amount}")

    def verify(self) -> None:
        """Every key equals the plain-Python reference: nothing lost, nothing doubled."""
        keys = sorted(self.reference)
        sums = ReducingState[str](self.client, self.job, OP, "sums").get_many(keys)
        got = {k: [int(v) for v in s] if s is not None else None for k, s in zip(keys, sums)}
        wrong = {k: (got[k], self.reference[k]) for k in keys if got[k] != self.reference[k]}
        assert not wrong, f"{len(wrong)} of {len(keys)} keys differ, e.g. {list(wrong.items())[:3]}"
        lists = ListState[str, str](self.client, self.job, OP, "events", value_serializer="str").get_many(keys)
        bad = [k for k, values in zip(keys, lists) if values != self.events[k]]
        assert not bad, f"{len(bad)} event lists differ, e.g. {bad[0]}"

    def close(self) -> None:
        self.client.close()
