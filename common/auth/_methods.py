"""The permission every RPC method needs, and the job each call touches.

Every method of every service a daemon serves must be listed here: a method without a rule is
refused (PERMISSION_DENIED), and ``tests/unit/auth`` checks this table against the service
descriptors, so a new RPC cannot go out unprotected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from keyedstate.common.auth._roles import Permission as P
from keyedstate.common.auth._roles import Principal


@dataclass(frozen=True)
class MethodRule:
    permission: P | Callable[[Any], P]
    """The permission, or a function of the request choosing one (SubmitJob: submit or restore)."""
    job: Callable[[Any], str] | None = None
    """The job id the call touches; the caller's job scope must cover it. None: no single job."""
    restrict: Callable[[Principal, Any], Any] | None = None
    """Narrows the response to the caller's job scope (the cluster overview of a scoped token)."""

    def permission_for(self, request: Any) -> P:
        """The permission ``request`` needs: the rule's fixed one, or the one its function picks."""
        return self.permission(request) if callable(self.permission) else self.permission


def _job(request: Any) -> str:
    return str(request.job_id)


def _target_job(request: Any) -> str:
    return str(request.target.job_id)


def _submit_permission(request: Any) -> P:
    # Resubmitting a job restoring a checkpoint replaces its state: named apart so a refusal says so.
    return P.JOB_RESTORE if request.restore_path else P.JOB_SUBMIT


def _scoped_overview(principal: Principal, overview: Any) -> Any:
    """Only the caller's jobs, and only the slots of those jobs, for a token scoped to some jobs."""
    if principal.jobs is None:
        return overview
    from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb

    narrowed = jm_pb.ClusterOverview()
    narrowed.CopyFrom(overview)
    del narrowed.jobs[:]
    narrowed.jobs.extend(j for j in overview.jobs if principal.covers(j.job_id))
    for tm in narrowed.taskmanagers:
        kept = [s for s in tm.slots if not s.job_id or principal.covers(s.job_id)]
        del tm.slots[:]
        tm.slots.extend(kept)
    return narrowed


_READ = MethodRule(P.STATE_READ, _target_job)
_WRITE = MethodRule(P.STATE_WRITE, _target_job)

# The TaskManagers' calls on the JobManager: registration and heartbeats (Flink's ResourceManager
# gateway) and checkpoint acknowledgements (the CheckpointCoordinator gateway), served on the
# internal plane.
_RESOURCE_MANAGER = {
    "RegisterTaskManager": MethodRule(P.TASKMANAGER_REGISTER),
    "Heartbeat": MethodRule(P.TASKMANAGER_REGISTER),
    "DeregisterTaskManager": MethodRule(P.TASKMANAGER_REGISTER),
    # A subtask's failure report (today: changelog materializations failing past
    # state.changelog.max-failures-allowed) fails the job over, so it is scoped to the job, and
    # it is part of the TaskManager's checkpoint reporting: the permission it already holds.
    "ReportTaskFailure": MethodRule(P.CHECKPOINT_REPORT, _job),
}
_CHECKPOINT_GATEWAY = {
    "AcknowledgeCheckpoint": MethodRule(P.CHECKPOINT_REPORT, _job),
    "DeclineCheckpoint": MethodRule(P.CHECKPOINT_REPORT, _job),
}

SERVICE_RULES: dict[str, dict[str, MethodRule]] = {
    "keyedstate.v1.ResourceManager": _RESOURCE_MANAGER,
    "keyedstate.v1.CheckpointCoordinatorGateway": _CHECKPOINT_GATEWAY,
    "keyedstate.v1.JobManager": {
        "SubmitJob": MethodRule(_submit_permission, _job),
        "RestoreJob": MethodRule(P.JOB_RESTORE, _job),
        "CancelJob": MethodRule(P.JOB_CANCEL, _job),
        "GetJob": MethodRule(P.JOB_VIEW, _job),
        "GetRouting": MethodRule(P.JOB_VIEW, _job),
        "GetClusterOverview": MethodRule(P.CLUSTER_VIEW, restrict=_scoped_overview),
        "TriggerCheckpoint": MethodRule(P.CHECKPOINT_TRIGGER, _job),
        "ListCheckpoints": MethodRule(P.JOB_VIEW, _job),
        "BeginBatch": MethodRule(P.EPOCH_RUN, _job),
        "CommitEpoch": MethodRule(P.EPOCH_RUN, _job),
        "RescaleJob": MethodRule(P.JOB_RESCALE, _job),
    },
    "keyedstate.v1.KeyedState": {
        "ValueGet": _READ,
        "ValuePut": _WRITE,
        "Clear": _WRITE,
        "Reduce": _WRITE,
        "ListAppend": _WRITE,
        "ListGet": _READ,
        "ListUpdate": _WRITE,
        "ListScan": _READ,
        "MapPut": _WRITE,
        "MapGet": _READ,
        "MapRemove": _WRITE,
        "MapContains": _READ,
        "MapScan": _READ,
        "ScanKeys": _READ,
    },
    "keyedstate.v1.TaskExecutor": {
        "DeploySlot": MethodRule(P.SLOT_CONTROL, _job),
        "ReleaseSlot": MethodRule(P.SLOT_CONTROL, _job),
        "TriggerCheckpoint": MethodRule(P.CHECKPOINT_CONTROL, _job),
        "NotifyCheckpoint": MethodRule(P.CHECKPOINT_CONTROL, _job),
        "CommitEpoch": MethodRule(P.EPOCH_APPLY, _job),
    },
    "grpc.health.v1.Health": {
        "Check": MethodRule(P.PUBLIC),
        "Watch": MethodRule(P.PUBLIC),
        "List": MethodRule(P.PUBLIC),
    },
}

RULES: dict[str, MethodRule] = {
    f"/{service}/{method}": rule for service, methods in SERVICE_RULES.items() for method, rule in methods.items()
}
"""By full method path (``/keyedstate.v1.JobManager/SubmitJob``), as gRPC names a call."""
