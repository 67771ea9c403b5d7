"""Whether a job owns the files of the checkpoint it restores from (Flink's claim modes at work).

The answer decides two things. On the JobManager, whether the checkpoint joins the job's store
and shared-state registry (its files are then deleted once no retained checkpoint references
them) or stays untouched. On the TaskManagers, whether the first incremental checkpoint after
the restore may reference the restored ``shared/`` files instead of uploading them again.
"""

from __future__ import annotations

import enum

from keyedstate.common.claim_mode import RecoveryClaimMode
from keyedstate.common.errors import InvalidArgumentError
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
    whatever mode it was first restored in. CLAIM takes over only a checkpoint of the job's own
    directory: new checkpoints name shared files as ``../shared/<name>``, so files elsewhere
    cannot be referenced, and a savepoint (self-contained, with no ``shared/`` files) has
    nothing to reference; both are refused with InvalidArgumentError instead of being taken
    over without the saving CLAIM is for.
    """
    if recovery:
        return RestoreOwnership.OWNED
    if mode is RecoveryClaimMode.NO_CLAIM:
        return RestoreOwnership.USER
    where = checkpoint.external_path
    if checkpoint.savepoint:
        raise InvalidArgumentError(
            f"claim mode CLAIM cannot take over savepoint {where}: a savepoint is the user's and self-contained, so "
            "new incremental checkpoints could not reference its files; restore it with claim mode NO_CLAIM (the "
            "first checkpoint is then a full one)"
        )
    if _paths.relative_to(_paths.normalize(where), _paths.normalize(job_dir)) is None:
        raise InvalidArgumentError(
            f"claim mode CLAIM takes over only checkpoints of the job's own directory {job_dir}, and {where} lies "
            "outside it (another job id or checkpoint dir); restore it with claim mode NO_CLAIM (the first "
            "checkpoint is then a full one), or restore a checkpoint of this job"
        )
    return RestoreOwnership.CLAIMED
