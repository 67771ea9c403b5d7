"""Flink's job metrics (uptime, downtime, restartingTime, numRestarts) through a status history."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from keyedstate.common.config import Configuration
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.ids import JobId
from keyedstate.common.lifecycle import JobStatus
from keyedstate.jobmanager.jobs import Job, JobSpec
from keyedstate.jobmanager.metrics import JobManagerMetrics
from keyedstate.jobmanager.status_times import JobStatusTimes
from tests.fakes.clock import ManualClock


def _job(clock: ManualClock) -> Job:
    spec = JobSpec(JobId("j"), (OperatorSpec("op", 1, (StateDescriptor("v", StateKind.VALUE),)),), 8)
    return Job(spec, Configuration({}), times=JobStatusTimes(clock))


def _metrics(job: Job) -> CollectorRegistry:
    registry = CollectorRegistry()
    JobManagerMetrics(registry, taskmanagers=lambda: 1, total_slots=lambda: 4, free_slots=lambda: 3, jobs=lambda: [job])
    return registry


def _get(registry: CollectorRegistry, name: str) -> float | None:
    return registry.get_sample_value(f"flink_jobmanager_job_{name}", {"job_id": "j"})


def test_uptime_downtime_and_restarting_time_follow_the_status_changes() -> None:
    clock = ManualClock()
    job = _job(clock)
    registry = _metrics(job)
    assert (_get(registry, "uptime"), _get(registry, "downtime"), _get(registry, "restartingTime")) == (0, 0, 0)

    job.move_to(JobStatus.RUNNING)
    clock.advance(5_000)
    assert _get(registry, "uptime") == 5_000
    assert registry.get_sample_value("flink_jobmanager_numRunningJobs") == 1

    job.move_to(JobStatus.RESTARTING)
    job.restarts += 1
    clock.advance(700)
    assert _get(registry, "uptime") == 0
    assert _get(registry, "downtime") == 700
    assert _get(registry, "restartingTime") == 700
    assert _get(registry, "numRestarts") == 1 and _get(registry, "fullRestarts") == 1

    job.move_to(JobStatus.RUNNING)
    clock.advance(300)
    assert _get(registry, "uptime") == 300  # counted from the restart, not the submission
    assert _get(registry, "downtime") == 0
    assert _get(registry, "restartingTime") == 700  # the last restart's duration

    job.move_to(JobStatus.RUNNING)  # the same status again changes nothing
    clock.advance(100)
    assert _get(registry, "uptime") == 400

    job.move_to(JobStatus.CANCELED)
    assert (_get(registry, "uptime"), _get(registry, "downtime")) == (-1, -1)
    assert registry.get_sample_value("flink_jobmanager_numRunningJobs") == 0


def test_an_outage_spanning_two_restarts_is_one_downtime() -> None:
    clock = ManualClock()
    job = _job(clock)
    job.move_to(JobStatus.RUNNING)
    job.move_to(JobStatus.RESTARTING)
    clock.advance(1_000)
    job.move_to(JobStatus.RESTARTING)  # a second attempt of the same failover
    clock.advance(1_000)
    assert job.times.downtime_ms() == 2_000


def test_cluster_gauges_read_the_registry_at_scrape_time() -> None:
    registry = CollectorRegistry()
    counts = {"tms": 2}
    metrics = JobManagerMetrics(
        registry, taskmanagers=lambda: counts["tms"], total_slots=lambda: 8, free_slots=lambda: 5, jobs=list
    )
    assert registry.get_sample_value("flink_jobmanager_numRegisteredTaskManagers") == 2
    counts["tms"] = 1
    metrics.taskmanager_lost()
    assert registry.get_sample_value("flink_jobmanager_numRegisteredTaskManagers") == 1
    assert registry.get_sample_value("keyedstate_jobmanager_taskmanagers_lost_total") == 1
    assert registry.get_sample_value("flink_jobmanager_taskSlotsAvailable") == 5
