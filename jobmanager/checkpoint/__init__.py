"""The JobManager's checkpoint domain: coordinator, pending and completed checkpoints, retention, restore.

Vocabulary and state machine follow Flink's ``org.apache.flink.runtime.checkpoint``; the
storage layout and the ``_metadata`` format are documented in :mod:`.coordinator` and
:mod:`.metadata`.
"""

from keyedstate.common.lifecycle import CheckpointStatus
from keyedstate.jobmanager.checkpoint.cleaner import CheckpointsCleaner, InlineExecutor
from keyedstate.jobmanager.checkpoint.completed import (
    CompletedCheckpoint,
    CompletedCheckpointStore,
    StandaloneCompletedCheckpointStore,
)
from keyedstate.jobmanager.checkpoint.coordinator import CheckpointCoordinator, CoordinatorConfig, CoordinatorServices
from keyedstate.jobmanager.checkpoint.failure import (
    CheckpointException,
    CheckpointFailureReason,
    CheckpointInProgressError,
    CheckpointNotFoundError,
    DeclineReason,
)
from keyedstate.jobmanager.checkpoint.gateway import CheckpointGateway, EpochCut
from keyedstate.jobmanager.checkpoint.gc import GcEntry, GcPlan, execute, plan_gc
from keyedstate.jobmanager.checkpoint.id_counter import CheckpointIDCounter, StandaloneCheckpointIDCounter
from keyedstate.jobmanager.checkpoint.metadata import (
    CheckpointMetadata,
    FileRef,
    OperatorSnapshot,
    SubtaskSnapshot,
)
from keyedstate.jobmanager.checkpoint.ownership import RestoreOwnership, decide_ownership, references_restored
from keyedstate.jobmanager.checkpoint.pending import AckOutcome, PendingCheckpoint, PendingStatus
from keyedstate.jobmanager.checkpoint.restore import (
    checkpoint_dir_of,
    find_latest_checkpoint,
    load_checkpoint,
    load_completed_checkpoint,
    plan_restore,
    verify_checksums,
    verify_files_exist,
)
from keyedstate.jobmanager.checkpoint.settings import CheckpointingSettings
from keyedstate.jobmanager.checkpoint.shared_registry import SharedStateRegistry
from keyedstate.jobmanager.checkpoint.stats import CheckpointStatsEntry, CheckpointStatsTracker, SubtaskAckStats
from keyedstate.jobmanager.checkpoint.summary import CheckpointSummary

__all__ = [
    "AckOutcome",
    "CheckpointCoordinator",
    "CheckpointException",
    "CheckpointFailureReason",
    "CheckpointGateway",
    "CheckpointIDCounter",
    "CheckpointInProgressError",
    "CheckpointMetadata",
    "CheckpointNotFoundError",
    "CheckpointStatsEntry",
    "CheckpointStatsTracker",
    "CheckpointStatus",
    "CheckpointSummary",
    "CheckpointingSettings",
    "CheckpointsCleaner",
    "CompletedCheckpoint",
    "CompletedCheckpointStore",
    "CoordinatorConfig",
    "CoordinatorServices",
    "DeclineReason",
    "EpochCut",
    "FileRef",
    "GcEntry",
    "GcPlan",
    "InlineExecutor",
    "OperatorSnapshot",
    "PendingCheckpoint",
    "PendingStatus",
    "RestoreOwnership",
    "SharedStateRegistry",
    "StandaloneCheckpointIDCounter",
    "StandaloneCompletedCheckpointStore",
    "SubtaskAckStats",
    "SubtaskSnapshot",
    "checkpoint_dir_of",
    "decide_ownership",
    "execute",
    "find_latest_checkpoint",
    "load_checkpoint",
    "load_completed_checkpoint",
    "plan_gc",
    "plan_restore",
    "references_restored",
    "verify_checksums",
    "verify_files_exist",
]
