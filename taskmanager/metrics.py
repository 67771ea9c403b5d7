"""TaskManager metrics (Prometheus): Flink's names where Flink has the metric, ``keyedstate_*`` otherwise.

Every metric is declared here as a :class:`MetricSpec` (docs/metrics.md is generated from them).
RocksDB's native metrics are exported as Flink exports them with
``state.backend.rocksdb.metrics.column-family-as-variable: true``:
``flink_taskmanager_job_task_operator_column_family_rocksdb_<property>{column_family=...}``, one
switch per property (``state.backend.rocksdb.metrics.<property>``); with the switch ``false``
the column family is a scope segment of the name instead, as in Flink. The hashmap backend has
no RocksDB, so it reports its entries under its own ``keyedstate_*`` names.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from keyedstate.common.config import Configuration
from keyedstate.common.config import options as o
from keyedstate.common.ids import TaskManagerId
from keyedstate.common.metrics import MetricKind, MetricSpec, Unit
from keyedstate.taskmanager.state.backend import KeyedStateBackend
from keyedstate.taskmanager.state.hashmap import HashMapKeyedStateBackend
from keyedstate.taskmanager.state.rocksdb import RocksDBKeyedStateBackend

logger = logging.getLogger(__name__)

SLOT_LABELS = ("job_id", "operator_id", "subtask_index")
"""Flink's operator-scope variables a slot has (the subtask of one operator of one job)."""
_OP = "keyedstate_taskmanager_job_task_operator_"
_C, _G, _H = MetricKind.COUNTER, MetricKind.GAUGE, MetricKind.HISTOGRAM

STATE_REQUESTS = MetricSpec(
    "keyedstate_taskmanager_state_requests", _C, Unit.COUNT, "Keyed-state calls served, by method.", ("method",)
)
STATE_KEYS = MetricSpec(
    "keyedstate_taskmanager_state_keys", _C, Unit.COUNT, "Keys carried by keyed-state calls, by method.", ("method",)
)
SLOTS = MetricSpec("keyedstate_taskmanager_slots", _G, Unit.COUNT, "Slots this TaskManager offers.")
SLOTS_AVAILABLE = MetricSpec(
    "keyedstate_taskmanager_slots_available", _G, Unit.COUNT, "Slots of this TaskManager holding no subtask."
)
CHECKPOINT_SYNC = MetricSpec(
    _OP + "checkpoint_sync_duration_seconds",
    _H,
    Unit.SECONDS,
    "Synchronous part of a slot snapshot (the native checkpoint or consistent copy; writes wait for it).",
    SLOT_LABELS,
    (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
)
CHECKPOINT_ASYNC = MetricSpec(
    _OP + "checkpoint_async_duration_seconds",
    _H,
    Unit.SECONDS,
    "Asynchronous part of a slot snapshot (the upload to checkpoint storage).",
    SLOT_LABELS,
    (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300),
)
CHECKPOINT_UPLOADED = MetricSpec(
    _OP + "checkpoint_uploaded_bytes", _C, Unit.BYTES, "Bytes uploaded by slot snapshots.", SLOT_LABELS
)
RESTORE_DURATION = MetricSpec(
    _OP + "restore_duration_seconds", _G, Unit.SECONDS, "Duration of the last restore of a slot.", SLOT_LABELS
)
RESTORE_DOWNLOADED_FILES = MetricSpec(
    _OP + "restore_downloaded_files",
    _C,
    Unit.COUNT,
    "Checkpoint files restores downloaded from checkpoint storage.",
    SLOT_LABELS,
)
RESTORE_DOWNLOADED_BYTES = MetricSpec(
    _OP + "restore_downloaded_bytes", _C, Unit.BYTES, "Bytes restores downloaded from checkpoint storage.", SLOT_LABELS
)
RESTORE_LOCAL_FILES = MetricSpec(
    _OP + "restore_local_files",
    _C,
    Unit.COUNT,
    "Checkpoint files restores took from the verified local copy (local recovery) instead of downloading them.",
    SLOT_LABELS,
)
RESTORE_LOCAL_BYTES = MetricSpec(
    _OP + "restore_local_bytes", _C, Unit.BYTES, "Bytes restores took from the verified local copy.", SLOT_LABELS
)
TTL_SWEEPS = MetricSpec(
    _OP + "ttl_cleanup_sweeps",
    _C,
    Unit.COUNT,
    "Background TTL sweeps of a slot (state.backend.ttl.cleanup-interval; each examines up to "
    "state.backend.ttl.cleanup-batch entries).",
    SLOT_LABELS,
)
TTL_EXPIRED = MetricSpec(
    _OP + "ttl_cleanup_expired_entries",
    _C,
    Unit.COUNT,
    "Expired entries the background TTL sweeps deleted.",
    SLOT_LABELS,
)
TTL_FAILURES = MetricSpec(
    _OP + "ttl_cleanup_failures", _C, Unit.COUNT, "Background TTL sweeps that failed (see the log).", SLOT_LABELS
)
HASHMAP_ENTRIES = MetricSpec(
    _OP + "hashmap_entries",
    _G,
    Unit.COUNT,
    "Entries held by a hashmap-backend slot (each list element and map entry counted).",
    SLOT_LABELS,
)
HASHMAP_KEYS = MetricSpec(
    _OP + "hashmap_keys", _G, Unit.COUNT, "Key and namespace pairs held by a hashmap-backend slot.", SLOT_LABELS
)
WRITE_BUFFER_MANAGER_USAGE = MetricSpec(
    _OP + "rocksdb_write_buffer_manager_usage_bytes",
    _G,
    Unit.BYTES,
    "Memtable memory of all RocksDB slots of the TaskManager, as the shared WriteBufferManager counts it (the same "
    "value on each slot).",
    SLOT_LABELS,
)

# Changelog checkpoints (state.changelog.enabled), under the names Flink's changelog state backend
# registers: its counters are exported as gauges, as Flink's PrometheusReporter exports counters.
_MAT = "flink_taskmanager_job_task_operator_ChangelogMaterialization_"
_CSB = "flink_taskmanager_job_task_operator_ChangelogStateBackend_"
_DSTL = "flink_taskmanager_job_ChangelogStorage_"
MATERIALIZATION_STARTED = MetricSpec(
    _MAT + "startedMaterialization",
    _G,
    Unit.COUNT,
    "Periodic materializations of a changelog slot started (one with nothing new since the last counts as "
    "started and completed, as in Flink).",
    SLOT_LABELS,
)
MATERIALIZATION_COMPLETED = MetricSpec(
    _MAT + "completedMaterialization", _G, Unit.COUNT, "Materializations of a changelog slot completed.", SLOT_LABELS
)
MATERIALIZATION_FAILED = MetricSpec(
    _MAT + "failedMaterialization",
    _G,
    Unit.COUNT,
    "Materializations of a changelog slot that failed; past state.changelog.max-failures-allowed in a row the "
    "slot fails its job over.",
    SLOT_LABELS,
)
MATERIALIZATION_LAST_DURATION = MetricSpec(
    _MAT + "lastDurationOfMaterialization",
    _G,
    Unit.MILLISECONDS,
    "Duration of the last completed materialization (snapshot and upload); -1 before the first.",
    SLOT_LABELS,
)
CHANGELOG_SIZES: dict[str, tuple[str, str]] = {
    "full_materialized": (
        "lastFullSizeOfMaterialization",
        "Full size of the materialization the last changelog checkpoint of a slot references.",
    ),
    "inc_materialized": (
        "lastIncSizeOfMaterialization",
        "Bytes the materialization the last changelog checkpoint references uploaded itself (SST files an earlier "
        "one holds are referenced, not counted; 0 for one restored from a checkpoint).",
    ),
    "full_changelog": (
        "lastFullSizeOfNonMaterialization",
        "Size of the changelog segments the last changelog checkpoint of a slot references.",
    ),
    "inc_changelog": (
        "lastIncSizeOfNonMaterialization",
        "Bytes of changelog segments the last changelog checkpoint of a slot uploaded itself.",
    ),
}
CHANGELOG_SIZE_SPECS = {
    part: MetricSpec(_CSB + name, _G, Unit.BYTES, meaning, SLOT_LABELS)
    for part, (name, meaning) in CHANGELOG_SIZES.items()
}
UPLOAD_REQUESTS = MetricSpec(
    _DSTL + "numberOfUploadRequests",
    _G,
    Unit.COUNT,
    "Changelog segments the job's slots on this TaskManager uploaded to checkpoint storage.",
    ("job_id",),
)
UPLOAD_FAILURES = MetricSpec(
    _DSTL + "numberOfUploadFailures",
    _G,
    Unit.COUNT,
    "Changelog segment uploads that failed (their checkpoint is declined).",
    ("job_id",),
)
UPLOAD_SIZES = MetricSpec(
    _DSTL + "uploadSizes",
    _H,
    Unit.BYTES,
    "Size of each uploaded changelog segment (a Prometheus histogram; Flink's reporter shows quantiles).",
    ("job_id",),
    (1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30),
)
UPLOAD_LATENCIES = MetricSpec(
    _DSTL + "uploadLatenciesNanos",
    _H,
    Unit.NANOSECONDS,
    "Time to upload the changelog segments of one slot's checkpoint (a Prometheus histogram).",
    ("job_id",),
    (1e6, 5e6, 1e7, 5e7, 1e8, 5e8, 1e9, 5e9, 3e10),
)
UPLOAD_BATCH_SIZES = MetricSpec(
    _DSTL + "uploadBatchSizes",
    _H,
    Unit.COUNT,
    "Change sets (committed epochs) in each uploaded changelog segment (a Prometheus histogram).",
    ("job_id",),
    (1, 2, 5, 10, 20, 50, 100, 1000),
)

LOCAL_DIR_AVAILABLE = MetricSpec(
    "keyedstate_taskmanager_local_dir_available_bytes",
    _G,
    Unit.BYTES,
    "Free bytes (for unprivileged users) of the file system holding the TaskManager's working directory "
    "(state.backend.rocksdb.localdir): the slots' state, local snapshots and local-recovery copies.",
)
LOCAL_DIR_CAPACITY = MetricSpec(
    "keyedstate_taskmanager_local_dir_capacity_bytes",
    _G,
    Unit.BYTES,
    "Size of the file system holding the TaskManager's working directory.",
)

# The RocksDB properties Flink's state.backend.rocksdb.metrics.* switch on (the same names as
# o.ROCKSDB_METRICS, which holds each switch and its default), with their unit and meaning.
ROCKSDB_PROPERTIES: dict[str, tuple[Unit, str]] = {
    "num-immutable-mem-table": (Unit.COUNT, "Immutable memtables not yet flushed."),
    "mem-table-flush-pending": (Unit.BOOLEAN, "1 if a memtable flush is pending."),
    "compaction-pending": (Unit.BOOLEAN, "1 if at least one compaction is pending."),
    "background-errors": (Unit.COUNT, "Accumulated background errors (a non-zero value stops writes)."),
    "cur-size-active-mem-table": (Unit.BYTES, "Approximate size of the active memtable."),
    "cur-size-all-mem-tables": (Unit.BYTES, "Approximate size of active and unflushed immutable memtables."),
    "size-all-mem-tables": (Unit.BYTES, "Approximate size of active, unflushed and pinned memtables."),
    "num-entries-active-mem-table": (Unit.COUNT, "Entries in the active memtable."),
    "num-entries-imm-mem-tables": (Unit.COUNT, "Entries in the unflushed immutable memtables."),
    "num-deletes-active-mem-table": (Unit.COUNT, "Delete entries in the active memtable."),
    "num-deletes-imm-mem-tables": (Unit.COUNT, "Delete entries in the unflushed immutable memtables."),
    "estimate-num-keys": (Unit.COUNT, "Estimated number of keys."),
    "estimate-table-readers-mem": (Unit.BYTES, "Estimated memory of table readers (excluding the cache)."),
    "num-snapshots": (Unit.COUNT, "Unreleased snapshots."),
    "num-live-versions": (Unit.COUNT, "Live versions (more means files held by iterators or compactions)."),
    "estimate-live-data-size": (Unit.BYTES, "Estimated size of the live data."),
    "total-sst-files-size": (Unit.BYTES, "Total size of all SST files of all versions."),
    "live-sst-files-size": (Unit.BYTES, "Total size of the SST files of the current version."),
    "estimate-pending-compaction-bytes": (
        Unit.BYTES,
        "Bytes compaction must rewrite to bring every level under its target size.",
    ),
    "num-running-compactions": (Unit.COUNT, "Compactions running."),
    "num-running-flushes": (Unit.COUNT, "Flushes running."),
    "actual-delayed-write-rate": (Unit.BYTES_PER_SECOND, "The current delayed write rate; 0 means no delay."),
    "is-write-stopped": (Unit.BOOLEAN, "1 if writes are stopped (a write stall)."),
    "block-cache-capacity": (Unit.BYTES, "Capacity of the block cache (shared by all slots)."),
    "block-cache-usage": (Unit.BYTES, "Memory of the entries in the block cache (shared by all slots)."),
    "block-cache-pinned-usage": (Unit.BYTES, "Memory of the pinned entries of the block cache."),
}
ROCKSDB_FAMILY = "flink_taskmanager_job_task_operator_column_family_rocksdb_"
ROCKSDB_LABELS = (*SLOT_LABELS, "column_family")


def rocksdb_spec(prop: str) -> MetricSpec:
    """The metric of RocksDB property ``prop`` (``column-family-as-variable: true``)."""
    unit, meaning = ROCKSDB_PROPERTIES[prop]
    switch = f"state.backend.rocksdb.metrics.{prop}"
    return MetricSpec(
        ROCKSDB_FAMILY + _flink_segment(prop),
        _G,
        unit,
        f"RocksDB property rocksdb.{prop} of a column family of a slot: {meaning} Switch: {switch}.",
        ROCKSDB_LABELS,
    )


def _flink_segment(name: str) -> str:
    # Flink's PrometheusReporter replaces every character outside [A-Za-z0-9_:] with "_".
    return "".join(c if c.isalnum() or c in "_:" else "_" for c in name)


SPECS: tuple[MetricSpec, ...] = (
    STATE_REQUESTS,
    STATE_KEYS,
    SLOTS,
    SLOTS_AVAILABLE,
    CHECKPOINT_SYNC,
    CHECKPOINT_ASYNC,
    CHECKPOINT_UPLOADED,
    RESTORE_DURATION,
    RESTORE_DOWNLOADED_FILES,
    RESTORE_DOWNLOADED_BYTES,
    RESTORE_LOCAL_FILES,
    RESTORE_LOCAL_BYTES,
    TTL_SWEEPS,
    TTL_EXPIRED,
    TTL_FAILURES,
    HASHMAP_ENTRIES,
    HASHMAP_KEYS,
    WRITE_BUFFER_MANAGER_USAGE,
    MATERIALIZATION_STARTED,
    MATERIALIZATION_COMPLETED,
    MATERIALIZATION_FAILED,
    MATERIALIZATION_LAST_DURATION,
    *CHANGELOG_SIZE_SPECS.values(),
    UPLOAD_REQUESTS,
    UPLOAD_FAILURES,
    UPLOAD_SIZES,
    UPLOAD_LATENCIES,
    UPLOAD_BATCH_SIZES,
    LOCAL_DIR_AVAILABLE,
    LOCAL_DIR_CAPACITY,
    *(rocksdb_spec(p) for p in ROCKSDB_PROPERTIES),
)
"""Every metric of the TaskManager's own (the RPC latency and auth metrics are common's)."""


@dataclass(frozen=True)
class RocksDBNativeMetricOptions:
    """Which RocksDB properties are exported (``state.backend.rocksdb.metrics.*``), and how."""

    properties: tuple[str, ...]
    column_family_as_variable: bool = True

    @classmethod
    def from_config(cls, conf: Configuration) -> RocksDBNativeMetricOptions:
        """The switches of ``conf`` (defaults: :data:`ROCKSDB_PROPERTIES`)."""
        on = tuple(p for p in ROCKSDB_PROPERTIES if conf.get(o.ROCKSDB_METRICS[p]))
        return cls(on, conf.get(o.ROCKSDB_METRICS_COLUMN_FAMILY_AS_VARIABLE))


SlotBackends = Callable[[], Iterable[tuple[tuple[str, str, str], KeyedStateBackend]]]


class TaskManagerMetrics:
    """The TaskManager's metric families in one registry; the daemon hands it to what reports."""

    def __init__(
        self,
        registry: CollectorRegistry,
        taskmanager_id: TaskManagerId,
        rocksdb: RocksDBNativeMetricOptions | None = None,
    ) -> None:
        self.registry = registry
        self._rocksdb = rocksdb if rocksdb is not None else RocksDBNativeMetricOptions(tuple(ROCKSDB_PROPERTIES))
        self._requests = STATE_REQUESTS.counter(registry)
        self._keys = STATE_KEYS.counter(registry)
        self.slots_total = SLOTS.gauge(registry)
        self.slots_available = SLOTS_AVAILABLE.gauge(registry)
        self.checkpoint_sync_seconds = CHECKPOINT_SYNC.histogram(registry)
        self.checkpoint_async_seconds = CHECKPOINT_ASYNC.histogram(registry)
        self.checkpoint_bytes = CHECKPOINT_UPLOADED.counter(registry)
        self.restore_seconds = RESTORE_DURATION.gauge(registry)
        self._restore = tuple(
            s.counter(registry)
            for s in (RESTORE_DOWNLOADED_FILES, RESTORE_DOWNLOADED_BYTES, RESTORE_LOCAL_FILES, RESTORE_LOCAL_BYTES)
        )
        self._ttl_sweeps = TTL_SWEEPS.counter(registry)
        self._ttl_expired = TTL_EXPIRED.counter(registry)
        self._ttl_failures = TTL_FAILURES.counter(registry)
        self._counters: dict[str, tuple[Counter, Counter]] = {}
        self._materializations = tuple(
            spec.gauge(registry)
            for spec in (MATERIALIZATION_STARTED, MATERIALIZATION_COMPLETED, MATERIALIZATION_FAILED)
        )
        self._materialization_duration = MATERIALIZATION_LAST_DURATION.gauge(registry)
        self._timed: set[tuple[str, str, str]] = set()
        self._changelog_sizes = {part: spec.gauge(registry) for part, spec in CHANGELOG_SIZE_SPECS.items()}
        self._uploads = UPLOAD_REQUESTS.gauge(registry)
        self._upload_failures = UPLOAD_FAILURES.gauge(registry)
        self._upload_sizes = UPLOAD_SIZES.histogram(registry)
        self._upload_latencies = UPLOAD_LATENCIES.histogram(registry)
        self._upload_batches = UPLOAD_BATCH_SIZES.histogram(registry)

    def record_materialization(
        self, labels: tuple[str, str, str], outcome: str, duration_ms: int | None = None
    ) -> None:
        """Count one materialization of a changelog slot: ``started``, ``completed`` (with its duration) or ``failed``."""
        started, completed, failed = self._materializations
        {"started": started, "completed": completed, "failed": failed}[outcome].labels(*labels).inc()
        if duration_ms is not None:
            self._materialization_duration.labels(*labels).set(duration_ms)
        elif labels not in self._timed:
            self._materialization_duration.labels(*labels).set(-1)  # Flink's value before the first completes
        self._timed.add(labels)

    def record_changelog_checkpoint(
        self,
        labels: tuple[str, str, str],
        full_materialized: int,
        inc_materialized: int,
        full_changelog: int,
        inc_changelog: int,
    ) -> None:
        """What the last changelog checkpoint of a slot references and uploaded (Flink's ChangelogStateBackend sizes)."""
        for part, value in (
            ("full_materialized", full_materialized),
            ("inc_materialized", inc_materialized),
            ("full_changelog", full_changelog),
            ("inc_changelog", inc_changelog),
        ):
            self._changelog_sizes[part].labels(*labels).set(value)

    def record_segment_uploads(self, job_id: str, sizes: list[tuple[int, int]], latency_ns: int) -> None:
        """One slot's checkpoint uploaded these changelog segments (``(bytes, change sets)`` each) in ``latency_ns``."""
        if not sizes:
            return
        self._uploads.labels(job_id).inc(len(sizes))
        for size, change_sets in sizes:
            self._upload_sizes.labels(job_id).observe(size)
            self._upload_batches.labels(job_id).observe(change_sets)
        self._upload_latencies.labels(job_id).observe(latency_ns)

    def record_segment_upload_failure(self, job_id: str, segments: int) -> None:
        """A slot's checkpoint failed to upload ``segments`` changelog segments."""
        self._upload_failures.labels(job_id).inc(segments)

    def record_restore(
        self,
        labels: tuple[str, str, str],
        downloaded_files: int,
        downloaded_bytes: int,
        local_files: int,
        local_bytes: int,
    ) -> None:
        """Count one slot restore's reads (``labels``: job, operator, subtask)."""
        for counter, amount in zip(self._restore, (downloaded_files, downloaded_bytes, local_files, local_bytes)):
            counter.labels(*labels).inc(amount)

    def record_request(self, method: str, keys: int) -> None:
        """Count one state call of ``method`` and the ``keys`` it carries (per-method Prometheus counters)."""
        pair = self._counters.get(method)
        if pair is None:
            pair = (self._requests.labels(method), self._keys.labels(method))
            self._counters[method] = pair
        pair[0].inc()
        pair[1].inc(keys)

    def record_ttl_sweep(self, labels: tuple[str, str, str], expired: int | None) -> None:
        """Count one background TTL sweep of a slot and the entries it deleted (``None``: the sweep failed)."""
        if expired is None:
            self._ttl_failures.labels(*labels).inc()
            return
        self._ttl_sweeps.labels(*labels).inc()
        if expired:
            self._ttl_expired.labels(*labels).inc(expired)

    def watch_local_dir(self, path: Path) -> None:
        """Export the free and total bytes of ``path``'s file system at scrape time."""
        LOCAL_DIR_AVAILABLE.gauge(self.registry).set_function(lambda: float(shutil.disk_usage(path).free))
        LOCAL_DIR_CAPACITY.gauge(self.registry).set_function(lambda: float(shutil.disk_usage(path).total))

    def watch_slots(self, slot_backends: SlotBackends) -> None:
        """Export each slot's backend statistics at scrape time (RocksDB native metrics, hashmap sizes)."""
        self.registry.register(_SlotStatsCollector(slot_backends, self._rocksdb))


class _SlotStatsCollector(Collector):
    def __init__(self, slot_backends: SlotBackends, options: RocksDBNativeMetricOptions) -> None:
        self._slot_backends = slot_backends
        self._options = options
        self._specs = {p: rocksdb_spec(p) for p in options.properties}

    def describe(self) -> Iterable[GaugeMetricFamily]:
        """Nothing: the families depend on the slots of the moment, so the registry must not cache them."""
        return []

    def collect(self) -> Iterable[GaugeMetricFamily]:
        """One family per enabled RocksDB property (or per column family and property), and the hashmap sizes."""
        families: dict[str, GaugeMetricFamily] = {}

        def add(spec: MetricSpec, name: str, labels: list[str], value: float, label_names: tuple[str, ...]) -> None:
            family = families.get(name)
            if family is None:
                family = families[name] = GaugeMetricFamily(name, spec.help, labels=list(label_names))
            family.add_metric(labels, value)

        for labels, backend in self._slot_backends():
            try:
                self._collect_slot(list(labels), backend, add)
            except Exception:  # a scrape must never fail because one slot is closing
                logger.debug("slot statistics unavailable during scrape", exc_info=True)
        return list(families.values())

    def _collect_slot(self, labels: list[str], backend: KeyedStateBackend, add: Callable[..., None]) -> None:
        if isinstance(backend, HashMapKeyedStateBackend):
            stats = backend.stats()
            add(HASHMAP_ENTRIES, HASHMAP_ENTRIES.name, labels, float(stats["estimate-num-keys"]), SLOT_LABELS)
            add(HASHMAP_KEYS, HASHMAP_KEYS.name, labels, float(stats["num-keys-namespaces"]), SLOT_LABELS)
            return
        if not isinstance(backend, RocksDBKeyedStateBackend):
            return
        wbm = float(backend.stats()["write-buffer-manager-usage"])
        add(WRITE_BUFFER_MANAGER_USAGE, WRITE_BUFFER_MANAGER_USAGE.name, labels, wbm, SLOT_LABELS)
        for cf, prop, value in backend.native_metrics(self._options.properties):
            spec = self._specs[prop]
            if self._options.column_family_as_variable:
                add(spec, spec.name, [*labels, cf], float(value), ROCKSDB_LABELS)
            else:
                # Flink with column-family-as-variable false: the column family is a scope segment.
                name = f"flink_taskmanager_job_task_operator_{_flink_segment(cf)}_rocksdb_{_flink_segment(prop)}"
                add(spec, name, labels, float(value), SLOT_LABELS)
