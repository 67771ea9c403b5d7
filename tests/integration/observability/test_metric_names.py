"""What the daemons export, on real clusters: only catalogued names, the backend's own metrics, TTL counters.

In-process JobManager and TaskManagers with real RocksDB and hashmap backends; every exported
family must be one docs/metrics.md lists, so a metric added without a declaration fails here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from keyedstate.cli.metrics_doc import catalog
from keyedstate.common.client import ValueState
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind, TtlConfig
from tests.fixtures.cluster import InProcessCluster

JOB = "metered"
STATES = (
    StateDescriptor("count", StateKind.VALUE),
    StateDescriptor("seen", StateKind.VALUE, ttl=TtlConfig(200)),
)
ROCKSDB = "flink_taskmanager_job_task_operator_column_family_rocksdb_"


def _start(make: Callable[..., InProcessCluster], backend: str, **tm: Any) -> InProcessCluster:
    cluster = make(taskmanagers=1, slots=2, backend=backend, tm={"state.backend.ttl.cleanup-interval": "100 ms", **tm})
    client = cluster.client()
    client.submit_job(JOB, [OperatorSpec("op", 2, STATES)], max_parallelism=16)
    keys = [f"k{i}" for i in range(200)]
    for state in ("count", "seen"):
        handle: ValueState[str, int] = ValueState(client, JOB, "op", state, value_serializer="int")
        handle.put_many(keys, list(range(200)))
    return cluster


def _families(registry: CollectorRegistry) -> dict[str, list[Any]]:
    return {f.name: f.samples for f in registry.collect()}


def _catalogued(daemon: str) -> set[str]:
    # prometheus_client names a counter's family without _total.
    return {s.name for s in catalog()[daemon]}


def test_rocksdb_slots_export_flink_native_metrics_per_column_family(
    inprocess_cluster: Callable[..., InProcessCluster],
) -> None:
    cluster = _start(inprocess_cluster, "rocksdb", **{"state.backend.rocksdb.metrics.num-snapshots": "true"})
    tm = cluster.taskmanagers[0]
    families = _families(tm.registry)
    assert set(families) <= _catalogued("taskmanager"), set(families) - _catalogued("taskmanager")
    assert set(_families(cluster.jobmanager.metrics_registry)) <= _catalogued("jobmanager")

    keys = families[ROCKSDB + "estimate_num_keys"]
    by_cf: dict[str, float] = {}
    for sample in keys:
        assert sample.labels["job_id"] == JOB and sample.labels["operator_id"] == "op"
        by_cf[sample.labels["column_family"]] = by_cf.get(sample.labels["column_family"], 0) + sample.value
    assert {"count", "seen"} <= set(by_cf)
    assert by_cf["count"] >= 150  # an estimate, per column family: the state's keys
    for prop in ("is_write_stopped", "background_errors", "block_cache_pinned_usage", "num_snapshots"):
        assert ROCKSDB + prop in families, prop
    assert ROCKSDB + "num_live_versions" not in families  # off unless switched on, as in Flink
    assert not any("hashmap" in name for name in families)


def test_column_family_as_a_scope_segment_when_the_switch_is_off(
    inprocess_cluster: Callable[..., InProcessCluster],
) -> None:
    cluster = _start(
        inprocess_cluster, "rocksdb", **{"state.backend.rocksdb.metrics.column-family-as-variable": "false"}
    )
    families = _families(cluster.taskmanagers[0].registry)
    assert "flink_taskmanager_job_task_operator_count_rocksdb_estimate_num_keys" in families
    assert not any(name.startswith(ROCKSDB) for name in families)


def test_hashmap_slots_report_no_rocksdb_metric(inprocess_cluster: Callable[..., InProcessCluster]) -> None:
    cluster = _start(inprocess_cluster, "hashmap")
    families = _families(cluster.taskmanagers[0].registry)
    assert not any("rocksdb" in name for name in families), sorted(n for n in families if "rocksdb" in n)
    entries = families["keyedstate_taskmanager_job_task_operator_hashmap_entries"]
    assert sum(s.value for s in entries) == 400  # 200 keys in each of two states
    assert set(families) <= _catalogued("taskmanager")


def test_ttl_sweeps_are_counted_with_the_entries_they_expire(
    inprocess_cluster: Callable[..., InProcessCluster],
) -> None:
    cluster = _start(inprocess_cluster, "hashmap")
    registry = cluster.taskmanagers[0].registry
    name = "keyedstate_taskmanager_job_task_operator_ttl_cleanup_"
    deadline = time.monotonic() + 30
    expired = 0.0
    while time.monotonic() < deadline:
        expired = sum(
            s.value for s in _families(registry).get(name + "expired_entries", []) if s.name.endswith("_total")
        )
        if expired >= 200:
            break
        time.sleep(0.1)
    assert expired == 200  # every "seen" entry expired (TTL 200 ms) and was swept; "count" has no TTL
    sweeps = sum(s.value for s in _families(registry)[name + "sweeps"] if s.name.endswith("_total"))
    assert sweeps >= 2
    assert not any(s.value for s in _families(registry).get(name + "failures", []) if s.name.endswith("_total"))
