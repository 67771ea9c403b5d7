"""The REST API's JSON documents, shaped like Flink's REST API where Flink has the resource.

Field names, nesting and status strings follow Flink's ``/overview``, ``/jobs``,
``/jobs/:jobid/checkpoints`` (``counts``, ``summary``, ``latest``, ``history``),
``/jobs/:jobid/checkpoints/details/:checkpointid`` (``tasks``) and its ``subtasks/:vertexid``,
``/jobs/:jobid/checkpoints/config``, ``/taskmanagers`` and ``/jobmanager/config``, so that
Flink's tooling reads them. What keyedstate adds (restarts, routing versions, epochs, slots,
failure reasons) is in extra fields, documented in ``openapi.json`` next to this module.
Operators play the part of Flink's job vertices: a vertex id here is an operator id.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from keyedstate.common.lifecycle import CheckpointStatus, JobStatus
from keyedstate.jobmanager.checkpoint.stats import CheckpointStatsEntry, SubtaskAckStats
from keyedstate.jobmanager.dispatcher import ClusterOverview, TaskManagerSummary
from keyedstate.jobmanager.rest.view import JobCheckpoints, JobView

Json = dict[str, Any]

NO_INTERVAL = 0x7FFFFFFFFFFFFFFF
"""What Flink reports as the interval of a job without periodic checkpoints (Long.MAX_VALUE)."""


def keyedstate_version() -> str:
    """The installed keyedstate version (``unknown`` from a bare source tree)."""
    try:
        return version("keyedstate")
    except PackageNotFoundError:
        return "unknown"


# -- cluster ---------------------------------------------------------------------------------------
def overview(cluster: ClusterOverview) -> Json:
    """``/overview``: TaskManagers, slots and jobs by status."""
    by_status = [j.status for j in cluster.jobs]
    return {
        "taskmanagers": len(cluster.taskmanagers),
        "slots-total": cluster.total_slots,
        "slots-available": cluster.free_slots,
        "jobs-running": sum(1 for s in by_status if s in (JobStatus.RUNNING, JobStatus.RESTARTING, JobStatus.CREATED)),
        "jobs-finished": 0,
        "jobs-cancelled": by_status.count(JobStatus.CANCELED),
        "jobs-failed": by_status.count(JobStatus.FAILED),
        "flink-version": keyedstate_version(),
        "flink-commit": "",
    }


def web_config(now_ms: int, refresh_interval_ms: int) -> Json:
    """``/config``: what the web page needs before anything else (refresh interval, version, features)."""
    return {
        "refresh-interval": refresh_interval_ms,
        "timezone-name": "Coordinated Universal Time",
        "timezone-offset": 0,
        "flink-version": keyedstate_version(),
        "flink-revision": "",
        "now": now_ms,
        "features": {"web-submit": False, "web-cancel": False, "web-rescale": False, "web-history": False},
    }


def taskmanager(tm: TaskManagerSummary, now_ms: int) -> Json:
    """One entry of ``/taskmanagers``: Flink's fields plus its status, metrics port, slots' occupants and
    slot processes (``taskmanager.slot-processes`` > 1; empty when it serves every slot itself)."""
    _host, _, port = tm.address.rpartition(":")
    return {
        "id": tm.taskmanager_id,
        "path": tm.address,
        "dataPort": int(port) if port.isdigit() else -1,
        "jmxPort": -1,
        "timeSinceLastHeartbeat": now_ms - tm.last_heartbeat_age_ms,
        "slotsNumber": tm.num_slots,
        "freeSlots": tm.free_slots,
        "status": tm.status.value,
        "metricsPort": tm.metrics_port,
        "slots": [
            {
                "index": i,
                "free": s is None,
                "jobId": None if s is None else s.job_id,
                "operatorId": None if s is None else s.operator_id,
                "subtaskIndex": None if s is None else s.subtask_index,
            }
            for i, s in enumerate(tm.occupancy)
        ],
        "slotProcesses": [
            {
                "index": p.index,
                "address": p.address,
                "pid": p.pid,
                # Slot i is served by process i mod the process count.
                "slots": list(range(p.index, tm.num_slots, len(tm.slot_processes))),
            }
            for p in tm.slot_processes
        ],
    }


def taskmanagers(cluster: ClusterOverview, now_ms: int) -> Json:
    """``/taskmanagers``."""
    return {"taskmanagers": [taskmanager(tm, now_ms) for tm in cluster.taskmanagers]}


def taskmanager_details(tm: TaskManagerSummary, now_ms: int) -> Json:
    """``/taskmanagers/{id}``: the list entry plus Flink's ``allocatedSlots``."""
    doc = taskmanager(tm, now_ms)
    doc["allocatedSlots"] = [
        {"index": i, "jobId": s.job_id, "operatorId": s.operator_id, "subtaskIndex": s.subtask_index}
        for i, s in enumerate(tm.occupancy)
        if s is not None
    ]
    return doc


def jobmanager_config(entries: dict[str, str]) -> list[Json]:
    """``/jobmanager/config``: Flink's list of ``{key, value}`` (secrets redacted)."""
    return [{"key": k, "value": v} for k, v in entries.items()]


# -- jobs ------------------------------------------------------------------------------------------
def job_ids(jobs: Sequence[JobView]) -> Json:
    """``/jobs``: every job's id and status."""
    return {"jobs": [{"id": j.info.job_id, "status": j.info.status.value} for j in jobs]}


def _tasks(job: JobView) -> Json:
    total = sum(op.parallelism for op in job.info.operators)
    deployed = len(job.routing.routes)
    running = deployed if job.info.status is JobStatus.RUNNING else 0
    return {
        "total": total,
        "created": total - running,
        "running": running,
        "finished": 0,
        "canceled": total if job.info.status is JobStatus.CANCELED else 0,
        "failed": total if job.info.status is JobStatus.FAILED else 0,
    }


def _duration(job: JobView, now_ms: int) -> int:
    """Flink's job duration: start to end, or to now while the job has not ended (-1: not started)."""
    if job.start_time_ms < 0:
        return -1
    return (job.end_time_ms if job.end_time_ms >= 0 else now_ms) - job.start_time_ms


def job_overview(job: JobView, now_ms: int) -> Json:
    """One entry of ``/jobs/overview``: Flink's fields plus restarts and routing version."""
    info = job.info
    return {
        "jid": info.job_id,
        "name": info.job_id,
        "state": info.status.value,
        "start-time": job.start_time_ms,
        "end-time": job.end_time_ms,
        "duration": _duration(job, now_ms),
        "last-modification": now_ms,
        "tasks": _tasks(job),
        "restarts": info.restarts,
        "routing-version": info.routing_version,
        "committed-epoch": info.committed_epoch,
        "durable-epoch": info.durable_epoch,
        "latest-checkpoint-id": info.latest_checkpoint_id,
        "failure-cause": info.failure_cause,
    }


def jobs_overview(jobs: Sequence[JobView], now_ms: int) -> Json:
    """``/jobs/overview``."""
    return {"jobs": [job_overview(j, now_ms) for j in jobs]}


def job_details(job: JobView, now_ms: int) -> Json:
    """``/jobs/{id}``: the job with its operators as vertices and its routing table."""
    info = job.info
    doc = job_overview(job, now_ms)
    doc.pop("tasks")
    routes_of: dict[str, int] = {}
    for route in job.routing.routes:
        routes_of[route.subtask.operator_id] = routes_of.get(route.subtask.operator_id, 0) + 1
    doc.update(
        {
            "isStoppable": False,
            "maxParallelism": info.max_parallelism,
            "now": now_ms,
            "vertices": [
                {
                    "id": op.operator_id,
                    "name": op.operator_id,
                    "maxParallelism": info.max_parallelism,
                    "parallelism": op.parallelism,
                    "status": info.status.value,
                    "states": [s.name for s in op.states],
                    "deployedSubtasks": routes_of.get(op.operator_id, 0),
                }
                for op in info.operators
            ],
            "status-counts": {info.status.value: 1},
            "latest-checkpoint-path": info.latest_checkpoint_path,
            "routing": {
                "version": job.routing.version,
                "routes": [
                    {
                        "operatorId": r.subtask.operator_id,
                        "subtaskIndex": r.subtask.subtask_index,
                        "keyGroups": [r.key_groups.start, r.key_groups.end],
                        "taskmanagerId": r.taskmanager_id,
                        "address": r.address,
                        "slotIndex": r.slot_index,
                    }
                    for r in job.routing.routes
                ],
            },
        }
    )
    return doc


# -- checkpoints -----------------------------------------------------------------------------------
_CLASS_NAMES = {
    CheckpointStatus.COMPLETED: ".CompletedCheckpointStatistics",
    CheckpointStatus.FAILED: ".FailedCheckpointStatistics",
    CheckpointStatus.IN_PROGRESS: ".PendingCheckpointStatistics",
}


def _latest_ack(entry: CheckpointStatsEntry) -> int:
    return max((a.ack_timestamp_ms for a in entry.acks), default=-1)


def checkpoint(entry: CheckpointStatsEntry) -> Json:
    """One checkpoint of ``history`` (and the base of its details), as Flink's ``CheckpointStatistics``."""
    doc: Json = {
        "className": _CLASS_NAMES[entry.status],
        "id": entry.checkpoint_id,
        "status": entry.status.value,
        "is_savepoint": entry.savepoint,
        "savepointFormat": "CANONICAL" if entry.savepoint else None,
        "checkpoint_type": "SAVEPOINT" if entry.savepoint else "CHECKPOINT",
        "trigger_timestamp": entry.trigger_timestamp_ms,
        "latest_ack_timestamp": _latest_ack(entry),
        "checkpointed_size": entry.incremental_size,
        "state_size": entry.full_size,
        "end_to_end_duration": entry.duration_ms,
        "alignment_buffered": 0,
        "processed_data": 0,
        "persisted_data": 0,
        "num_subtasks": entry.num_subtasks,
        "num_acknowledged_subtasks": entry.num_acknowledged,
        "tasks": {},
        "epoch": entry.epoch,
    }
    if entry.status is CheckpointStatus.COMPLETED:
        doc["external_path"] = entry.path
        doc["discarded"] = False
    if entry.status is CheckpointStatus.FAILED:
        doc["failure_timestamp"] = entry.trigger_timestamp_ms + entry.duration_ms
        doc["failure_reason"] = entry.failure_reason
        doc["failure_message"] = entry.failure_message
    return doc


def _stats(values: Sequence[int]) -> Json:
    """Flink's ``StatsSummary``: min, max, avg and percentiles (0 for none)."""
    if not values:
        return dict.fromkeys(("min", "max", "avg", "p50", "p90", "p95", "p99", "p999"), 0)
    ordered = sorted(values)

    def pct(q: float) -> float:
        # Nearest rank, as Flink's histogram-backed summary reports a value that occurred.
        return float(ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))])

    return {
        "min": ordered[0],
        "max": ordered[-1],
        "avg": int(statistics.fmean(ordered)),
        "p50": pct(0.5),
        "p90": pct(0.9),
        "p95": pct(0.95),
        "p99": pct(0.99),
        "p999": pct(0.999),
    }


def checkpoints(stats: JobCheckpoints) -> Json:
    """``/jobs/{id}/checkpoints``: counts, a summary of the completed ones in the history, latest, history."""
    completed = [e for e in stats.history if e.status is CheckpointStatus.COMPLETED]
    latest_savepoint = next((e for e in completed if e.savepoint), None)
    c = stats.counts
    return {
        "counts": {
            "restored": c.restored,
            "total": c.total,
            "in_progress": c.in_progress,
            "completed": c.completed,
            "failed": c.failed,
        },
        "summary": {
            "checkpointed_size": _stats([e.incremental_size for e in completed]),
            "state_size": _stats([e.full_size for e in completed]),
            "end_to_end_duration": _stats([e.duration_ms for e in completed]),
            # No stream alignment here (keyed state has no channels): Flink's fields, always 0.
            "alignment_buffered": _stats([]),
            "processed_data": _stats([]),
            "persisted_data": _stats([]),
        },
        "latest": {
            "completed": None if stats.latest_completed is None else checkpoint(stats.latest_completed),
            "savepoint": None if latest_savepoint is None else checkpoint(latest_savepoint),
            "failed": None if stats.latest_failed is None else checkpoint(stats.latest_failed),
            "restored": None
            if c.restore_timestamp_ms < 0
            else {"id": c.restore_checkpoint_id, "restore_timestamp": c.restore_timestamp_ms},
        },
        "history": [checkpoint(e) for e in stats.history],
    }


def _task(entry: CheckpointStatsEntry, operator_id: str, parallelism: int) -> Json:
    acks = [a for a in entry.acks if a.operator_id == operator_id]
    return {
        "id": operator_id,
        "status": entry.status.value,
        "latest_ack_timestamp": max((a.ack_timestamp_ms for a in acks), default=-1),
        "checkpointed_size": sum(a.incremental_size for a in acks),
        "state_size": sum(a.full_size for a in acks),
        "end_to_end_duration": max((a.ack_timestamp_ms - entry.trigger_timestamp_ms for a in acks), default=-1),
        "alignment_buffered": 0,
        "processed_data": 0,
        "persisted_data": 0,
        "num_subtasks": parallelism,
        "num_acknowledged_subtasks": len(acks),
    }


def checkpoint_details(entry: CheckpointStatsEntry, job: JobView) -> Json:
    """``/jobs/{id}/checkpoints/details/{chk}``: the checkpoint with one summary per operator (Flink's task),
    each with its subtasks' acks (sync and async times, sizes)."""
    doc = checkpoint(entry)
    doc["tasks"] = {}
    for op in job.info.operators:
        task = _task(entry, op.operator_id, op.parallelism)
        # Beyond Flink (which has them at .../subtasks/{vertex}): every subtask's ack in one request.
        acks = {a.subtask_index: a for a in entry.acks if a.operator_id == op.operator_id}
        task["subtasks"] = [_subtask(entry, i, acks.get(i)) for i in range(op.parallelism)]
        doc["tasks"][op.operator_id] = task
    return doc


def _subtask(entry: CheckpointStatsEntry, index: int, ack: SubtaskAckStats | None) -> Json:
    if ack is None:
        return {"index": index, "status": "pending_or_failed"}
    return {
        "index": index,
        "status": "completed",
        "ack_timestamp": ack.ack_timestamp_ms,
        "end_to_end_duration": ack.ack_timestamp_ms - entry.trigger_timestamp_ms,
        "state_size": ack.full_size,
        "checkpointed_size": ack.incremental_size,
        "checkpoint": {"sync": ack.sync_duration_ms, "async": ack.async_duration_ms},
        "alignment": {"buffered": 0, "processed": 0, "persisted": 0, "duration": 0},
        "start_delay": 0,
        "unaligned_checkpoint": False,
        "aborted": entry.status is CheckpointStatus.FAILED,
    }


def checkpoint_subtasks(entry: CheckpointStatsEntry, operator_id: str, parallelism: int) -> Json:
    """``/jobs/{id}/checkpoints/details/{chk}/subtasks/{operator}``: every subtask's ack, sync and async times."""
    acks = {a.subtask_index: a for a in entry.acks if a.operator_id == operator_id}
    doc = _task(entry, operator_id, parallelism)
    present = list(acks.values())
    doc["summary"] = {
        "state_size": _stats([a.full_size for a in present]),
        "checkpointed_size": _stats([a.incremental_size for a in present]),
        "end_to_end_duration": _stats([a.ack_timestamp_ms - entry.trigger_timestamp_ms for a in present]),
        "checkpoint_duration": {
            "sync": _stats([a.sync_duration_ms for a in present]),
            "async": _stats([a.async_duration_ms for a in present]),
        },
    }
    doc["subtasks"] = [_subtask(entry, i, acks.get(i)) for i in range(parallelism)]
    return doc


def checkpoint_config(stats: JobCheckpoints) -> Json:
    """``/jobs/{id}/checkpoints/config``: the job's ``execution.checkpointing.*`` settings in Flink's shape."""
    s = stats.settings
    return {
        "mode": "exactly_once",
        "interval": s.interval_ms if s.interval_ms is not None else NO_INTERVAL,
        "timeout": s.timeout_ms,
        "min_pause": s.min_pause_ms,
        "max_concurrent": s.max_concurrent,
        "externalization": {"enabled": True, "delete_on_cancellation": False},
        "state_backend": "EmbeddedRocksDBStateBackend" if stats.backend == "rocksdb" else "HashMapStateBackend",
        "checkpoint_storage": "FileSystemCheckpointStorage",
        "unaligned_checkpoints": False,
        "tolerable_failed_checkpoints": s.tolerable_failures,
        "aligned_checkpoint_timeout": 0,
        "checkpoints_after_tasks_finish": True,
        "state_changelog_enabled": s.changelog,
        "incremental": s.incremental,
        "num_retained": s.num_retained,
        "checkpoints_dir": stats.storage_dir,
        "claim_mode": stats.claim_mode,
        "restore_path": stats.restore_path or None,
    }


def error(message: str) -> Json:
    """Flink's error body: ``{"errors": [...]}``."""
    return {"errors": [message]}
