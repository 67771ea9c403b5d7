"""TaskManager metrics (Prometheus), with Flink's names where Flink has the metric."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from keyedstate.common.ids import TaskManagerId

logger = logging.getLogger(__name__)

_SLOT_LABELS = ("job_id", "operator_id", "subtask_index")


class TaskManagerMetrics:
    def __init__(self, registry: CollectorRegistry, taskmanager_id: TaskManagerId) -> None:
        self.registry = registry
        self._requests = Counter(
            "keyedstate_taskmanager_state_requests",
            "Keyed-state calls served, by method.",
            ["method"],
            registry=registry,
        )
        self._keys = Counter(
            "keyedstate_taskmanager_state_keys",
            "Keys carried by keyed-state calls, by method.",
            ["method"],
            registry=registry,
        )
        self.slots_total = Gauge("flink_taskmanager_Status_taskSlotsTotal", "Slots offered.", registry=registry)
        self.slots_available = Gauge("flink_taskmanager_Status_taskSlotsAvailable", "Free slots.", registry=registry)
        self.checkpoint_sync_ms = Histogram(
            "keyedstate_taskmanager_checkpoint_sync_duration_ms",
            "Synchronous part of a slot snapshot (native checkpoint / consistent copy).",
            _SLOT_LABELS,
            registry=registry,
            buckets=(1, 5, 10, 25, 50, 100, 250, 500, 1000, 5000),
        )
        self.checkpoint_async_ms = Histogram(
            "keyedstate_taskmanager_checkpoint_async_duration_ms",
            "Asynchronous part of a slot snapshot (upload).",
            _SLOT_LABELS,
            registry=registry,
            buckets=(10, 50, 100, 500, 1000, 5000, 10_000, 60_000, 300_000),
        )
        self.checkpoint_bytes = Counter(
            "keyedstate_taskmanager_checkpoint_uploaded_bytes",
            "Bytes uploaded by slot snapshots.",
            _SLOT_LABELS,
            registry=registry,
        )
        (
            self.restore_ms,
            self.restore_downloaded_files,
            self.restore_downloaded_bytes,
            self.restore_local_files,
            self.restore_local_bytes,
        ) = _restore_metrics(registry)
        self._counters: dict[str, tuple[Counter, Counter]] = {}

    def record_restore(
        self,
        labels: tuple[str, str, str],
        downloaded_files: int,
        downloaded_bytes: int,
        local_files: int,
        local_bytes: int,
    ) -> None:
        """Count one slot restore's reads (``labels``: job, operator, subtask)."""
        self.restore_downloaded_files.labels(*labels).inc(downloaded_files)
        self.restore_downloaded_bytes.labels(*labels).inc(downloaded_bytes)
        self.restore_local_files.labels(*labels).inc(local_files)
        self.restore_local_bytes.labels(*labels).inc(local_bytes)

    def record_request(self, method: str, keys: int) -> None:
        """Count one state call of ``method`` and the ``keys`` it carries (per-method Prometheus counters)."""
        pair = self._counters.get(method)
        if pair is None:
            pair = (self._requests.labels(method), self._keys.labels(method))
            self._counters[method] = pair
        pair[0].inc()
        pair[1].inc(keys)

    def watch_slots(self, slot_stats: Callable[[], Iterable[tuple[tuple[str, str, str], dict[str, int]]]]) -> None:
        """Export each slot's backend statistics at scrape time (RocksDB native metrics)."""
        self.registry.register(_SlotStatsCollector(slot_stats))


class _SlotStatsCollector(Collector):
    # Flink exposes RocksDB native metrics as flink_taskmanager_job_task_operator_rocksdb_<property>.
    def __init__(self, slot_stats: Callable[[], Iterable[tuple[tuple[str, str, str], dict[str, int]]]]) -> None:
        self._slot_stats = slot_stats

    def collect(self) -> Iterable[GaugeMetricFamily]:
        families: dict[str, GaugeMetricFamily] = {}
        try:
            for labels, stats in self._slot_stats():
                for name, value in stats.items():
                    metric = "flink_taskmanager_job_task_operator_rocksdb_" + name.replace("-", "_").replace(".", "_")
                    family = families.get(metric)
                    if family is None:
                        family = GaugeMetricFamily(
                            metric, f"RocksDB property {name} per slot.", labels=list(_SLOT_LABELS)
                        )
                        families[metric] = family
                    family.add_metric(list(labels), float(value))
        except Exception:  # a scrape must never fail because one slot is closing
            logger.debug("slot statistics unavailable during scrape", exc_info=True)
        return list(families.values())


def _restore_metrics(registry: CollectorRegistry) -> tuple[Gauge, Counter, Counter, Counter, Counter]:
    """A slot restore's duration, and what it read (files and bytes downloaded, files and bytes taken locally)."""
    duration = Gauge(
        "keyedstate_taskmanager_restore_duration_ms",
        "Duration of the last restore of a slot.",
        _SLOT_LABELS,
        registry=registry,
    )
    # What restores read: from checkpoint storage, or from the local copy (local recovery).
    downloaded_files = Counter(
        "keyedstate_taskmanager_restore_downloaded_files",
        "Checkpoint files restores downloaded from checkpoint storage.",
        _SLOT_LABELS,
        registry=registry,
    )
    downloaded_bytes = Counter(
        "keyedstate_taskmanager_restore_downloaded_bytes",
        "Bytes restores downloaded from checkpoint storage.",
        _SLOT_LABELS,
        registry=registry,
    )
    local_files = Counter(
        "keyedstate_taskmanager_restore_local_files",
        "Checkpoint files restores took from the verified local copy instead of downloading them.",
        _SLOT_LABELS,
        registry=registry,
    )
    local_bytes = Counter(
        "keyedstate_taskmanager_restore_local_bytes",
        "Bytes restores took from the verified local copy.",
        _SLOT_LABELS,
        registry=registry,
    )
    return duration, downloaded_files, downloaded_bytes, local_files, local_bytes
