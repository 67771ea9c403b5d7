"""Checkpoint statistics: Flink-named Prometheus gauges plus a bounded history for the CLI and web UI.

Gauge names follow what Flink's Prometheus reporter exports for a job
(``flink_jobmanager_job_lastCheckpointDuration{job_id=…}``), so existing Flink dashboards and
alerts work unchanged; their values are in Flink's units (milliseconds). Failures are also counted
per :class:`CheckpointFailureReason`, a keyedstate-only metric
(``keyedstate_jobmanager_job_checkpoint_failures_total{job_id, reason}``).
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, replace

from prometheus_client import CollectorRegistry

from keyedstate.common.ids import CheckpointId, JobId
from keyedstate.common.lifecycle import CheckpointStatus
from keyedstate.common.metrics import MetricKind, MetricSpec, Unit
from keyedstate.jobmanager.checkpoint.failure import CheckpointFailureReason
from keyedstate.jobmanager.checkpoint.summary import CheckpointSummary

logger = logging.getLogger(__name__)

PREFIX = "flink_jobmanager_job_"
DEFAULT_HISTORY_SIZE = 10  # Flink's web.checkpoints.history

IN_PROGRESS = CheckpointStatus.IN_PROGRESS
COMPLETED = CheckpointStatus.COMPLETED
FAILED = CheckpointStatus.FAILED


@dataclass(frozen=True)
class SubtaskAckStats:
    """One subtask's acknowledgement of a checkpoint, as the web UI's per-subtask table shows it."""

    operator_id: str
    subtask_index: int
    ack_timestamp_ms: int
    """Wall-clock time the JobManager received the ack."""
    sync_duration_ms: int
    async_duration_ms: int
    full_size: int
    incremental_size: int


@dataclass(frozen=True)
class CheckpointStatsEntry:
    """One checkpoint as ``statectl checkpoint list`` and the web UI show it."""

    checkpoint_id: CheckpointId
    status: CheckpointStatus
    savepoint: bool
    trigger_timestamp_ms: int
    num_subtasks: int
    num_acknowledged: int = 0
    duration_ms: int = 0
    full_size: int = 0
    incremental_size: int = 0
    path: str = ""
    epoch: int = -1
    failure_reason: str = ""
    failure_message: str = ""
    acks: tuple[SubtaskAckStats, ...] = ()
    """The acknowledgements received so far, in arrival order."""

    def summary(self) -> CheckpointSummary:
        """The entry as a trigger's answer reads (the RPC edge sends it as ``CheckpointInfo``)."""
        return CheckpointSummary(
            checkpoint_id=self.checkpoint_id,
            path=self.path,
            status=self.status,
            failure_reason=self.failure_reason and f"{self.failure_reason}: {self.failure_message}",
            epoch=self.epoch,
            trigger_timestamp_ms=self.trigger_timestamp_ms,
            duration_ms=self.duration_ms,
            full_size=self.full_size,
            incremental_size=self.incremental_size,
            savepoint=self.savepoint,
        )


_G = MetricKind.GAUGE
LAST_DURATION = MetricSpec(
    PREFIX + "lastCheckpointDuration", _G, Unit.MILLISECONDS, "Duration of the last completed checkpoint.", ("job_id",)
)
LAST_SIZE = MetricSpec(
    PREFIX + "lastCheckpointSize",
    _G,
    Unit.BYTES,
    "Bytes uploaded by the last completed checkpoint (its incremental size).",
    ("job_id",),
)
LAST_FULL_SIZE = MetricSpec(
    PREFIX + "lastCheckpointFullSize", _G, Unit.BYTES, "Full size of the last completed checkpoint.", ("job_id",)
)
LAST_ID = MetricSpec(
    PREFIX + "lastCompletedCheckpointId", _G, Unit.ID, "Id of the last completed checkpoint.", ("job_id",)
)
COMPLETED_COUNT = MetricSpec(
    PREFIX + "numberOfCompletedCheckpoints", _G, Unit.COUNT, "Completed checkpoints.", ("job_id",)
)
FAILED_COUNT = MetricSpec(
    PREFIX + "numberOfFailedCheckpoints",
    _G,
    Unit.COUNT,
    "Failed checkpoints (triggers refused before a checkpoint existed included, as in Flink).",
    ("job_id",),
)
IN_PROGRESS_COUNT = MetricSpec(
    PREFIX + "numberOfInProgressCheckpoints", _G, Unit.COUNT, "Checkpoints in progress.", ("job_id",)
)
TOTAL_COUNT = MetricSpec(
    PREFIX + "totalNumberOfCheckpoints",
    _G,
    Unit.COUNT,
    "Triggered checkpoints (in progress, completed and failed).",
    ("job_id",),
)
RESTORE_TIMESTAMP = MetricSpec(
    PREFIX + "lastCheckpointRestoreTimestamp",
    _G,
    Unit.TIMESTAMP_MS,
    "When the job was last restored from a checkpoint; -1 if never.",
    ("job_id",),
)
FAILURES = MetricSpec(
    "keyedstate_jobmanager_job_checkpoint_failures",
    MetricKind.COUNTER,
    Unit.COUNT,
    "Failed checkpoints by CheckpointFailureReason (Flink has no such metric; its reasons are Flink's).",
    ("job_id", "reason"),
)
SPECS: tuple[MetricSpec, ...] = (
    LAST_DURATION,
    LAST_SIZE,
    LAST_FULL_SIZE,
    LAST_ID,
    COMPLETED_COUNT,
    FAILED_COUNT,
    IN_PROGRESS_COUNT,
    TOTAL_COUNT,
    RESTORE_TIMESTAMP,
    FAILURES,
)
"""Every checkpoint metric of a job."""


class _Metrics:
    """The metric families of one CollectorRegistry, shared by every job's tracker."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.last_duration = LAST_DURATION.gauge(registry)
        self.last_size = LAST_SIZE.gauge(registry)
        self.last_full_size = LAST_FULL_SIZE.gauge(registry)
        self.last_id = LAST_ID.gauge(registry)
        self.completed = COMPLETED_COUNT.gauge(registry)
        self.failed = FAILED_COUNT.gauge(registry)
        self.in_progress = IN_PROGRESS_COUNT.gauge(registry)
        self.total = TOTAL_COUNT.gauge(registry)
        self.restore_ts = RESTORE_TIMESTAMP.gauge(registry)
        self.failures = FAILURES.counter(registry)

    def remove(self, job_id: str) -> None:
        for g in (
            self.last_duration,
            self.last_size,
            self.last_full_size,
            self.last_id,
            self.completed,
            self.failed,
            self.in_progress,
            self.total,
            self.restore_ts,
        ):
            try:
                g.remove(job_id)
            except KeyError:
                pass
        for reason in CheckpointFailureReason:
            try:
                self.failures.remove(job_id, reason.name)
            except KeyError:
                pass


_FAMILIES: weakref.WeakKeyDictionary[CollectorRegistry, _Metrics] = weakref.WeakKeyDictionary()
_FAMILIES_LOCK = threading.Lock()


def _metrics_for(registry: CollectorRegistry) -> _Metrics:
    with _FAMILIES_LOCK:
        metrics = _FAMILIES.get(registry)
        if metrics is None:
            metrics = _FAMILIES[registry] = _Metrics(registry)
        return metrics


class _AckLog:
    """The acknowledgements of one checkpoint in progress, appended in place.

    A frozen history entry rebuilt per ack copied every earlier ack each time: quadratic in the
    job's subtasks (at 10,000 slots it was the coordinator's largest cost). The entry takes the
    acks once, when it is read or the checkpoint finishes.
    """

    __slots__ = ("acks", "count")

    def __init__(self) -> None:
        self.acks: list[SubtaskAckStats] = []
        self.count = 0


class CheckpointStatsTracker:
    """Counts and gauges of one job's checkpoints, exported with the label ``job_id``.

    Thread-safe. ``registry`` is the daemon's CollectorRegistry; trackers of several jobs share
    its metric families. Call :meth:`close` when the job goes away to drop its label values.
    """

    def __init__(
        self, job_id: JobId, registry: CollectorRegistry | None = None, history_size: int = DEFAULT_HISTORY_SIZE
    ) -> None:
        self.job_id = job_id
        self.registry = registry if registry is not None else CollectorRegistry()
        self._m = _metrics_for(self.registry)
        self._history: dict[CheckpointId, CheckpointStatsEntry] = {}
        self._ack_logs: dict[CheckpointId, _AckLog] = {}
        """The acks of the history's checkpoints still in progress (their entries hold none yet)."""
        self._history_size = max(1, history_size)
        self._lock = threading.Lock()
        self.num_completed = 0
        self.num_failed = 0
        self.num_in_progress = 0
        self.num_total = 0
        self.latest_completed: CheckpointStatsEntry | None = None
        self.latest_failed: CheckpointStatsEntry | None = None
        self.latest_restore_timestamp_ms = -1
        self.latest_restore_checkpoint_id = CheckpointId(0)
        """The checkpoint the job last restored from (0: none)."""
        self.num_restored = 0
        for g in (self._m.completed, self._m.failed, self._m.in_progress, self._m.total):
            g.labels(job_id).set(0)
        self._m.restore_ts.labels(job_id).set(-1)

    # -- reports -------------------------------------------------------------------------------
    def report_pending(
        self,
        checkpoint_id: CheckpointId,
        trigger_timestamp_ms: int,
        *,
        savepoint: bool,
        num_subtasks: int,
        path: str,
        epoch: int,
    ) -> None:
        """A checkpoint was triggered and is collecting acknowledgements."""
        entry = CheckpointStatsEntry(
            checkpoint_id, IN_PROGRESS, savepoint, trigger_timestamp_ms, num_subtasks, path=path, epoch=epoch
        )
        with self._lock:
            self.num_in_progress += 1
            self.num_total += 1
            self._put(entry)
            self._ack_logs[checkpoint_id] = _AckLog()
            self._export()

    def report_ack(self, checkpoint_id: CheckpointId, ack: SubtaskAckStats | None = None) -> None:
        """One more subtask acknowledged (shown as progress in the history, with its timings when given)."""
        with self._lock:
            log = self._ack_logs.get(checkpoint_id)
            if log is not None:
                log.count += 1
                if ack is not None:
                    log.acks.append(ack)

    def report_completed(
        self,
        checkpoint_id: CheckpointId,
        *,
        duration_ms: int,
        full_size: int,
        incremental_size: int,
        path: str,
        epoch: int,
    ) -> None:
        """A checkpoint's ``_metadata`` is durable; sets the ``lastCheckpoint*`` gauges."""
        with self._lock:
            entry = self._finish(checkpoint_id)
            entry = replace(
                entry,
                status=COMPLETED,
                duration_ms=duration_ms,
                full_size=full_size,
                incremental_size=incremental_size,
                path=path,
                epoch=epoch,
                num_acknowledged=entry.num_subtasks,
            )
            self.num_in_progress = max(0, self.num_in_progress - 1)
            self.num_completed += 1
            self.latest_completed = entry
            self._put(entry)
            self._m.last_duration.labels(self.job_id).set(duration_ms)
            self._m.last_size.labels(self.job_id).set(incremental_size)
            self._m.last_full_size.labels(self.job_id).set(full_size)
            self._m.last_id.labels(self.job_id).set(checkpoint_id)
            self._export()

    def report_failed(
        self, checkpoint_id: CheckpointId, reason: CheckpointFailureReason, message: str, *, duration_ms: int
    ) -> None:
        """A checkpoint that was in progress failed."""
        with self._lock:
            entry = self._finish(checkpoint_id)
            entry = replace(
                entry, status=FAILED, duration_ms=duration_ms, failure_reason=reason.name, failure_message=message
            )
            self.num_in_progress = max(0, self.num_in_progress - 1)
            self.num_failed += 1
            self.latest_failed = entry
            self._put(entry)
            self._m.failures.labels(self.job_id, reason.name).inc()
            self._export()

    def report_rejected(self, reason: CheckpointFailureReason, message: str) -> None:
        """A trigger refused before any checkpoint existed (counted as failed, as Flink does)."""
        with self._lock:
            self.num_failed += 1
            self.num_total += 1
            self._m.failures.labels(self.job_id, reason.name).inc()
            self._export()
        logger.debug("job=%s checkpoint trigger rejected (%s): %s", self.job_id, reason.name, message)

    def report_restored(self, checkpoint_id: CheckpointId, timestamp_ms: int) -> None:
        """The job (re)started from ``checkpoint_id``; sets ``lastCheckpointRestoreTimestamp``."""
        with self._lock:
            self.latest_restore_timestamp_ms = timestamp_ms
            self.latest_restore_checkpoint_id = checkpoint_id
            self.num_restored += 1
            self._m.restore_ts.labels(self.job_id).set(timestamp_ms)
        logger.info("job=%s restored from checkpoint %d", self.job_id, checkpoint_id)

    # -- queries -------------------------------------------------------------------------------
    def history(self) -> list[CheckpointStatsEntry]:
        """The latest checkpoints, newest first."""
        with self._lock:
            return [self._read(e) for e in sorted(self._history.values(), key=lambda e: e.checkpoint_id, reverse=True)]

    def entry(self, checkpoint_id: CheckpointId) -> CheckpointStatsEntry | None:
        """The history entry of one checkpoint, if it is still among the latest ones."""
        with self._lock:
            entry = self._history.get(checkpoint_id)
            return None if entry is None else self._read(entry)

    def close(self) -> None:
        """Drop this job's label values from every metric family (the job went away)."""
        self._m.remove(self.job_id)

    # -- internals -----------------------------------------------------------------------------
    def _read(self, entry: CheckpointStatsEntry) -> CheckpointStatsEntry:
        """``entry`` with the acks received so far, if it is still in progress."""
        log = self._ack_logs.get(entry.checkpoint_id)
        if log is None:
            return entry
        return replace(entry, num_acknowledged=log.count, acks=tuple(log.acks))

    def _finish(self, checkpoint_id: CheckpointId) -> CheckpointStatsEntry:
        """The entry of a checkpoint that just finished, holding its acks; later acks are not recorded."""
        entry = self._history.get(checkpoint_id)
        if entry is None:
            return CheckpointStatsEntry(checkpoint_id, IN_PROGRESS, False, 0, 0)
        entry = self._read(entry)
        self._ack_logs.pop(checkpoint_id, None)
        return entry

    def _put(self, entry: CheckpointStatsEntry) -> None:
        # The oldest ids leave first, even when an old checkpoint reports late.
        self._history[entry.checkpoint_id] = entry
        while len(self._history) > self._history_size:
            oldest = min(self._history)
            del self._history[oldest]
            self._ack_logs.pop(oldest, None)

    def _export(self) -> None:
        self._m.completed.labels(self.job_id).set(self.num_completed)
        self._m.failed.labels(self.job_id).set(self.num_failed)
        self._m.in_progress.labels(self.job_id).set(self.num_in_progress)
        self._m.total.labels(self.job_id).set(self.num_total)
