"""JobManager metrics: Flink's cluster and job metrics under Flink's names, and the JobManager's own.

The checkpoint statistics of each job are declared in :mod:`keyedstate.jobmanager.checkpoint.stats`;
docs/metrics.md is generated from both (``python -m keyedstate.cli.metrics_doc``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from keyedstate.common.lifecycle import JobStatus
from keyedstate.common.metrics import MetricKind, MetricSpec, Unit
from keyedstate.jobmanager.jobs import Job

_G = MetricKind.GAUGE
JOB_LABELS = ("job_id",)

REGISTERED_TASKMANAGERS = MetricSpec(
    "flink_jobmanager_numRegisteredTaskManagers", _G, Unit.COUNT, "TaskManagers registered and not lost."
)
SLOTS_TOTAL = MetricSpec("flink_jobmanager_taskSlotsTotal", _G, Unit.COUNT, "Slots of all registered TaskManagers.")
SLOTS_AVAILABLE = MetricSpec(
    "flink_jobmanager_taskSlotsAvailable", _G, Unit.COUNT, "Slots of registered TaskManagers holding no subtask."
)
RUNNING_JOBS = MetricSpec("flink_jobmanager_numRunningJobs", _G, Unit.COUNT, "Jobs in status RUNNING.")
TASKMANAGERS_LOST = MetricSpec(
    "keyedstate_jobmanager_taskmanagers_lost",
    MetricKind.COUNTER,
    Unit.COUNT,
    "TaskManagers declared lost (missed heartbeats, failed calls) or deregistered.",
)
UPTIME = MetricSpec(
    "flink_jobmanager_job_uptime",
    _G,
    Unit.MILLISECONDS,
    "Time since the job last started RUNNING (submission or restart); 0 while not running, -1 once FAILED or CANCELED.",
    JOB_LABELS,
)
DOWNTIME = MetricSpec(
    "flink_jobmanager_job_downtime",
    _G,
    Unit.MILLISECONDS,
    "For a job restarting after a failure: the time the outage has lasted; 0 while running, -1 once FAILED or "
    "CANCELED.",
    JOB_LABELS,
)
RESTARTING_TIME = MetricSpec(
    "flink_jobmanager_job_restartingTime",
    _G,
    Unit.MILLISECONDS,
    "Time the restart under way has taken so far, or else the duration of the job's last restart.",
    JOB_LABELS,
)
NUM_RESTARTS = MetricSpec(
    "flink_jobmanager_job_numRestarts",
    _G,
    Unit.COUNT,
    "Restarts of the job since it was submitted or restored in place (failovers, as the restart strategy counts them).",
    JOB_LABELS,
)
FULL_RESTARTS = MetricSpec(
    "flink_jobmanager_job_fullRestarts",
    _G,
    Unit.COUNT,
    "The same as numRestarts (every restart restarts the whole job); Flink's deprecated name, for old dashboards.",
    JOB_LABELS,
)
SPECS: tuple[MetricSpec, ...] = (
    REGISTERED_TASKMANAGERS,
    SLOTS_TOTAL,
    SLOTS_AVAILABLE,
    RUNNING_JOBS,
    TASKMANAGERS_LOST,
    UPTIME,
    DOWNTIME,
    RESTARTING_TIME,
    NUM_RESTARTS,
    FULL_RESTARTS,
)
"""Every metric of this module (the checkpoint statistics are :data:`checkpoint.stats.SPECS`)."""


class JobManagerMetrics:
    """The JobManager's cluster and job metrics, read from the registry and the Dispatcher at scrape time."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        taskmanagers: Callable[[], int],
        total_slots: Callable[[], int],
        free_slots: Callable[[], int],
        jobs: Callable[[], list[Job]],
    ) -> None:
        REGISTERED_TASKMANAGERS.gauge(registry).set_function(taskmanagers)
        SLOTS_TOTAL.gauge(registry).set_function(total_slots)
        SLOTS_AVAILABLE.gauge(registry).set_function(free_slots)
        RUNNING_JOBS.gauge(registry).set_function(lambda: sum(1 for j in jobs() if j.status is JobStatus.RUNNING))
        self._lost = TASKMANAGERS_LOST.counter(registry)
        registry.register(_JobCollector(jobs))

    def taskmanager_lost(self) -> None:
        """Count one TaskManager lost or deregistered."""
        self._lost.inc()


class _JobCollector(Collector):
    """Flink's job metrics of every job the JobManager knows, at scrape time."""

    def __init__(self, jobs: Callable[[], list[Job]]) -> None:
        self._jobs = jobs

    def describe(self) -> Iterable[GaugeMetricFamily]:
        """The families without samples (the registry checks names without collecting)."""
        return [GaugeMetricFamily(s.name, s.help, labels=list(s.labels)) for s in _JOB_SPECS]

    def collect(self) -> Iterable[GaugeMetricFamily]:
        """One sample per job in each family."""
        families = [GaugeMetricFamily(s.name, s.help, labels=list(s.labels)) for s in _JOB_SPECS]
        for job in self._jobs():
            values = (
                job.times.uptime_ms(),
                job.times.downtime_ms(),
                job.times.restarting_time_ms(),
                job.restarts,
                job.restarts,
            )
            for family, value in zip(families, values):
                family.add_metric([job.spec.job_id], float(value))
        return families


_JOB_SPECS = (UPTIME, DOWNTIME, RESTARTING_TIME, NUM_RESTARTS, FULL_RESTARTS)
