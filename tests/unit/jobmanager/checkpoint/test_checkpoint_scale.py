"""Scale check (no timing assertion): 1,000 subtasks acknowledging at once on local storage."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.handles import CheckpointBarrier, SubtaskStateHandle
from keyedstate.common.ids import JobId
from keyedstate.common.keygroups import key_group_range_for_subtask
from keyedstate.common.rpc.convert import handle_from_proto
from keyedstate.jobmanager.checkpoint import (
    CheckpointCoordinator,
    CheckpointingSettings,
    CheckpointsCleaner,
    CheckpointStatsTracker,
    CoordinatorConfig,
    CoordinatorServices,
    EpochCut,
    InlineExecutor,
)

MAX_P = 4096
OPERATORS = [OperatorSpec(f"op{i}", 250, (StateDescriptor("s", StateKind.VALUE),)) for i in range(4)]


class ImmediateAcks:
    """Every subtask acknowledges inside send_barrier with a prepared handle of three files."""

    def __init__(self) -> None:
        self.coordinator: CheckpointCoordinator | None = None
        self.handles: list[SubtaskStateHandle] = []
        for op in OPERATORS:
            for i in range(op.parallelism):
                kg = key_group_range_for_subtask(MAX_P, op.parallelism, i)
                h = pb.SubtaskStateHandle(
                    operator_id=op.operator_id,
                    subtask_index=i,
                    backend="rocksdb",
                    key_groups=pb.KeyGroupRange(start=kg.start, end=kg.end),
                    full_size=3000,
                )
                for n in range(3):
                    h.files.add(
                        path=f"shared/{op.operator_id}-{i}-{n}.sst",
                        size=1000,
                        sha256="0" * 64,
                        local_name=f"{n:06d}.sst",
                        shared=True,
                    )
                self.handles.append(handle_from_proto(h))
        self.notified: list[tuple[int, bool]] = []

    @contextlib.contextmanager
    def cut(self) -> Iterator[EpochCut]:
        yield EpochCut(0)  # the simulated snapshots all hold epoch 0

    def send_barrier(self, barrier: CheckpointBarrier) -> None:
        assert self.coordinator is not None
        for h in self.handles:
            self.coordinator.acknowledge(barrier.checkpoint_id, h)

    def notify(self, job_id: str, checkpoint_id: int, completed: bool) -> None:
        self.notified.append((checkpoint_id, completed))


def test_thousand_subtasks(storage: Any, tmp_path: Path, clock: Any, scheduler: Any, record_property: Any) -> None:
    gateway = ImmediateAcks()
    job_dir = (tmp_path / "ckpt" / "big").as_uri()
    coordinator = CheckpointCoordinator(
        CoordinatorConfig(JobId("big"), job_dir, MAX_P, CheckpointingSettings()),
        CoordinatorServices(
            storage,
            gateway,
            clock,
            scheduler,
            stats=CheckpointStatsTracker(JobId("big"), CollectorRegistry()),
            cleaner=CheckpointsCleaner(storage, InlineExecutor()),
        ),
        operators=OPERATORS,
    )
    gateway.coordinator = coordinator
    timings = []
    for _ in range(3):
        start = time.perf_counter()
        pending = coordinator.trigger()
        timings.append((time.perf_counter() - start) * 1000)
        assert coordinator.wait_for(pending.checkpoint_id, timeout=0).checkpoint_id == pending.checkpoint_id
    meta_path = tmp_path / "ckpt" / "big" / "chk-3" / "_metadata"
    meta = json.loads(meta_path.read_text())
    assert sum(len(op["subtasks"]) for op in meta["operators"]) == 1000
    assert gateway.notified == [(1, True), (2, True), (3, True)]
    summary = (
        f"1000 subtasks x 3 files: trigger->_metadata {', '.join(f'{t:.0f}' for t in timings)} ms; "
        f"_metadata {meta_path.stat().st_size // 1024} KiB"
    )
    record_property("scale", summary)
    print(summary)
