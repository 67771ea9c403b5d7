"""How the coordinator reaches a job's TaskManagers: the epoch cut and the gateway protocol.

The barrier itself is the domain ``common.handles.CheckpointBarrier``, which the TaskManager
gateway converts to its message at the RPC edge.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from keyedstate.common.handles import CheckpointBarrier
from keyedstate.common.ids import CheckpointId, JobId, SubtaskId
from keyedstate.jobmanager.lineage import EMPTY_LINEAGE, EpochLineage

logger = logging.getLogger(__name__)

__all__ = ["CheckpointGateway", "EpochCut"]


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

    def notify(self, job_id: JobId, checkpoint_id: CheckpointId, completed: bool) -> None:
        """Tell the TaskManagers a checkpoint completed or was aborted (best effort)."""
