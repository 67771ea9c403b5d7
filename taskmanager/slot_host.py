"""The slot stack: everything that serves slots, put together once for either process layout.

A :class:`SlotHost` holds the slot table, the backend factory, the checkpoint transfers, the
:class:`SnapshotManager`, the deployer, the epoch manager and both servicers (KeyedState and
TaskExecutor), plus the TTL sweeper. The TaskManager process builds one when it serves every
slot itself (``taskmanager.slot-processes: 1``); each slot process builds one for its share of
the slots otherwise (:mod:`~keyedstate.taskmanager.slot_process`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc

from keyedstate.common.clock import Clock
from keyedstate.common.config import Configuration
from keyedstate.common.ids import JobId, SubtaskId, TaskManagerId
from keyedstate.common.lease import Lease
from keyedstate.common.storage import StorageCache
from keyedstate.taskmanager.backends import BackendFactory
from keyedstate.taskmanager.changelog.change_sets import ChangeSetStore
from keyedstate.taskmanager.deployment import SlotDeployer
from keyedstate.taskmanager.epochs import EpochManager
from keyedstate.taskmanager.metrics import TaskManagerMetrics
from keyedstate.taskmanager.rpc.keyed_state import KeyedStateServicer
from keyedstate.taskmanager.rpc.task_executor import TaskExecutorServicer
from keyedstate.taskmanager.settings import TaskManagerSettings
from keyedstate.taskmanager.slots import SlotTable
from keyedstate.taskmanager.snapshot.manager import CheckpointReporter, SnapshotManager
from keyedstate.taskmanager.snapshot.mover import FileMover, InProcessMover
from keyedstate.taskmanager.snapshot.transfer_process import TransferProcessPool
from keyedstate.taskmanager.state import RocksDBResources, StateLimits
from keyedstate.taskmanager.state.backend import KeyedStateBackend

logger = logging.getLogger(__name__)


class SlotHost:
    """The slots one process serves, with their backends, checkpoints, epochs and servicers."""

    def __init__(
        self,
        conf: Configuration,
        settings: TaskManagerSettings,
        taskmanager_id: TaskManagerId,
        work_dir: Path,
        lease: Lease,
        reporter: CheckpointReporter,
        metrics: TaskManagerMetrics,
        clock: Clock,
        stop: threading.Event,
    ) -> None:
        s = settings
        self._conf = conf
        self._settings = s
        self._metrics = metrics
        self._clock = clock
        self._stop = stop
        self._work_dir = work_dir
        self._sweeper: threading.Thread | None = None
        self.slots = SlotTable(s.num_slots, taskmanager_id)
        resources = RocksDBResources.from_config(conf) if s.backend == "rocksdb" else None
        self.backends = BackendFactory(s.backend, work_dir, StateLimits.from_config(conf), resources, clock)
        storages = StorageCache(conf, stop)
        self.transfers = self._file_mover(storages, s.transfer_processes, s.transfer_nice, "checkpoint")
        # Restores are on the recovery's critical path (the slot serves nothing until it is
        # restored): their downloads run at the TaskManager's own priority, in a process of their own.
        self.restore_transfers = self._file_mover(storages, min(1, s.transfer_processes), 0, "restore")
        self.checkpoints = SnapshotManager(
            self.slots,
            self.backends,
            reporter,
            storages,
            self.transfers,
            self.restore_transfers,
            metrics,
            clock,
            transfer_threads=s.transfer_threads,
            local_recovery=s.local_recovery,
        )
        change_sets = ChangeSetStore(storages)
        self.deployer = SlotDeployer(self.slots, self.backends, self.checkpoints, clock, change_sets)
        self.epochs = EpochManager(self.slots, self.backends.instance_dir, change_sets=change_sets)
        self.keyed_state = KeyedStateServicer(self.slots, metrics, lease, self.epochs)
        self.task_executor = TaskExecutorServicer(self.deployer, lease, self.checkpoints, self.epochs)

    def _file_mover(self, storages: StorageCache, processes: int, nice: int, role: str) -> FileMover:
        """File transfers in ``processes`` transfer processes at ``nice``, or on this process's threads with 0."""
        if processes == 0:
            return InProcessMover(storages, nice)
        return TransferProcessPool(self._conf, processes, nice, self._clock, role=role)

    def start_transfers(self) -> None:
        """Start the transfer processes (they load their storage clients while the servers start)."""
        for transfers in (self.transfers, self.restore_transfers):
            transfers.start()

    def start(self) -> None:
        """Watch the slots in the metrics and start the TTL sweeper (once serving)."""
        self._metrics.watch_slots(self.slot_backends)
        self._metrics.watch_local_dir(self._work_dir)
        self.checkpoints.start_materializing()
        if self._settings.ttl_cleanup_interval_ms > 0:
            self._sweeper = threading.Thread(target=self._ttl_sweep_loop, name="ttl-sweeper", daemon=True)
            self._sweeper.start()

    def add_to(self, server: grpc.Server, internal: grpc.Server) -> None:
        """KeyedState on the client plane's ``server``, TaskExecutor on ``internal``."""
        self.keyed_state.add_to(server)
        self.task_executor.add_to(internal)

    def retain(self, kept: set[SubtaskId], routing_versions: dict[JobId, int]) -> None:
        """Release every slot the JobManager does not let us keep; its versions are the deploy floors."""
        # The JobManager's word on the jobs' versions replaces what this TaskManager saw (a
        # JobManager that lost its jobs numbers their deployments from 1 again).
        self.slots.set_version_floors(routing_versions)
        if self.deployer.retain(kept, routing_versions):
            self.epochs.sweep()

    def close(self) -> None:
        """Cancel uploads, stop the transfer processes, flush and close every backend (servers stopped first)."""
        self.checkpoints.close()
        for mover in (self.transfers, self.restore_transfers):  # after the uploads in flight were cancelled
            mover.close()
        self.epochs.close()
        self.deployer.close_all()

    def slot_backends(self) -> Iterator[tuple[tuple[str, str, str], KeyedStateBackend]]:
        """Every running slot's metric labels and backend."""
        for slot in self.slots.all():
            if slot.backend is not None:
                yield slot_labels(slot.subtask), slot.backend

    def _ttl_sweep_loop(self) -> None:
        interval = self._settings.ttl_cleanup_interval_ms / 1000.0
        while not self._stop.wait(interval):
            for slot in self.slots.all():
                backend = slot.backend
                if backend is None or not any(d.ttl for d in slot.operator.states):
                    continue
                removed: int | None = None
                try:
                    removed = backend.ttl_sweep(self._settings.ttl_cleanup_batch)
                    if removed:
                        logger.debug("ttl sweep: %s removed %d expired entries", slot.subtask, removed)
                except Exception:
                    logger.exception("ttl sweep of %s failed", slot.subtask)
                self._metrics.record_ttl_sweep(slot_labels(slot.subtask), removed)


def slot_labels(subtask: SubtaskId) -> tuple[str, str, str]:
    """A slot's metric labels: job_id, operator_id, subtask_index."""
    return subtask.job_id, subtask.operator_id, str(subtask.subtask_index)
