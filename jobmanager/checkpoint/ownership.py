"""Whether a job owns the files of the checkpoint it restores from (Flink's claim modes at work).

The answer decides two things. On the JobManager, whether the checkpoint joins the job's store
and shared-state registry (its files are then deleted once no retained checkpoint references
them) or stays untouched. On the TaskManagers, whether the first incremental checkpoint after
the restore may reference the restored ``shared/`` files instead of uploading them again.
"""

from __future__ import annotations

import enum

from keyedstate.common.claim_mode import RecoveryClaimMode
from keyedstate.jobmanager.checkpoint import _paths
from keyedstate.jobmanager.checkpoint.completed import CompletedCheckpoint


class RestoreOwnership(enum.Enum):
    """Who owns a restored checkpoint's files."""

    OWNED = "OWNED"
    """One of the job's own retained checkpoints (failover, a JobManager restart): already registered."""
    CLAIMED = "CLAIMED"
    """Taken over by this restore (CLAIM): registered now, deleted once subsumed."""
    USER = "USER"
    """The user's (NO_CLAIM): never deleted by the job, never referenced by its checkpoints."""

    @property
    def job_owns_files(self) -> bool:
        """New checkpoints may reference the restored shared files (the registry counts them)."""
        return self is not RestoreOwnership.USER


def decide_ownership(
    mode: RecoveryClaimMode, checkpoint: CompletedCheckpoint, job_dir: str, *, recovery: bool = False
) -> RestoreOwnership:
    """Who owns ``checkpoint``'s files once the job in ``job_dir`` restores from it in ``mode``.

    ``recovery``: the job restores its own latest retained checkpoint (failover, a new leader),
    whatever mode it was first restored in. CLAIM takes over any snapshot, as Flink does: a
    savepoint or another job's checkpoint too (its ``chk-<n>`` directory, not that job's
    directory). Only files in this job's ``shared/`` can be referenced by its new checkpoints
    (they name them ``../shared/<name>``), so after claiming a savepoint or a checkpoint of
    another directory the first checkpoint uploads the state again, see :func:`references_restored`.
    """
    if recovery:
        return RestoreOwnership.OWNED
    if mode is RecoveryClaimMode.NO_CLAIM:
        return RestoreOwnership.USER
    return RestoreOwnership.CLAIMED


def references_restored(checkpoint: CompletedCheckpoint, job_dir: str) -> bool:
    """Whether the job's new checkpoints can reference ``checkpoint``'s shared files: they lie in its ``shared/``."""
    pool = _paths.join(_paths.normalize(job_dir), _paths.SHARED_DIR)
    return bool(checkpoint.shared_files) and all(
        _paths.relative_to(f, pool) is not None for f in checkpoint.shared_files
    )
