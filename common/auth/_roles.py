"""Roles, the permissions each role grants, and the identity a call is made under."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Permission(enum.Enum):
    """One thing a call may do. Every RPC method maps to exactly one (``_methods.RULES``)."""

    PUBLIC = "public"
    """Health checks: allowed without an identity (load balancers, Kubernetes probes)."""
    CLUSTER_VIEW = "cluster.view"
    JOB_VIEW = "job.view"
    STATE_READ = "state.read"
    STATE_WRITE = "state.write"
    EPOCH_RUN = "epoch.run"
    """BeginBatch and CommitEpoch: what a Spark pipeline's driver needs each micro-batch."""
    JOB_SUBMIT = "job.submit"
    JOB_RESTORE = "job.restore"
    JOB_CANCEL = "job.cancel"
    JOB_RESCALE = "job.rescale"
    CHECKPOINT_TRIGGER = "checkpoint.trigger"
    """Checkpoints and savepoints on demand."""
    TASKMANAGER_REGISTER = "taskmanager.register"
    """A TaskManager's registration, heartbeats and deregistration on the JobManager."""
    CHECKPOINT_REPORT = "checkpoint.report"
    """A TaskManager acknowledging or declining its part of a checkpoint."""
    SLOT_CONTROL = "slot.control"
    """The JobManager deploying and releasing slots on a TaskManager."""
    CHECKPOINT_CONTROL = "checkpoint.control"
    """The JobManager's checkpoint barriers and completion notices to a TaskManager."""
    EPOCH_APPLY = "epoch.apply"
    """The JobManager preparing and applying an epoch on a TaskManager."""


class Role(enum.Enum):
    READER = "reader"
    WRITER = "writer"
    ADMIN = "admin"
    TASKMANAGER = "taskmanager"
    JOBMANAGER = "jobmanager"
    INTERNAL = "internal"
    """A peer certificate on the internal mTLS plane: TaskManager and JobManager permissions both."""


P = Permission
_READ = frozenset({P.CLUSTER_VIEW, P.JOB_VIEW, P.STATE_READ})
_WRITE = _READ | {P.STATE_WRITE, P.EPOCH_RUN}
_ADMIN = _WRITE | {P.JOB_SUBMIT, P.JOB_RESTORE, P.JOB_CANCEL, P.JOB_RESCALE, P.CHECKPOINT_TRIGGER}
_TASKMANAGER = frozenset({P.TASKMANAGER_REGISTER, P.CHECKPOINT_REPORT})
_JOBMANAGER = frozenset({P.SLOT_CONTROL, P.CHECKPOINT_CONTROL, P.EPOCH_APPLY})

ROLE_PERMISSIONS: dict[Role, frozenset[Permission]] = {
    Role.READER: _READ,
    Role.WRITER: frozenset(_WRITE),
    Role.ADMIN: frozenset(_ADMIN),
    Role.TASKMANAGER: _TASKMANAGER,
    Role.JOBMANAGER: _JOBMANAGER,
    Role.INTERNAL: _TASKMANAGER | _JOBMANAGER,
}
"""Client roles nest (reader < writer < admin); the internal roles share nothing with them, so an
admin token cannot register a TaskManager and a TaskManager's token cannot read state."""

INTERNAL_ROLES = frozenset({Role.TASKMANAGER, Role.JOBMANAGER, Role.INTERNAL})


def roles_granting(permission: Permission) -> list[Role]:
    """The roles that grant ``permission``, least powerful first (for refusal messages)."""
    order = [Role.READER, Role.WRITER, Role.ADMIN, Role.TASKMANAGER, Role.JOBMANAGER, Role.INTERNAL]
    return [r for r in order if permission in ROLE_PERMISSIONS[r]]


ALL_JOBS = "*"


@dataclass(frozen=True)
class Principal:
    """Who makes a call: a token's entry or a peer certificate's name, its role and its job scope."""

    name: str
    role: Role
    jobs: frozenset[str] | None
    """The jobs the identity may touch; None: every job (``*``)."""
    via: str = "token"
    """``token`` or ``certificate``."""

    def may(self, permission: Permission) -> bool:
        """True if the principal's role grants ``permission`` (PUBLIC is granted to everyone)."""
        return permission is Permission.PUBLIC or permission in ROLE_PERMISSIONS[self.role]

    def covers(self, job_id: str) -> bool:
        """True if the principal's job scope includes ``job_id`` (no scope: every job)."""
        return self.jobs is None or job_id in self.jobs

    def describe(self) -> str:
        """How it authenticated, its name, role and job scope: for logs and refusal messages."""
        scope = ALL_JOBS if self.jobs is None else ", ".join(sorted(self.jobs)) or "none"
        return f"{self.via} {self.name!r} (role {self.role.value}, jobs: {scope})"
