"""The REST API's narrow, read-only view of the JobManager.

Everything the web UI and the REST endpoints show is read here, from the JobManager's own public
queries (the Dispatcher's overview and jobs, each job's record under its own short lock, the
checkpoint coordinator's stats tracker and settings) and copied into frozen values. The routes
turn those values into JSON after every lock is released, so a slow browser or a slow network
never holds a lock the checkpoints or the epochs need.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from keyedstate.common.clock import Clock
from keyedstate.common.config import Configuration
from keyedstate.common.config import options as o
from keyedstate.common.errors import NotFoundError
from keyedstate.common.ids import JobId
from keyedstate.jobmanager.checkpoint.coordinator import CheckpointCoordinator
from keyedstate.jobmanager.checkpoint.settings import CheckpointingSettings
from keyedstate.jobmanager.checkpoint.stats import CheckpointStatsEntry
from keyedstate.jobmanager.dispatcher import ClusterOverview, TaskManagerSummary
from keyedstate.jobmanager.jobs import Job, JobInfo, RoutingTable


@dataclass(frozen=True)
class CheckpointCounts:
    """A job's checkpoint counters (Flink's ``counts``) and its latest restore."""

    total: int
    in_progress: int
    completed: int
    failed: int
    restored: int
    """How often the job restored from a checkpoint or savepoint on this JobManager."""
    restore_timestamp_ms: int
    """-1: the job never restored."""
    restore_checkpoint_id: int
    """The checkpoint of the latest restore (0: none)."""


@dataclass(frozen=True)
class JobCheckpoints:
    """One job's checkpoint statistics: counters, the bounded history (newest first), its settings."""

    counts: CheckpointCounts
    history: tuple[CheckpointStatsEntry, ...]
    latest_completed: CheckpointStatsEntry | None
    latest_failed: CheckpointStatsEntry | None
    settings: CheckpointingSettings
    storage_dir: str
    backend: str
    claim_mode: str
    """How the job was restored from ``restore_path`` (CLAIM or NO_CLAIM; also the mode of its next restore)."""
    restore_path: str
    """The checkpoint or savepoint the job was submitted or last restored from ("" if none)."""


@dataclass(frozen=True)
class JobView:
    """A job as the REST API shows it: its info, routing and (with checkpoint storage) checkpoints."""

    info: JobInfo
    routing: RoutingTable
    checkpoints: JobCheckpoints | None
    """None: the job has no checkpoint storage."""
    start_time_ms: int
    """When this JobManager submitted or recovered the job (ms since the epoch), as Flink's start-time."""
    end_time_ms: int
    """When it reached a terminal status (-1: it has not)."""


class ClusterView:
    """Read-only queries for the REST API, over the JobManager's collaborators' public methods.

    ``overview`` and ``jobs`` are the Dispatcher's; ``backend_of`` names the state backend of a
    job's TaskManagers. Each call returns values copied out of the live records: nothing here
    can change the JobManager, and nothing returned changes under the caller.
    """

    def __init__(
        self,
        overview: Callable[[], ClusterOverview],
        jobs: Callable[[], Sequence[Job]],
        conf: Configuration,
        clock: Clock,
    ) -> None:
        self._overview = overview
        self._jobs = jobs
        self._conf = conf
        self._clock = clock

    def now_ms(self) -> int:
        """The wall clock the JobManager runs on (ms since the epoch)."""
        return self._clock.now_ms()

    def cluster(self) -> ClusterOverview:
        """TaskManagers with their slots, and every job's info."""
        return self._overview()

    def taskmanager(self, taskmanager_id: str) -> TaskManagerSummary:
        """One registered TaskManager; NotFoundError naming the registered ones otherwise."""
        taskmanagers = self._overview().taskmanagers
        for tm in taskmanagers:
            if tm.taskmanager_id == taskmanager_id:
                return tm
        known = ", ".join(tm.taskmanager_id for tm in taskmanagers) or "none"
        raise NotFoundError(
            f"no TaskManager {taskmanager_id!r} is registered (registered: {known}); list them at /taskmanagers"
        )

    def job_ids(self) -> list[JobId]:
        """Every job's id, sorted."""
        return sorted(j.job_id for j in self._jobs())

    def job(self, job_id: str) -> JobView:
        """One job: info and routing read under the job's lock, checkpoint stats from its tracker."""
        job = self._find(job_id)
        with job.lock:
            info = job.info()
            routing = job.routing_table()
            coordinator = job.coordinator
        start, end = job.times.wall_span_ms()
        checkpoints = None if coordinator is None else self._checkpoints(job, coordinator)
        return JobView(info, routing, checkpoints, start, end)

    def jobs(self) -> list[JobView]:
        """Every job, sorted by id."""
        return [self.job(job_id) for job_id in self.job_ids()]

    def configuration(self) -> dict[str, str]:
        """The JobManager's configuration as strings, secrets redacted (``/jobmanager/config``)."""
        return {k: str(v) for k, v in sorted(self._conf.redacted().items())}

    def _find(self, job_id: str) -> Job:
        for job in self._jobs():
            if job.job_id == job_id:
                return job
        known = ", ".join(sorted(j.job_id for j in self._jobs())) or "none"
        raise NotFoundError(f"unknown job {job_id!r} (known jobs: {known}); list them at /jobs")

    def _checkpoints(self, job: Job, coordinator: CheckpointCoordinator) -> JobCheckpoints:
        stats = coordinator.stats
        # The history's own lock is taken once for the list; the counters are plain ints read after it.
        history = tuple(stats.history())
        counts = CheckpointCounts(
            total=stats.num_total,
            in_progress=stats.num_in_progress,
            completed=stats.num_completed,
            failed=stats.num_failed,
            restored=stats.num_restored,
            restore_timestamp_ms=stats.latest_restore_timestamp_ms,
            restore_checkpoint_id=stats.latest_restore_checkpoint_id,
        )
        return JobCheckpoints(
            counts=counts,
            history=history,
            latest_completed=stats.latest_completed,
            latest_failed=stats.latest_failed,
            settings=coordinator.settings,
            storage_dir=coordinator.job_dir,
            backend=str(job.config.get(o.STATE_BACKEND)),
            claim_mode=job.claim_mode.value,
            restore_path=job.restore_path,
        )
