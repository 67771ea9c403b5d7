"""Exactly-once epoch transactions on the TaskManager.

Writes carrying an ``EpochContext`` (micro-batch, partition, attempt) are staged per slot in a
RocksDB staging database; reads of the same attempt merge committed state with its staged
writes; ``CommitEpoch`` applies the winning attempts atomically per slot and records the
committed epoch in the slot's metadata (``state.metadata.COMMITTED_EPOCH``), which checkpoints report.
"""

from keyedstate.taskmanager.epochs.attempt import TaskAttempt
from keyedstate.taskmanager.epochs.manager import AttemptContext, CommitResult, EpochManager
from keyedstate.taskmanager.epochs.slot import NO_EPOCH, EpochCommitError, SlotEpochs, read_committed_epoch
from keyedstate.taskmanager.epochs.staging import STAGING_DIR, StagingOptions, StagingStore
from keyedstate.taskmanager.epochs.transaction import EpochTransaction

__all__ = [
    "NO_EPOCH",
    "STAGING_DIR",
    "AttemptContext",
    "CommitResult",
    "EpochCommitError",
    "EpochManager",
    "EpochTransaction",
    "SlotEpochs",
    "StagingOptions",
    "StagingStore",
    "TaskAttempt",
    "read_committed_epoch",
]
