"""The metric catalogue: one naming convention, every metric documented, docs/metrics.md current."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyedstate.cli.metrics_doc import catalog, render
from keyedstate.common.config import options as o
from keyedstate.common.metrics import MetricKind, MetricSpec, Unit
from keyedstate.taskmanager.metrics import ROCKSDB_PROPERTIES

DOC = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"


def test_docs_metrics_md_is_generated_from_the_code() -> None:
    assert DOC.read_text() == render(), "docs/metrics.md is stale: run make metrics-doc"


def test_every_metric_is_in_the_doc_with_its_type_labels_and_unit() -> None:
    text = DOC.read_text()
    for specs in catalog().values():
        for spec in specs:
            assert f"`{spec.exported}`" in text, spec.name
            assert spec.help.strip(), spec.name


def test_names_are_unique_per_daemon_and_use_one_prefix_each() -> None:
    for daemon, specs in catalog().items():
        names = [s.exported for s in specs]
        assert len(names) == len(set(names)), daemon
        for s in specs:
            assert s.name.startswith(("flink_", "keyedstate_")), s.name
            assert "_ms" not in s.name, s.name
            if not s.flink:
                assert s.unit not in (Unit.MILLISECONDS, Unit.TIMESTAMP_MS), s.name


def test_no_invented_flink_names() -> None:
    # Flink's TaskManager has no slot metrics (the JobManager does), and Flink's RocksDB metrics
    # name the column family: neither may appear under a flink_ name of our own making.
    for specs in catalog().values():
        for s in specs:
            assert "Status_taskSlots" not in s.name
            assert not s.name.startswith("flink_taskmanager_job_task_operator_rocksdb_"), s.name
            assert not s.name.startswith("flink_jobmanager_job_checkpointFailures"), s.name


def test_every_rocksdb_property_has_its_flink_switch() -> None:
    assert set(ROCKSDB_PROPERTIES) == set(o.ROCKSDB_METRICS)
    for prop, option in o.ROCKSDB_METRICS.items():
        assert option.key == f"state.backend.rocksdb.metrics.{prop}"


@pytest.mark.parametrize(
    ("name", "kind", "unit", "why"),
    [
        ("keyedstate_taskmanager_restore_duration_ms", MetricKind.GAUGE, Unit.MILLISECONDS, "seconds"),
        ("keyedstate_taskmanager_restore_duration", MetricKind.GAUGE, Unit.SECONDS, "_seconds"),
        ("keyedstate_taskmanager_uploaded", MetricKind.COUNTER, Unit.BYTES, "_bytes"),
        ("keyedstate_taskmanager_calls_total", MetricKind.COUNTER, Unit.COUNT, "_total"),
        ("keyedstate_restores", MetricKind.COUNTER, Unit.COUNT, "scope"),
        ("keyedstate_taskmanager_Restores", MetricKind.COUNTER, Unit.COUNT, "snake_case"),
        ("taskmanager_restores", MetricKind.COUNTER, Unit.COUNT, "flink_"),
        ("flink_taskmanager_job-uptime", MetricKind.GAUGE, Unit.MILLISECONDS, "PrometheusReporter"),
    ],
)
def test_a_name_breaking_the_convention_cannot_be_declared(name: str, kind: MetricKind, unit: Unit, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        MetricSpec(name, kind, unit, "help")
