"""Jobs as the JobManager sees them: spec, status, slot assignments and the routing table."""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Any

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.config import Configuration
from keyedstate.common.descriptors import OperatorSpec
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.ids import SubtaskId, validate_id
from keyedstate.common.keygroups import check_parallelism
from keyedstate.jobmanager.scheduling import SlotAssignment


class JobStatus(enum.Enum):
    CREATED = "CREATED"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    FAILED = "FAILED"
    CANCELED = "CANCELED"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.FAILED, JobStatus.CANCELED)


@dataclass(frozen=True)
class JobSpec:
    """What a client submits: the job's operators, their states, and its max parallelism."""

    job_id: str
    operators: tuple[OperatorSpec, ...]
    max_parallelism: int
    config: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        validate_id("job id", self.job_id)
        if not self.operators:
            raise InvalidArgumentError(f"job {self.job_id!r} declares no operators; declare at least one with its states")
        ids = [o.operator_id for o in self.operators]
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError(f"job {self.job_id!r} declares an operator id twice: {ids}")
        for op in self.operators:
            if not op.states:
                raise InvalidArgumentError(f"operator {op.operator_id!r} declares no states")
            check_parallelism(op.parallelism, self.max_parallelism)

    def operator(self, operator_id: str) -> OperatorSpec | None:
        return next((o for o in self.operators if o.operator_id == operator_id), None)

    def with_parallelism(self, parallelism: dict[str, int]) -> JobSpec:
        ops = tuple(
            OperatorSpec(o.operator_id, parallelism.get(o.operator_id, parallelism.get("", o.parallelism)), o.states)
            for o in self.operators
        )
        return JobSpec(self.job_id, ops, self.max_parallelism, self.config)

    def to_dict(self) -> dict[str, Any]:
        from google.protobuf import json_format

        return {
            "job_id": self.job_id,
            "max_parallelism": self.max_parallelism,
            "config": dict(self.config),
            "operators": [json_format.MessageToDict(o.to_proto()) for o in self.operators],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobSpec:
        from google.protobuf import json_format

        ops = tuple(OperatorSpec.from_proto(json_format.ParseDict(o, pb.OperatorSpec())) for o in data["operators"])
        return cls(data["job_id"], ops, int(data["max_parallelism"]), tuple(sorted(data.get("config", {}).items())))


@dataclass
class Job:
    spec: JobSpec
    config: Configuration
    status: JobStatus = JobStatus.CREATED
    assignments: dict[SubtaskId, SlotAssignment] = field(default_factory=dict)
    routing_version: int = 0
    failure_cause: str = ""
    restarts: int = 0
    committed_epoch: int = -1
    restore_path: str = ""  # what the job was submitted from: a failover before its first checkpoint restores it
    failing_over: bool = False  # a failover loop owns the job's restarts
    coordinator: Any = None
    lock: threading.RLock = field(default_factory=threading.RLock)

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    def routing_table(self) -> pb.RoutingTable:
        routes = [
            pb.Route(
                operator_id=a.subtask.operator_id,
                subtask_index=a.subtask.subtask_index,
                key_groups=pb.KeyGroupRange(start=a.key_groups.start, end=a.key_groups.end),
                taskmanager_id=a.taskmanager_id,
                address=a.address,
                slot_index=a.slot_index,
            )
            for a in sorted(self.assignments.values(), key=lambda a: (a.subtask.operator_id, a.subtask.subtask_index))
        ]
        return pb.RoutingTable(
            job_id=self.job_id, version=self.routing_version, max_parallelism=self.spec.max_parallelism,
            routes=routes, job_status=self.status.value,
        )

    def info(self) -> jm_pb.JobInfo:
        latest = self.coordinator.latest_completed() if self.coordinator is not None else None
        return jm_pb.JobInfo(
            job_id=self.job_id,
            status=self.status.value,
            max_parallelism=self.spec.max_parallelism,
            operators=[o.to_proto() for o in self.spec.operators],
            latest_checkpoint_id=latest.checkpoint_id if latest is not None else 0,
            latest_checkpoint_path=latest.external_path if latest is not None else "",
            committed_epoch=self.committed_epoch,
            failure_cause=self.failure_cause,
            restarts=self.restarts,
        )
