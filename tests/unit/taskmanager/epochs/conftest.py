"""A slot table with real backends (RocksDB or HashMap, both in tmp_path) and the epoch layer over it."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import pytest

from keyedstate.common._proto.v1 import common_pb2
from keyedstate.common._proto.v1 import taskmanager_pb2 as tm_pb
from keyedstate.common.descriptors import (
    NumberType,
    OperatorSpec,
    ReduceField,
    ReduceFunction,
    StateDescriptor,
    StateKind,
)
from keyedstate.common.ids import JobId, KeyGroupRange, OperatorId, SubtaskId, TaskManagerId
from keyedstate.taskmanager.epochs import EpochManager, EpochTransaction, read_committed_epoch
from keyedstate.taskmanager.rpc.task_executor import commit_epoch
from keyedstate.taskmanager.slots import Slot, SlotTable
from keyedstate.taskmanager.state import KeyedStateBackend, StateLimits, create_backend
from tests.fakes.clock import ManualClock

MP = 128
FULL = KeyGroupRange(0, MP - 1)
JOB = JobId("job-1")
OP = OperatorId("op")
ROUTING_VERSION = 1
VEC = struct.Struct(">qdq")  # count (sum), max (float), min (int)

STATES = (
    StateDescriptor("v", StateKind.VALUE),
    StateDescriptor("l", StateKind.LIST),
    StateDescriptor("m", StateKind.MAP),
    StateDescriptor(
        "r",
        StateKind.REDUCING,
        reduce_fields=(
            ReduceField("count"),
            ReduceField("max", ReduceFunction.MAX, NumberType.FLOAT64),
            ReduceField("min", ReduceFunction.MIN, NumberType.INT64),
        ),
    ),
)


def vec(count: int, mx: float, mn: int) -> bytes:
    return VEC.pack(count, mx, mn)


class EpochHarness:
    """Slots of job ``JOB`` deployed on a real SlotTable, served through a real EpochManager."""

    def __init__(self, kind: str, base: Path, limits: StateLimits | None = None) -> None:
        self.kind = kind
        self.work = base / "work"
        self.clock = ManualClock()
        self.limits = limits or StateLimits()
        self.table = SlotTable(4, TaskManagerId("tm-test"))
        self.manager = EpochManager(self.table, self.instance_dir)
        self._next_slot = 0

    def instance_dir(self, subtask: SubtaskId) -> Path:
        return self.work / subtask.instance_dir_name()

    def staging_dir(self, subtask_index: int = 0) -> Path:
        return self.instance_dir(SubtaskId(JOB, OP, subtask_index)) / "staging"

    def deploy(self, subtask_index: int = 0, key_groups: KeyGroupRange = FULL, parallelism: int = 1) -> Slot:
        subtask = SubtaskId(JOB, OP, subtask_index)
        slot = self.table.reserve(
            subtask, OperatorSpec(OP, parallelism, STATES), key_groups, MP, self._next_slot, ROUTING_VERSION, "", False
        )
        self._next_slot += 1
        backend = create_backend(
            self.kind, subtask, key_groups, MP, STATES, local_dir=self.work, limits=self.limits, clock=self.clock
        )
        self.table.activate(slot, backend)
        return slot

    def release(self, subtask_index: int = 0) -> None:
        slot = self.table.remove(SubtaskId(JOB, OP, subtask_index))
        assert slot is not None and slot.backend is not None
        slot.backend.close()

    def slot(self, subtask_index: int = 0) -> Slot:
        return self.table.lookup(JOB, OP, subtask_index)

    def backend(self, subtask_index: int = 0) -> KeyedStateBackend:
        return self.slot(subtask_index).require_backend()

    def view(self, epoch: int, partition: int, attempt: int, subtask_index: int = 0) -> EpochTransaction:
        return self.manager.view(
            self.slot(subtask_index), common_pb2.EpochContext(epoch=epoch, partition=partition, attempt=attempt)
        )

    def commit(self, epoch: int, winners: Mapping[int, int], abort: bool = False) -> tm_pb.EpochCommitResponse:
        """Commit ``epoch``; epochs between the slots' committed one and it are committed empty first
        (the JobManager's epochs are contiguous; these tests start at any epoch)."""
        if not abort:
            self.fill_to(epoch - 1)
        request = tm_pb.EpochCommitRequest(job_id=JOB, epoch=epoch, abort=abort, routing_version=ROUTING_VERSION)
        for partition, attempt in winners.items():
            request.winners.add(partition=partition, attempt=attempt)
        return commit_epoch(self.manager, request)

    def fill_to(self, epoch: int) -> None:
        """Commit empty epochs until every slot of the job holds ``epoch`` (never moves backwards)."""
        held = min((read_committed_epoch(s.require_backend()) for s in self.table.of_job(JOB)), default=epoch)
        for e in range(held + 1, epoch + 1):
            commit_epoch(self.manager, tm_pb.EpochCommitRequest(job_id=JOB, epoch=e, routing_version=ROUTING_VERSION))

    def committed_epoch(self, subtask_index: int = 0) -> int:
        return read_committed_epoch(self.backend(subtask_index))

    def close(self) -> None:
        self.manager.close()
        for slot in self.table.all():
            self.table.remove(slot.subtask)
            if slot.backend is not None:
                slot.backend.close()


@pytest.fixture(params=["rocksdb", "hashmap"])
def backend_kind(request: pytest.FixtureRequest) -> str:
    return cast(str, request.param)


@pytest.fixture
def make_harness(backend_kind: str, tmp_path: Path) -> Iterator[Callable[..., EpochHarness]]:
    """Factory: ``make_harness(limits=StateLimits(...))``; one slot (subtask 0, all key groups) deployed."""
    made: list[EpochHarness] = []

    def make(limits: StateLimits | None = None, deploy: bool = True, **_: Any) -> EpochHarness:
        h = EpochHarness(backend_kind, tmp_path / f"h{len(made)}", limits)
        made.append(h)
        if deploy:
            h.deploy()
        return h

    yield make
    for h in made:
        h.close()


@pytest.fixture
def harness(make_harness: Callable[..., EpochHarness]) -> EpochHarness:
    return make_harness()
