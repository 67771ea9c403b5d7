"""How the coordinator reaches a job's TaskManagers: the barrier it sends and the gateway protocol."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from keyedstate.common._proto.v1 import taskmanager_pb2 as tm_pb
from keyedstate.common.ids import SubtaskId
from keyedstate.jobmanager.lineage import EMPTY_LINEAGE, EpochLineage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointBarrier:
    """What every TaskManager hosting the job receives to start a snapshot."""

    job_id: str
    checkpoint_id: int
    timestamp_ms: int
    """Trigger time (wall clock); recorded in ``_metadata``."""
    target_path: str
    """Absolute URL of the directory for this snapshot's own files (``…/chk-<n>`` or the savepoint dir)."""
    savepoint: bool
    """Upload every file into ``target_path`` (self-contained), sharing nothing."""
    incremental: bool
    """Upload only SST files not already confirmed in ``shared/``."""
    epoch: int
    """The epoch every slot holds at the cut (-1: none); a slot holding another refuses the barrier."""

    def to_proto(self) -> tm_pb.CheckpointBarrier:
        return tm_pb.CheckpointBarrier(
            job_id=self.job_id,
            checkpoint_id=self.checkpoint_id,
            timestamp_ms=self.timestamp_ms,
            target_path=self.target_path,
            savepoint=self.savepoint,
            incremental=self.incremental,
            epoch=self.epoch,
        )


@dataclass(frozen=True)
class EpochCut:
    """The epoch every slot of the job holds at a checkpoint's cut, and the lineage of those epochs."""

    epoch: int = -1
    lineage: EpochLineage = EMPTY_LINEAGE
    running: frozenset[SubtaskId] | None = None
    """The subtasks running at the cut, whose TaskManagers get the barrier (None: the coordinator asks its
    ``tasks`` callback). Empty while the job is not RUNNING, so nothing is checkpointed mid-restart."""


class CheckpointGateway(Protocol):
    """How the coordinator reaches the TaskManagers of its job."""

    def cut(self) -> AbstractContextManager[EpochCut]:
        """Hold the job's epoch commits back and yield the epoch every slot holds now.

        The coordinator creates the checkpoint and sends its barrier inside this block, so no
        commit can land between the epoch it records and the snapshots the slots take.
        """

    def send_barrier(self, barrier: CheckpointBarrier) -> None:
        """Deliver the barrier to every TaskManager of the job; UnavailableError if one is unreachable."""

    def notify(self, job_id: str, checkpoint_id: int, completed: bool) -> None:
        """Tell the TaskManagers a checkpoint completed or was aborted (best effort)."""
