"""deploy/ proven on a real Prometheus: every dashboard query and every alert expression returns data.

A live in-process cluster (JobManager, two TaskManagers, RocksDB, file:// checkpoints) runs a job
that takes checkpoints, declines one (the job fails over and restores), and sweeps a TTL state,
while Debian's ``prometheus`` scrapes the three metrics endpoints every second and evaluates
deploy/prometheus/alerts.yml. Then each query of deploy/grafana/keyedstate.json, and each alert
expression without its threshold, must give at least one series: no empty panel.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.client import StateClient, ValueState
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind, TtlConfig
from tests.fixtures.cluster import InProcessCluster
from tests.integration.observability._prometheus import (
    DEPLOY,
    Prometheus,
    dashboard_queries,
    expand_variables,
    prometheus,
    require_binary,
    scrape_config,
    without_thresholds,
)

JOB = "observed"
OPERATOR = "counts"
STATES = (
    StateDescriptor("total", StateKind.VALUE),
    StateDescriptor("recent", StateKind.VALUE, ttl=TtlConfig(300)),
)
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "keyedstate.json"


def test_promtool_accepts_the_deployed_config_and_rules() -> None:
    promtool = require_binary("promtool")
    for args in (["check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")], ["check", "rules", str(ALERTS)]):
        done = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def test_without_thresholds_keeps_only_the_queries() -> None:
    assert without_thresholds('up{job="x"} == 0') == ['up{job="x"}']
    assert without_thresholds("a / b < 0.1") == ["a / b"]
    assert without_thresholds("predict_linear(a[1h], 4 * 3600) < 0") == ["predict_linear(a[1h], 4 * 3600)"]
    assert without_thresholds("changes(x[30m]) == 0 and on (job_id) y > 1800000") == ["changes(x[30m])", "y"]


def _write(client: StateClient, round_: int) -> None:
    keys = [f"user-{i}" for i in range(300)]
    for state in ("total", "recent"):
        handle: ValueState[str, int] = ValueState(client, JOB, OPERATOR, state, value_serializer="int")
        handle.put_many(keys, [round_] * len(keys))
    handle.get_many(keys[:50])


def _checkpoint(client: StateClient) -> Any:
    info = client.trigger_checkpoint(JOB, timeout_s=60)
    assert info.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, info.failure_reason
    return info


def _wait_for_job_running(client: StateClient, restarts: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.job_info(JOB)
        if job.status == pb.JOB_STATUS_RUNNING and job.restarts >= restarts:
            return
        time.sleep(0.2)
    raise AssertionError(f"job {JOB} did not run again after {restarts} restart(s): {client.job_info(JOB)}")


def _run_workload(cluster: InProcessCluster, checkpoints_dir: Path) -> None:
    """Checkpoints, one declined checkpoint (tolerable failures 0: a failover and a restore), TTL expiry."""
    client = cluster.client(timeout_s=30.0)
    client.submit_job(JOB, [OperatorSpec(OPERATOR, 2, STATES)], max_parallelism=32)
    _write(client, 1)
    _checkpoint(client)
    _write(client, 2)
    last = _checkpoint(client)
    # A file where subtask 0 must create the next checkpoint's directory: that subtask declines it.
    blocker = checkpoints_dir / JOB / f"chk-{last.checkpoint_id + 1}" / f"{OPERATOR}-0"
    blocker.parent.mkdir(parents=True)
    blocker.write_bytes(b"")
    failed = client.trigger_checkpoint(JOB, timeout_s=60)
    assert failed.status == jm_pb.CHECKPOINT_STATUS_FAILED
    _wait_for_job_running(client, restarts=1)
    _write(client, 3)
    _checkpoint(client)


def _wait_until_scraped(server: Prometheus, targets: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    up: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        up = server.query('up{job=~"keyedstate-.*"} == 1')
        if len(up) == targets:
            return
        time.sleep(0.5)
    raise AssertionError(f"Prometheus scraped {len(up)} of {targets} targets: {server.api('targets')}")


def _empty_queries(server: Prometheus, queries: list[tuple[str, str]], timeout_s: float) -> list[tuple[str, str]]:
    """The queries that still return no series after ``timeout_s`` (rates need a few scrapes)."""
    pending = list(queries)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        pending = [(title, q) for title, q in pending if not server.query(q)]
        if pending:
            time.sleep(1)
    return pending


def test_every_dashboard_panel_and_alert_expression_returns_data(
    inprocess_cluster: Callable[..., InProcessCluster], tmp_path: Path
) -> None:
    require_binary("prometheus")
    metrics_on = {"metrics.reporter.prom.port": "0"}
    cluster = inprocess_cluster(
        taskmanagers=2,
        slots=2,
        jm={**metrics_on, "execution.checkpointing.tolerable-failed-checkpoints": "0"},
        tm={**metrics_on, "state.backend.ttl.cleanup-interval": "200 ms"},
    )
    jm_port = cluster.jobmanager.metrics_port
    tm_ports = [tm.metrics_port for tm in cluster.taskmanagers]
    assert jm_port and all(tm_ports)
    config = scrape_config(
        {"keyedstate-jobmanager": [jm_port], "keyedstate-taskmanager": [p for p in tm_ports if p]}, [ALERTS]
    )
    with prometheus(tmp_path / "prometheus", config) as server:
        _wait_until_scraped(server, targets=3)
        _run_workload(cluster, cluster.base / "checkpoints")

        dashboard = json.loads(DASHBOARD.read_text())
        panels = [(title, expand_variables(q)) for title, q in dashboard_queries(dashboard)]
        assert len({title for title, _ in panels}) >= 30
        rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
        alerts = [(r["alert"], q) for r in rules for q in without_thresholds(r["expr"])]
        assert {r["alert"] for r in rules} >= {
            "KeyedStateCheckpointsFailing",
            "KeyedStateTaskManagerLost",
            "KeyedStateJobRestarting",
            "KeyedStateRocksDBWriteStall",
            "KeyedStateLocalDiskFillingUp",
        }

        empty = _empty_queries(server, panels + alerts, timeout_s=90)
        assert not empty, "queries without data:\n" + "\n".join(f"  {t}: {q}" for t, q in empty)

        # Prometheus evaluated every rule without an error (a bad expression shows here, not at load).
        evaluated = [r for g in server.api("rules")["groups"] for r in g["rules"]]
        assert len(evaluated) == len(rules)
        assert all(r["health"] == "ok" for r in evaluated), [(r["name"], r.get("lastError")) for r in evaluated]
        # The figures behind the panels are the cluster's own.
        restarts = server.query(f'flink_jobmanager_job_numRestarts{{job_id="{JOB}"}}')
        assert [float(r["value"][1]) for r in restarts] == [1.0]
        for name in ("restartingTime", "uptime"):  # the failover took time, and the job runs again since
            value = server.query(f'flink_jobmanager_job_{name}{{job_id="{JOB}"}}')
            assert float(value[0]["value"][1]) > 0, name
        failures = server.query(f'keyedstate_jobmanager_job_checkpoint_failures_total{{job_id="{JOB}"}}')
        assert [r["metric"]["reason"] for r in failures] == ["CHECKPOINT_DECLINED"]
