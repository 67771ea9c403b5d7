"""Change sets of overlapped commits, as both daemons speak of them (no protobuf).

In ``execution.checkpointing.commit-mode: overlapped`` each slot writes, at Prepare, the winners'
staged operations of the epoch to ``changelog/<E>/v<version>-<operator>-<subtask>`` under the
job's checkpoint directory (docs/exactly-once.md, "Overlapped commits"). The JobManager names
those files in the epoch's decision and hands them back to the slots of a restore, which fold
them into the restored state. ``common.rpc.convert`` turns :class:`ChangeSetFile` into the
wire's ``ChangeSetFile`` and back.
"""

from __future__ import annotations

from dataclasses import dataclass

CHANGELOG_DIR = "changelog"


def change_set_name(epoch: int, routing_version: int, operator_id: str, subtask_index: int) -> str:
    """Where one slot's change set of ``epoch`` goes, relative to the job's checkpoint directory.

    The routing version makes the name unique per deployment: a re-run of a batch under a new
    deployment never overwrites a change set a decision of the old one names.
    """
    return f"{CHANGELOG_DIR}/{epoch}/v{routing_version}-{operator_id}-{subtask_index}"


@dataclass(frozen=True)
class ChangeSetFile:
    """One slot's change set of one epoch in checkpoint storage."""

    epoch: int
    operator_id: str
    subtask_index: int
    path: str
    """Relative to the job's checkpoint directory (:func:`change_set_name`)."""
    size: int
    sha256: str
    """Hex digest of the file's bytes; a restore refuses a file that does not match."""
