"""Fixtures for the checkpoint domain: real file:// storage, manual time, and simulated TaskManagers.

The simulated TaskManagers are in-process objects that do what real ones do at the storage
level: on a barrier each subtask uploads real files (an exclusive manifest in the checkpoint
directory, SST-like files in ``shared/`` that later checkpoints reuse once confirmed) and
acknowledges with a ``SubtaskStateHandle``. Behaviour per test: acknowledge at once, wait for
the test to drive acks, decline, stay silent, or be unreachable.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.errors import UnavailableError
from keyedstate.common.handles import CheckpointBarrier, SubtaskStateHandle
from keyedstate.common.ids import CheckpointId, JobId, SubtaskId
from keyedstate.common.keygroups import key_group_range_for_subtask
from keyedstate.common.rpc.convert import handle_from_proto
from keyedstate.common.storage import open_storage
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
from tests.fakes.clock import ManualClock
from tests.fakes.scheduler import ManualScheduler

JOB = JobId("job-1")
MAX_P = 8


def default_operators() -> list[OperatorSpec]:
    return [
        OperatorSpec("counts", 2, (StateDescriptor("total", StateKind.VALUE),)),
        OperatorSpec("sessions", 1, (StateDescriptor("events", StateKind.LIST),)),
    ]


@dataclass
class SimulatedTaskManagers:
    """A CheckpointGateway whose TaskManagers live in this process and write real files."""

    storage: Any
    job_dir: str
    operators: list[OperatorSpec]
    max_parallelism: int = MAX_P
    mode: str = "ack"  # ack | manual | decline | silent | unavailable | partial
    decline_subtask: SubtaskId | None = None
    write_files: bool = True
    exclusive_files: bool = True
    sst_window: int = 2  # confirmed SSTs each snapshot keeps referencing (older ones are "compacted")
    committed_epoch: int = -1  # a job that never committed an epoch
    coordinator: CheckpointCoordinator | None = None
    barriers: list[CheckpointBarrier] = field(default_factory=list)
    notifications: list[tuple[int, bool]] = field(default_factory=list)
    outcomes: list[Any] = field(default_factory=list)
    confirmed: dict[SubtaskId, list[str]] = field(default_factory=dict)  # shared names per subtask
    _uploaded: dict[tuple[int, SubtaskId], list[str]] = field(default_factory=dict)

    def subtasks(self) -> list[SubtaskId]:
        return [SubtaskId(JOB, op.operator_id, i) for op in self.operators for i in range(op.parallelism)]

    # -- CheckpointGateway ---------------------------------------------------------------------
    @contextmanager
    def cut(self) -> Iterator[EpochCut]:
        yield EpochCut(self.committed_epoch)

    def send_barrier(self, barrier: CheckpointBarrier) -> None:
        self.barriers.append(barrier)
        if self.mode == "unavailable":
            raise UnavailableError("TaskManager tm-2 at 127.0.0.1:1 is unreachable")
        if self.mode == "ack":
            self.ack_all(barrier.checkpoint_id)
        elif self.mode == "partial":
            first = self.subtasks()[0]
            self.ack(first, barrier.checkpoint_id)
            raise UnavailableError("TaskManager tm-2 went away while the barrier was being delivered")
        elif self.mode == "decline":
            victim = self.decline_subtask or self.subtasks()[-1]
            for s in self.subtasks():
                if s != victim:
                    self.ack(s, barrier.checkpoint_id)
            assert self.coordinator is not None
            self.outcomes.append(
                self.coordinator.decline(barrier.checkpoint_id, victim, "RocksDB snapshot failed: disk full")
            )

    def notify(self, job_id: str, checkpoint_id: int, completed: bool) -> None:
        self.notifications.append((checkpoint_id, completed))
        for (cid, subtask), names in list(self._uploaded.items()):
            if cid == checkpoint_id and completed:
                self.confirmed[subtask] = (self.confirmed.get(subtask, []) + names)[-self.sst_window :]

    # -- driving acks --------------------------------------------------------------------------
    def barrier(self, checkpoint_id: int) -> CheckpointBarrier:
        return next(b for b in self.barriers if b.checkpoint_id == checkpoint_id)

    def ack_all(self, checkpoint_id: int) -> list[Any]:
        return [self.ack(s, checkpoint_id) for s in self.subtasks()]

    def ack(self, subtask: SubtaskId, checkpoint_id: int, *, reuse: list[str] | None = None) -> Any:
        assert self.coordinator is not None
        outcome = self.coordinator.acknowledge(
            CheckpointId(checkpoint_id), self.snapshot(subtask, checkpoint_id, reuse=reuse)
        )
        self.outcomes.append(outcome)
        return outcome

    def snapshot(self, subtask: SubtaskId, checkpoint_id: int, *, reuse: list[str] | None = None) -> SubtaskStateHandle:
        """Upload this subtask's files for the checkpoint and return its handle."""
        barrier = self.barrier(checkpoint_id)
        op = next(o for o in self.operators if o.operator_id == subtask.operator_id)
        kg = key_group_range_for_subtask(self.max_parallelism, op.parallelism, subtask.subtask_index)
        handle = pb.SubtaskStateHandle(
            operator_id=subtask.operator_id,
            subtask_index=subtask.subtask_index,
            key_groups=pb.KeyGroupRange(start=kg.start, end=kg.end),
            backend="rocksdb",
            committed_epoch=self.committed_epoch,
        )
        tag = f"{subtask.operator_id}-{subtask.subtask_index}"
        uploaded = 0
        if barrier.savepoint:
            # Self-contained: every SST is copied into the savepoint directory.
            for name in self.confirmed.get(subtask, []) + [f"{tag}-{checkpoint_id}.sst"]:
                uploaded += self._file(handle, barrier.target_path, f"{tag}/{name}", f"{tag}/{name}", shared=False)
        else:
            new = f"{tag}-{checkpoint_id}.sst"
            uploaded += self._file(handle, self.job_dir + "/shared", new, "shared/" + new, shared=True)
            for name in self.confirmed.get(subtask, []) if reuse is None else reuse:
                self._file(handle, self.job_dir + "/shared", name, "shared/" + name, shared=True, upload=False)
            self._uploaded[(checkpoint_id, subtask)] = [new]
        if self.exclusive_files:
            uploaded += self._file(handle, barrier.target_path, f"{tag}/MANIFEST", f"{tag}/MANIFEST", shared=False)
        handle.incremental_size = uploaded
        handle.full_size = sum(f.size for f in handle.files)
        return handle_from_proto(handle)

    def _file(
        self, handle: pb.SubtaskStateHandle, base: str, rel: str, path: str, *, shared: bool, upload: bool = True
    ) -> int:
        data = f"{handle.operator_id}/{handle.subtask_index}/{rel}".encode() * 4
        if upload and self.write_files:
            self.storage.write_bytes(f"{base}/{rel}", data)
        handle.files.add(
            path=path,
            size=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
            local_name=rel.rsplit("/", 1)[-1],
            shared=shared,
        )
        return len(data) if upload else 0


@dataclass
class Harness:
    coordinator: CheckpointCoordinator
    cluster: SimulatedTaskManagers
    storage: Any
    job_dir: str
    clock: ManualClock
    scheduler: ManualScheduler
    registry: CollectorRegistry
    failovers: list[tuple[Any, str]]

    def files(self, root: str | None = None) -> set[str]:
        """Every file below a file:// directory (default: the job dir), relative to it."""
        base = Path((root or self.job_dir)[len("file://") :])
        return {str(p.relative_to(base)) for p in base.rglob("*") if p.is_file()} if base.exists() else set()

    def metric(self, name: str) -> float | None:
        return self.registry.get_sample_value(f"flink_jobmanager_job_{name}", {"job_id": JOB})


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def scheduler(clock: ManualClock) -> ManualScheduler:
    return ManualScheduler(clock)


@pytest.fixture
def storage(tmp_path: Any) -> Any:
    return open_storage(tmp_path.as_uri())


@pytest.fixture
def job_dir(tmp_path: Path) -> str:
    return (tmp_path / "checkpoints" / JOB).as_uri()


@pytest.fixture
def make_harness(
    storage: Any, job_dir: str, clock: ManualClock, scheduler: ManualScheduler, tmp_path: Any
) -> Callable[..., Harness]:
    def make(
        *,
        operators: list[OperatorSpec] | None = None,
        tasks: Any = None,
        mode: str = "ack",
        storage_override: Any = None,
        job_dir_override: str | None = None,
        cleaner_executor: Any = None,
        coordinator_kwargs: dict[str, Any] | None = None,
        **settings: Any,
    ) -> Harness:
        ops = operators or default_operators()
        st = storage_override or storage
        jd = job_dir_override or job_dir
        cluster = SimulatedTaskManagers(st, jd, ops, mode=mode)
        registry = CollectorRegistry()
        failovers: list[tuple[Any, str]] = []
        config = CoordinatorConfig(
            JobId(JOB),
            jd,
            MAX_P,
            CheckpointingSettings(**settings),
            savepoints_dir=(tmp_path / "savepoints").as_uri(),
        )
        services = CoordinatorServices(
            st,
            cluster,
            clock,
            scheduler,
            stats=CheckpointStatsTracker(JOB, registry),
            cleaner=CheckpointsCleaner(st, cleaner_executor or InlineExecutor()),
            **(coordinator_kwargs or {}),
        )
        coordinator = CheckpointCoordinator(
            config,
            services,
            operators=ops,
            tasks=tasks,
            on_failover=lambda reason, message: failovers.append((reason, message)),
        )
        cluster.coordinator = coordinator
        return Harness(coordinator, cluster, st, jd, clock, scheduler, registry, failovers)

    return make
