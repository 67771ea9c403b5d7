"""The one error hierarchy of the runtime.

Every error carries a :class:`Reason` (a typed cause that shows in logs, metrics and gRPC
trailing metadata) and a message that tells the operator or user what to do. The mapping to
gRPC status codes lives in :mod:`keyedstate.common.rpc.status`, the only place where domain
errors and gRPC meet.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Reason(enum.Enum):
    """Why a call failed; sent to clients as trailing metadata ``x-keyedstate-reason``."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    CONFIG = "CONFIG"
    UNKNOWN_JOB = "UNKNOWN_JOB"
    UNKNOWN_OPERATOR = "UNKNOWN_OPERATOR"
    UNKNOWN_STATE = "UNKNOWN_STATE"
    UNKNOWN_SUBTASK = "UNKNOWN_SUBTASK"
    WRONG_STATE_KIND = "WRONG_STATE_KIND"
    STALE_ROUTING = "STALE_ROUTING"
    SIZE_LIMIT = "SIZE_LIMIT"
    INSUFFICIENT_SLOTS = "INSUFFICIENT_SLOTS"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    JOB_NOT_RUNNING = "JOB_NOT_RUNNING"
    EPOCH_CONFLICT = "EPOCH_CONFLICT"
    EPOCH_GAP = "EPOCH_GAP"
    CHECKPOINT_FAILED = "CHECKPOINT_FAILED"
    CORRUPT_CHECKPOINT = "CORRUPT_CHECKPOINT"
    INCOMPATIBLE_CHECKPOINT = "INCOMPATIBLE_CHECKPOINT"
    STORAGE = "STORAGE"
    UNAVAILABLE = "UNAVAILABLE"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    LEASE_EXPIRED = "LEASE_EXPIRED"
    OUTCOME_UNKNOWN = "OUTCOME_UNKNOWN"
    EPOCH_NOT_APPLIED = "EPOCH_NOT_APPLIED"
    """A call of epoch E reached a slot that does not hold E-1 yet (overlapped commits' read fence); retry."""
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    WRONG_CLUSTER = "WRONG_CLUSTER"
    INTERNAL = "INTERNAL"


@dataclass(frozen=True)
class BatchOutcome:
    """What a multi-key write that failed part-way did, by position of the key in the call.

    Attached to the error as ``error.outcome``: resend the keys at ``not_applied`` once the
    cause is fixed; read back the ones at ``unknown`` first (their requests got no answer, so
    they may have been applied).
    """

    method: str
    applied: tuple[int, ...]
    not_applied: tuple[int, ...]
    unknown: tuple[int, ...]


class KeyedStateError(Exception):
    """Root of every error the runtime raises on purpose."""

    reason: Reason = Reason.INTERNAL
    outcome: BatchOutcome | None = None
    """Set on the error of a direct write that failed after part of it was sent (see BatchOutcome)."""

    def __init__(self, message: str, *, reason: Reason | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason

    @property
    def message(self) -> str:
        """The message alone, without the reason (the first constructor argument; empty if none)."""
        return str(self.args[0]) if self.args else ""

    def with_message(self, message: str) -> KeyedStateError:
        """The same error (class, reason and details) with another message, to add context when re-raising."""
        clone = type(self).__new__(type(self), message)
        clone.__dict__.update(self.__dict__)
        clone.args = (message,)
        return clone


class InvalidArgumentError(KeyedStateError):
    reason = Reason.INVALID_ARGUMENT


class ConfigError(KeyedStateError):
    """A configuration key has a value that cannot be used."""

    reason = Reason.CONFIG


class NotFoundError(KeyedStateError):
    """An unknown job, operator, subtask or state (the reason says which)."""

    reason = Reason.UNKNOWN_JOB


class WrongStateKindError(KeyedStateError):
    reason = Reason.WRONG_STATE_KIND


class StaleRoutingError(KeyedStateError):
    """The slot does not own a key group the client sent to it; refresh the routing table."""

    reason = Reason.STALE_ROUTING

    def __init__(self, message: str, *, current_version: int = 0) -> None:
        super().__init__(message)
        self.current_version = current_version


class SizeLimitError(KeyedStateError):
    reason = Reason.SIZE_LIMIT


class CapacityError(KeyedStateError):
    reason = Reason.INSUFFICIENT_SLOTS


class AlreadyExistsError(KeyedStateError):
    reason = Reason.ALREADY_EXISTS


class JobStateError(KeyedStateError):
    """The job is not in a state that allows the call (restarting, failed, cancelled)."""

    reason = Reason.JOB_NOT_RUNNING


class EpochConflictError(KeyedStateError):
    """The epoch cannot be applied as asked (the job restarted under it, an attempt is stale): run the batch again."""

    reason = Reason.EPOCH_CONFLICT


class EpochGapError(KeyedStateError):
    """The job's state does not hold the batch before this one; applying it would skip epochs.

    Not retryable: restore a checkpoint that holds the previous epoch, or start the query from
    a new checkpointLocation (see docs/exactly-once.md).
    """

    reason = Reason.EPOCH_GAP


class CheckpointError(KeyedStateError):
    reason = Reason.CHECKPOINT_FAILED


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is missing, truncated or fails its checksum; the message names it."""

    reason = Reason.CORRUPT_CHECKPOINT


class IncompatibleCheckpointError(CheckpointError):
    """A checkpoint cannot be restored into this job (max parallelism, operators, states)."""

    reason = Reason.INCOMPATIBLE_CHECKPOINT


class StorageError(KeyedStateError):
    reason = Reason.STORAGE


class UnavailableError(KeyedStateError):
    """A peer cannot be reached or is shutting down; the call can be retried."""

    reason = Reason.UNAVAILABLE


class AuthenticationError(KeyedStateError):
    """The call carried no identity, or one the server does not know (a missing, wrong or revoked token)."""

    reason = Reason.UNAUTHENTICATED


class PermissionDeniedError(KeyedStateError):
    """The caller's role or job scope does not allow the call; the message names what is missing."""

    reason = Reason.PERMISSION_DENIED


class ClusterMismatchError(KeyedStateError):
    """A TaskManager of one cluster tried to join another cluster's JobManager (high-availability.cluster-id)."""

    reason = Reason.WRONG_CLUSTER
