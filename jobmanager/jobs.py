"""Jobs as the JobManager sees them: spec, status, slot assignments and the routing table."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from keyedstate.common.changesets import ChangeSetFile
from keyedstate.common.claim_mode import RecoveryClaimMode
from keyedstate.common.config import Configuration
from keyedstate.common.descriptors import OperatorSpec
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.handles import SlotRestore
from keyedstate.common.ids import JobId, SubtaskId, TaskManagerId, validate_id
from keyedstate.common.keygroups import check_parallelism
from keyedstate.common.lifecycle import JobStatus
from keyedstate.common.rpc.descriptors import operator_spec_from_json, operator_spec_to_json
from keyedstate.jobmanager.checkpoint.coordinator import CheckpointCoordinator
from keyedstate.jobmanager.lineage import EMPTY_LINEAGE, EpochLineage, LineageEntry
from keyedstate.jobmanager.registry import ReportedLimits
from keyedstate.jobmanager.scheduling import SlotAssignment
from keyedstate.jobmanager.status_times import JobStatusTimes


@dataclass(frozen=True)
class JobSpec:
    """What a client submits: the job's operators, their states, and its max parallelism."""

    job_id: JobId
    operators: tuple[OperatorSpec, ...]
    max_parallelism: int
    config: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        validate_id("job id", self.job_id)
        if not self.operators:
            raise InvalidArgumentError(
                f"job {self.job_id!r} declares no operators; declare at least one with its states"
            )
        ids = [o.operator_id for o in self.operators]
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError(f"job {self.job_id!r} declares an operator id twice: {ids}")
        for op in self.operators:
            if not op.states:
                raise InvalidArgumentError(f"operator {op.operator_id!r} declares no states")
            check_parallelism(op.parallelism, self.max_parallelism)

    def operator(self, operator_id: str) -> OperatorSpec | None:
        """The operator's spec, or None if the job has no such operator."""
        return next((o for o in self.operators if o.operator_id == operator_id), None)

    def with_parallelism(self, parallelism: dict[str, int]) -> JobSpec:
        """A copy at new parallelism: ``parallelism`` maps operator id to parallelism, ``""`` to every other operator.

        The copy is validated like a submission (InvalidArgumentError beyond the max parallelism).
        """
        ops = tuple(
            OperatorSpec(o.operator_id, parallelism.get(o.operator_id, parallelism.get("", o.parallelism)), o.states)
            for o in self.operators
        )
        return JobSpec(self.job_id, ops, self.max_parallelism, self.config)

    def same_except_parallelism(self, other: JobSpec) -> bool:
        """Same operators, states, max parallelism and config; parallelism may differ (a rescale)."""
        return self.with_parallelism({op.operator_id: op.parallelism for op in other.operators}) == other

    def parallelism_summary(self) -> str:
        """Each operator's parallelism as ``opx4, op2x2``, for logs and error messages."""
        return ", ".join(f"{op.operator_id}x{op.parallelism}" for op in self.operators)

    def difference(self, other: JobSpec) -> str:
        """What differs between two definitions of a job, in words."""
        if self.max_parallelism != other.max_parallelism:
            return f"max parallelism {self.max_parallelism} vs {other.max_parallelism}"
        mine = {op.operator_id: op for op in self.operators}
        theirs = {op.operator_id: op for op in other.operators}
        if set(mine) != set(theirs):
            return f"operators {sorted(mine)} vs {sorted(theirs)}"
        for op_id, op in mine.items():
            if op.states != theirs[op_id].states:
                return f"the states of operator {op_id!r}"
        if self.config != other.config:
            return "the job's config"
        return f"parallelism {self.parallelism_summary()} vs {other.parallelism_summary()}"

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form stored in high-availability job records (operators as protobuf JSON)."""
        return {
            "job_id": self.job_id,
            "max_parallelism": self.max_parallelism,
            "config": dict(self.config),
            "operators": [operator_spec_to_json(o) for o in self.operators],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobSpec:
        """The inverse of :meth:`to_dict`; raises InvalidArgumentError if the stored spec is not valid."""
        ops = tuple(operator_spec_from_json(o) for o in data["operators"])
        return cls(
            JobId(data["job_id"]), ops, int(data["max_parallelism"]), tuple(sorted(data.get("config", {}).items()))
        )


@dataclass(frozen=True)
class JobRun:
    """Which run of checkpoints and decisions a job's state belongs to, as its HA record names it.

    A submission and an operator restore start a new run; a failover continues the current one.
    An operator restore records the new run before any TaskManager sees the restored state, so a
    JobManager that dies in the middle leaves its successor either the old run or the new one.
    """

    restore_path: str
    """The checkpoint or savepoint the run started from ("" for empty state)."""
    claim_mode: RecoveryClaimMode
    checkpoints_from: int
    """The first checkpoint id of the run: completed checkpoints below it belong to an earlier run."""
    changelog_generation: int
    """Overlapped commits: the run's decisions live in ``changelog/g<n>/``; no other run's are replayed."""


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
    """The epoch every slot of the job holds (docs/exactly-once.md); moves back on every restore."""
    lineage: EpochLineage = EMPTY_LINEAGE
    """Which Spark query's batches the epochs up to ``committed_epoch`` are."""
    applying: int | None = None
    """Overlapped commits: the decided epoch whose apply is running (None: none)."""
    restore_path: str = (
        ""  # what the job was submitted or last restored from: a failover before its first checkpoint restores it
    )
    claim_mode: RecoveryClaimMode = RecoveryClaimMode.NO_CLAIM
    """How the job was restored from ``restore_path`` (``execution.state-recovery.claim-mode``): under
    NO_CLAIM the job never deletes that checkpoint, even once its own checkpoints subsume it."""
    checkpoints_from: int = 0
    """The first checkpoint id of the job's current run of checkpoints: a ``chk-<n>`` below it in
    the job's directory holds state the job no longer has (a run before a resubmission or an
    in-place restore), so a new leader never takes it back."""
    changelog_generation: int = 0
    """Overlapped commits: where the job's decisions go (``changelog/g<n>/``). A new job and an operator
    restore start a new generation, so a restore never replays decisions made on top of state it replaced."""
    failing_over: bool = False  # a failover loop owns the job's restarts
    predecessor: str = ""
    """For a job resubmitted under the id of a cancelled or failed one: where that one's state is."""
    last_taskmanagers: frozenset[TaskManagerId] = frozenset()
    """The TaskManagers of the latest deployment: a redeploy waits until each is fenced."""
    coordinator: CheckpointCoordinator | None = None
    """Its checkpoints (None: the job has no checkpoint storage)."""
    lock: threading.RLock = field(default_factory=threading.RLock)
    """Guards the job's fields; held only briefly (never across a call to a TaskManager)."""
    epoch_lock: threading.Lock = field(default_factory=threading.Lock)
    """Serializes epoch commits with checkpoint cuts (taken before ``lock``, never while holding it).

    A commit holds it from its prepare round to recording the epoch, and a checkpoint from
    reading the epoch to sending its barrier, so no barrier meets half an epoch. It is separate
    from ``lock`` so that a call hanging on an unreachable TaskManager never holds up a failover.
    """
    times: JobStatusTimes = field(default_factory=JobStatusTimes)
    """When the job entered its statuses (Flink's uptime, downtime and restartingTime read it)."""

    def __post_init__(self) -> None:
        self.times.enter(self.status)

    def run(self) -> JobRun:
        """The job's current run (see :class:`JobRun`)."""
        return JobRun(self.restore_path, self.claim_mode, self.checkpoints_from, self.changelog_generation)

    def switch_run(self, run: JobRun) -> None:
        """Make ``run`` the job's run (an operator restore, or its undoing); the caller persists the job."""
        self.restore_path = run.restore_path
        self.claim_mode = run.claim_mode
        self.checkpoints_from = run.checkpoints_from
        self.changelog_generation = run.changelog_generation

    def move_to(self, status: JobStatus) -> None:
        """The job is in ``status`` from now on; the one way a status changes, so that every change is timed."""
        self.status = status
        self.times.enter(status)

    def set_epochs(self, epoch: int, lineage: EpochLineage, *, applying: bool = False) -> None:
        """What the job's state holds now (after a restore, or a commit); ``applying``: an overlapped
        commit decided ``epoch`` and its apply is still running (see :attr:`applied_epoch`)."""
        self.committed_epoch = epoch
        self.lineage = lineage.up_to(epoch)
        self.applying = epoch if applying else None

    def applied(self, epoch: int) -> None:
        """The apply of decided ``epoch`` finished on every slot (caller holds ``lock``)."""
        if self.applying == epoch:
            self.applying = None

    @property
    def applied_epoch(self) -> int:
        """The epoch every slot holds: ``committed_epoch``, or the one before while its apply runs."""
        return self.committed_epoch - 1 if self.applying == self.committed_epoch else self.committed_epoch

    def durable_epoch(self) -> int:
        """The epoch of the latest completed checkpoint (-1: none)."""
        latest = self.coordinator.latest_completed() if self.coordinator is not None else None
        return latest.metadata.epoch if latest is not None else -1

    @property
    def job_id(self) -> JobId:
        """The job's id (its spec's)."""
        return self.spec.job_id

    def routing_table(self) -> RoutingTable:
        """The routing table clients route by, under the current routing version; call with ``lock`` held.

        One route per subtask (its key groups, TaskManager and slot), the job's status, and the strictest state limits
        of the TaskManagers serving it.
        """
        return RoutingTable(
            job_id=self.job_id,
            version=self.routing_version,
            max_parallelism=self.spec.max_parallelism,
            routes=tuple(
                sorted(self.assignments.values(), key=lambda a: (a.subtask.operator_id, a.subtask.subtask_index))
            ),
            job_status=self.status,
            limits=strictest_limits(a.limits for a in self.assignments.values()),
        )

    def info(self) -> JobInfo:
        """The job as GetJob answers it (status, latest checkpoint, epochs, lineage); call with ``lock`` held."""
        latest = self.coordinator.latest_completed() if self.coordinator is not None else None
        return JobInfo(
            job_id=self.job_id,
            status=self.status,
            max_parallelism=self.spec.max_parallelism,
            operators=self.spec.operators,
            latest_checkpoint_id=latest.checkpoint_id if latest is not None else 0,
            latest_checkpoint_path=latest.external_path if latest is not None else "",
            committed_epoch=self.committed_epoch,
            failure_cause=self.failure_cause,
            restarts=self.restarts,
            routing_version=self.routing_version,
            durable_epoch=latest.metadata.epoch if latest is not None else -1,
            lineage=self.lineage.entries,
            applied_epoch=self.applied_epoch,
        )


@dataclass(frozen=True)
class RoutingTable:
    """Which TaskManager slot serves which key groups of a job, under one routing version (GetRouting)."""

    job_id: JobId
    version: int
    max_parallelism: int
    routes: tuple[SlotAssignment, ...]
    """One per subtask, ordered by operator and subtask index."""
    job_status: JobStatus
    limits: ReportedLimits
    """The strictest limits of the TaskManagers serving the job (0: none reported)."""


@dataclass(frozen=True)
class JobInfo:
    """A job as GetJob and statectl show it."""

    job_id: JobId
    status: JobStatus
    max_parallelism: int
    operators: tuple[OperatorSpec, ...]
    latest_checkpoint_id: int
    """0: no completed checkpoint."""
    latest_checkpoint_path: str
    committed_epoch: int
    failure_cause: str
    restarts: int
    routing_version: int
    durable_epoch: int
    """The epoch of the latest completed checkpoint (-1: none)."""
    lineage: tuple[LineageEntry, ...]
    applied_epoch: int = -1
    """The epoch every slot has applied (overlapped commits apply behind the driver)."""


_LIMIT_FIELDS = ("max_key_bytes", "max_value_bytes", "max_list_elements")


def strictest_limits(reported: Iterable[ReportedLimits | None]) -> ReportedLimits:
    """The smallest of each limit over the TaskManagers that reported it (0: none did)."""
    out = dict.fromkeys(_LIMIT_FIELDS, 0)
    for limits in reported:
        if limits is None:
            continue
        for name in _LIMIT_FIELDS:
            value = getattr(limits, name)
            if value > 0 and (out[name] == 0 or value < out[name]):
                out[name] = value
    return ReportedLimits(**out)


@dataclass(frozen=True)
class RestorePlan:
    """What a deployment starts from: per-subtask restore inputs, and the epochs that state holds."""

    slots: dict[SubtaskId, SlotRestore] = field(default_factory=dict)
    """Subtask -> what it restores (absent: the subtask starts empty)."""
    epoch: int = -1
    lineage: EpochLineage = EMPTY_LINEAGE
    source: str = ""
    """The checkpoint or savepoint path ("" for empty state)."""
    replay: tuple[ChangeSetFile, ...] = ()
    """Overlapped commits: the change sets of the decided epochs above the restored state (``epoch`` and
    ``lineage`` are after them); each slot folds in those of its operator."""
    replayed_epochs: int = 0
    """Overlapped commits: how many decided epochs above the restored state the deploy replays (0: none)."""


EMPTY_PLAN = RestorePlan()
