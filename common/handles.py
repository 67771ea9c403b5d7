"""What a checkpoint is made of, as domain types (no protobuf), shared by both daemons.

The JobManager sends a barrier, a TaskManager acknowledges each slot's ``SubtaskStateHandle``,
the JobManager keeps the handles in ``_metadata`` and hands them back in a ``SlotRestore``.
Both sides work with these types only; ``common.rpc.convert`` is the one place that turns them
into messages and back. Field meanings match ``common.proto`` (``StateFileHandle``,
``SubtaskStateHandle``), in the spirit of Flink's ``OperatorSubtaskState`` and ``StreamStateHandle``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from keyedstate.common.ids import CheckpointId, JobId, KeyGroupRange, OperatorId


@dataclass(frozen=True)
class CheckpointBarrier:
    """The JobManager's order to snapshot every slot of a job (a checkpoint or a savepoint)."""

    job_id: JobId
    checkpoint_id: CheckpointId
    target_path: str
    """Where this checkpoint's own files go: ``<job dir>/chk-<n>`` or the savepoint directory."""
    epoch: int = 0
    """The job epoch the cut was taken at; every slot of the job must hold exactly it."""
    savepoint: bool = False
    incremental: bool = False
    timestamp_ms: int = 0
    """Trigger time (wall clock), as recorded in ``_metadata``; informational for the TaskManager."""
    inline_max_state_size: int = 0
    """> 0: the checkpoint lives in the JobManager's memory (``execution.checkpointing.storage:
    jobmanager``): each slot sends its files' bytes inline in its acknowledgement, and declines
    with :attr:`DeclineReason.STATE_SIZE_LIMIT_EXCEEDED` past this many bytes. 0: upload to ``target_path``."""


class DeclineReason(enum.Enum):
    """Why a subtask declined a checkpoint, as its TaskManager says (the wire's ``DeclineReason``)."""

    UNSPECIFIED = "UNSPECIFIED"
    SNAPSHOT_FAILED = "SNAPSHOT_FAILED"
    """Taking or uploading the slot's snapshot failed (the message says how)."""
    STATE_SIZE_LIMIT_EXCEEDED = "STATE_SIZE_LIMIT_EXCEEDED"
    """The slot's snapshot is larger than the JobManager checkpoint storage takes inline."""


@dataclass(frozen=True)
class StateFileHandle:
    """One uploaded file of a snapshot."""

    path: str
    """Relative to the checkpoint directory (``../shared/...`` for shared files)."""
    size: int
    sha256: str
    local_name: str = ""
    """The file's name inside the snapshot (for example ``000012.sst``)."""
    shared: bool = False
    data: bytes | None = field(default=None, repr=False, compare=False)
    """The file's bytes, sent inline when the checkpoint lives in the JobManager's memory (None: in storage)."""


@dataclass(frozen=True)
class ChangelogSegmentHandle:
    """One uploaded changelog segment: the change sets of epochs ``first_epoch..last_epoch`` of one slot."""

    path: str
    """Like :attr:`StateFileHandle.path` (``../shared/...`` in a checkpoint)."""
    first_epoch: int
    last_epoch: int
    size: int
    sha256: str


@dataclass
class SubtaskStateHandle:
    """One slot's part of a checkpoint, as acknowledged to the JobManager.

    With changelog checkpoints, :attr:`files` are the slot's last materialized snapshot (it holds
    epochs up to :attr:`materialized_epoch`) and :attr:`changelog` the segments committed after
    it, up to :attr:`committed_epoch`; a restore restores the files and replays the segments.
    """

    operator_id: OperatorId
    subtask_index: int
    key_groups: KeyGroupRange
    backend: str
    files: list[StateFileHandle] = field(default_factory=list)
    incremental_size: int = 0
    full_size: int = 0
    sync_duration_ms: int = 0
    async_duration_ms: int = 0
    committed_epoch: int = -1
    changelog: list[ChangelogSegmentHandle] = field(default_factory=list)
    materialized_epoch: int | None = None
    """The epoch :attr:`files` hold; None: :attr:`committed_epoch` (no changelog)."""

    @property
    def snapshot_epoch(self) -> int:
        """The epoch the snapshot files hold (the changelog replays what follows it)."""
        return self.committed_epoch if self.materialized_epoch is None else self.materialized_epoch


@dataclass(frozen=True)
class SlotRestore:
    """The snapshots a slot is restored from (those overlapping its key groups)."""

    checkpoint_id: CheckpointId
    handles: tuple[SubtaskStateHandle, ...] = ()
    checkpoint_path: str = ""
    """The checkpoint or savepoint directory (informational: the handles' paths are already resolved)."""
    owned: bool = False
    """The job owns the restored files (CLAIM, failover, a JobManager restart): the slot's next incremental
    checkpoint references its restored ``shared/`` files instead of uploading them again. False (NO_CLAIM):
    it references nothing of the restored checkpoint, so the user may delete it once that one completed."""
