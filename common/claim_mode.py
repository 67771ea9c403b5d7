"""Who owns a restored snapshot's files: Flink's ``execution.state-recovery.claim-mode``.

A job restored from a retained checkpoint either takes its files over (CLAIM: they join the
job's shared-state registry, new incremental checkpoints reference them, and they are deleted
once no retained checkpoint needs them) or leaves them to the user (NO_CLAIM, the default: the
job never deletes them, and its first checkpoint after the restore is a full one, so nothing it
keeps depends on them). Flink 1.x also had LEGACY, removed in Flink 2.0 and refused here.
"""

from __future__ import annotations

import enum
from typing import Any

from keyedstate.common.errors import ConfigError, InvalidArgumentError

LEGACY_REMOVED = (
    "restore mode LEGACY was removed in Flink 2.0: it let new checkpoints reference files of a snapshot the job "
    "did not own, so neither the job nor the user could ever delete that snapshot safely. Use NO_CLAIM (the default: "
    "the job never deletes the snapshot, and its first checkpoint after the restore is a full one) or CLAIM (the "
    "job takes the snapshot over, its first checkpoint stays incremental, and the snapshot is deleted once subsumed)"
)


class RecoveryClaimMode(enum.StrEnum):
    """Flink's ``RecoveryClaimMode`` without LEGACY."""

    CLAIM = "CLAIM"
    """The job owns the restored checkpoint: incremental from the first checkpoint, deleted once subsumed."""
    NO_CLAIM = "NO_CLAIM"
    """The user keeps the snapshot: never deleted by the job, the first checkpoint after the restore is full."""

    @classmethod
    def parse(cls, value: Any, where: str = "claim mode") -> RecoveryClaimMode:
        """``claim``, ``NO_CLAIM``, ``no-claim`` ...; InvalidArgumentError naming ``where`` otherwise (LEGACY too)."""
        text = str(value).strip().upper().replace("-", "_")
        if text == "LEGACY":
            raise InvalidArgumentError(f"{where}: {LEGACY_REMOVED}")
        try:
            return cls(text)
        except ValueError:
            raise InvalidArgumentError(
                f"{where}: {value!r} is not a claim mode; use CLAIM or NO_CLAIM (the default)"
            ) from None


def claim_mode_parser(key: str, value: Any) -> RecoveryClaimMode:
    """The configuration parser of ``execution.state-recovery.claim-mode`` (ConfigError naming the key)."""
    try:
        return RecoveryClaimMode.parse(value, key)
    except InvalidArgumentError as exc:
        raise ConfigError(exc.message) from None
