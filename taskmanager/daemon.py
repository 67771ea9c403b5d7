"""The TaskManager daemon: slots, the gRPC servers, the JobManager connection, metrics.

Two gRPC servers, one per plane: the client server (taskmanager.rpc.port: KeyedState) and the
internal server (taskmanager.internal.port: TaskExecutor, which only the JobManager calls; mutual
TLS when security.ssl.internal.enabled). With TLS off on both planes and no internal port set,
one server carries both (docs/security.md).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from keyedstate.common.auth import AuthMetrics, Role, internal_token, server_interceptors
from keyedstate.common.clock import SYSTEM_CLOCK, Clock
from keyedstate.common.config import Configuration
from keyedstate.common.config import options as o
from keyedstate.common.errors import ConfigError
from keyedstate.common.ids import JobId, SubtaskId, TaskManagerId
from keyedstate.common.lease import Lease
from keyedstate.common.metrics import MetricsServer
from keyedstate.common.rpc.channels import create_server
from keyedstate.common.rpc.server_metrics import RpcLatencyInterceptor
from keyedstate.common.security import INTERNAL, REST, TransportSecurity, internal_plane_separate
from keyedstate.common.storage import StorageCache
from keyedstate.taskmanager.backends import BackendFactory
from keyedstate.taskmanager.deployment import SlotDeployer
from keyedstate.taskmanager.epochs import EpochManager
from keyedstate.taskmanager.metrics import RocksDBNativeMetricOptions, TaskManagerMetrics
from keyedstate.taskmanager.rpc.jobmanager_connection import JobManagerConnection
from keyedstate.taskmanager.rpc.keyed_state import KeyedStateServicer
from keyedstate.taskmanager.rpc.task_executor import TaskExecutorServicer
from keyedstate.taskmanager.rpc.wire import slot_reports
from keyedstate.taskmanager.settings import TaskManagerSettings, working_dir
from keyedstate.taskmanager.slots import SlotTable
from keyedstate.taskmanager.snapshot.manager import SnapshotManager
from keyedstate.taskmanager.snapshot.mover import FileMover, InProcessMover
from keyedstate.taskmanager.snapshot.transfer_process import TransferProcessPool
from keyedstate.taskmanager.state import RocksDBResources, StateLimits
from keyedstate.taskmanager.state.backend import KeyedStateBackend

logger = logging.getLogger(__name__)


class TaskManager:
    """One TaskManager process. ``start()`` serves and registers; ``stop()`` shuts down cleanly.

    The constructor is the one place where the TaskManager is put together: it creates every
    collaborator (slots, backend factory, JobManager connection, snapshot manager, deployer,
    epoch manager, servicers) and hands each what it needs. ``start()`` only binds, serves and
    registers.
    """

    def __init__(
        self, conf: Configuration, clock: Clock = SYSTEM_CLOCK, security: TransportSecurity | None = None
    ) -> None:
        s = TaskManagerSettings.from_config(conf)
        self.conf = conf
        self.settings = s
        # Loads and checks every certificate now: a bad file stops the start with the key to fix.
        self.security = security if security is not None else TransportSecurity.from_config(conf)
        self.clock = clock
        self.id = TaskManagerId(s.resource_id)
        self.registry = CollectorRegistry()
        self.metrics = TaskManagerMetrics(self.registry, self.id, RocksDBNativeMetricOptions.from_config(conf))
        self.rpc_latency = RpcLatencyInterceptor(self.registry, "taskmanager")
        self.port = 0
        self.address = ""
        self.internal_address = ""
        """host:port of TaskExecutor; the client address when the planes share a server."""
        self._stop = threading.Event()
        # Serving needs a lease from the JobManager (granted at registration, renewed by heartbeats).
        self.lease = Lease(clock.boottime_ms)
        self._lock_file: int | None = None
        self._server: grpc.Server | None = None
        self._internal_server: grpc.Server | None = None
        self._health = health.HealthServicer()
        self._metrics_server: MetricsServer | None = None
        self._sweeper: threading.Thread | None = None

        self.slots = SlotTable(s.num_slots, self.id)
        resources = RocksDBResources.from_config(conf) if s.backend == "rocksdb" else None
        self.backends = BackendFactory(s.backend, working_dir(s), StateLimits.from_config(conf), resources, clock)
        self.connection = self._jobmanager_connection()
        storages = StorageCache(conf, self._stop)
        self.transfers = self._file_mover(storages, s.transfer_processes, s.transfer_nice, "checkpoint")
        # Restores are on the recovery's critical path (the slot serves nothing until it is
        # restored): their downloads run at the TaskManager's own priority, in a process of their own.
        self.restore_transfers = self._file_mover(storages, min(1, s.transfer_processes), 0, "restore")
        self.checkpoints = SnapshotManager(
            self.slots,
            self.backends,
            self.connection,
            storages,
            self.transfers,
            self.restore_transfers,
            self.metrics,
            clock,
            transfer_threads=s.transfer_threads,
            local_recovery=s.local_recovery,
        )
        self.deployer = SlotDeployer(self.slots, self.backends, self.checkpoints, clock)
        self.epochs = EpochManager(self.slots, self.backends.instance_dir)
        self._keyed_state = KeyedStateServicer(self.slots, self.metrics, self.lease, self.epochs)
        self._task_executor = TaskExecutorServicer(self.deployer, self.lease, self.checkpoints, self.epochs)

    def _file_mover(self, storages: StorageCache, processes: int, nice: int, role: str) -> FileMover:
        """File transfers in ``processes`` transfer processes at ``nice``, or on this process's threads with 0."""
        if processes == 0:
            return InProcessMover(storages, nice)
        return TransferProcessPool(self.conf, processes, nice, self.clock, role=role)

    def _jobmanager_connection(self) -> JobManagerConnection:
        """The connection to the JobManager: registration, heartbeats, and checkpoint reports."""
        s = self.settings
        return JobManagerConnection(
            s.jobmanager_address,
            self.id,
            "",  # advertised once the servers are bound (start)
            s.host,
            s.num_slots,
            s.backend,
            0,
            lambda: slot_reports(self.slots),
            self._retain_slots,
            self.lease,
            self.clock,
            self._stop,
            limits=self.backends.limits,
            security=self.security.channel_security(INTERNAL),
            cluster_id=s.cluster_id,
            token=internal_token(self.conf, "TaskManager", "taskmanager", internal_tls=self.security.enabled(INTERNAL)),
        )

    # -- lifecycle ----------------------------------------------------------------------------
    @property
    def metrics_port(self) -> int | None:
        """The port the Prometheus endpoint serves on (None: not serving, or metrics.reporter.prom.port -1)."""
        return self._metrics_server.port if self._metrics_server is not None else None

    def start(self) -> None:
        """Bind both planes, serve, then register with the JobManager (which grants the lease)."""
        work = self._prepare_work_dir()
        try:
            self._start(work)
        except BaseException:
            # Release what was set up (work-dir lock, server, metrics port), so that a failed
            # start inside a long-lived process leaves nothing behind.
            self.stop(grace_s=0)
            raise

    def _start(self, work: Path) -> None:
        s = self.settings
        for transfers in (self.transfers, self.restore_transfers):
            transfers.start()  # transfer processes load their storage clients while the servers start
        server, internal = self._bind_servers()
        self._serve(server, internal)
        self.metrics.slots_total.set(s.num_slots)
        self.metrics.slots_available.set_function(self.slots.free_count)
        self.metrics.watch_slots(self._slot_backends)
        self.metrics.watch_local_dir(work)
        self._metrics_server = MetricsServer(
            self.registry, s.metrics_ports, host=s.bind_host, tls=self.security.http_context()
        )
        logger.info(
            "taskmanager %s: serving on %s with %d %s slots (local dir %s)",
            self.id,
            self.address,
            s.num_slots,
            s.backend,
            work,
        )
        self.connection.advertise(
            self.address,
            self.internal_address if internal is not server else "",
            self._metrics_server.port or 0,
        )
        self.connection.register(s.registration_timeout_ms)
        self.connection.start_heartbeats()
        if s.ttl_cleanup_interval_ms > 0:
            self._sweeper = threading.Thread(target=self._ttl_sweep_loop, name="ttl-sweeper", daemon=True)
            self._sweeper.start()

    def _bind_servers(self) -> tuple[grpc.Server, grpc.Server]:
        """The client plane's server and the internal plane's (the same one unless the planes are separate)."""
        s, security = self.settings, self.security
        auth_metrics = AuthMetrics(self.registry, "taskmanager")
        separate = internal_plane_separate(self.conf, o.TASKMANAGER_INTERNAL_PORT)
        security.check_protected_mode("TaskManager", s.bind_host, REST, "taskmanager.bind-host")
        if separate:
            security.check_protected_mode("TaskManager's internal port", s.bind_host, INTERNAL, "taskmanager.bind-host")
        server, self.port = create_server(
            s.bind_host,
            s.rpc_port,
            threads=s.rpc_threads,
            max_message_bytes=s.max_message_bytes,
            what="TaskManager",
            port_key="taskmanager.rpc.port",
            credentials=security.server_credentials(REST),
            interceptors=[self.rpc_latency, *server_interceptors(self.conf, auth_metrics, "TaskManager")],
        )
        self._server = server
        internal, internal_port = server, self.port
        if separate:
            internal, internal_port = create_server(
                s.bind_host,
                self.conf.get(o.TASKMANAGER_INTERNAL_PORT) or 0,
                threads=s.rpc_threads,
                max_message_bytes=s.max_message_bytes,
                what="TaskManager-internal",
                port_key="taskmanager.internal.port",
                credentials=security.server_credentials(INTERNAL),
                interceptors=[
                    self.rpc_latency,
                    *server_interceptors(
                        self.conf,
                        auth_metrics,
                        "TaskManager",
                        certificate_role=(Role.INTERNAL if security.enabled(INTERNAL) else None),
                    ),
                ],
            )
            self._internal_server = internal
        self.address = f"{s.host}:{self.port}"
        self.internal_address = f"{s.host}:{internal_port}"
        return server, internal

    def _serve(self, server: grpc.Server, internal: grpc.Server) -> None:
        """Put the services on their planes, start serving and report healthy."""
        self._keyed_state.add_to(server)
        self._task_executor.add_to(internal)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        if internal is not server:
            health_pb2_grpc.add_HealthServicer_to_server(self._health, internal)
            internal.start()
        server.start()
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._health.set("keyedstate.v1.KeyedState", health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop accepting calls, finish those in flight, flush and close every backend, deregister."""
        if self._stop.is_set() and self._server is None:
            return
        self._stop.set()
        self._health.enter_graceful_shutdown()
        servers = [srv for srv in (self._server, self._internal_server) if srv is not None]
        for event in [srv.stop(grace_s) for srv in servers]:
            event.wait(grace_s + 1)
        self._server = self._internal_server = None
        self.checkpoints.close()
        self.transfers.close()  # after the uploads in flight were cancelled and answered
        self.restore_transfers.close()
        self.epochs.close()
        self.deployer.close_all()
        self.connection.deregister()
        self.connection.close()
        if self._metrics_server is not None:
            self._metrics_server.close()
        if self._lock_file is not None:
            os.close(self._lock_file)
            self._lock_file = None
        logger.info("taskmanager %s: stopped", self.id)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until stopped (True) or ``timeout_s`` passed (False)."""
        return self._stop.wait(timeout_s)

    # -- internals ----------------------------------------------------------------------------
    def _prepare_work_dir(self) -> Path:
        work = working_dir(self.settings)
        try:
            work.mkdir(parents=True, exist_ok=True)
            probe = work / ".write-probe"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(
                f"state.backend.rocksdb.localdir {self.settings.local_dir} cannot be written ({exc.strerror or exc}); "
                "point it at a writable directory"
            ) from exc
        # A raw descriptor held until stop(): the lock lives as long as it is open.
        lock = os.open(work / "taskmanager.lock", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(lock)
            raise ConfigError(
                f"another TaskManager already uses {work}; give each TaskManager its own "
                "state.backend.rocksdb.localdir or taskmanager.resource-id"
            ) from exc
        os.write(lock, str(os.getpid()).encode())
        self._lock_file = lock
        return work

    def _retain_slots(self, kept: set[SubtaskId], routing_versions: dict[JobId, int]) -> None:
        # The JobManager's word on the jobs' versions replaces what this TaskManager saw (a
        # JobManager that lost its jobs numbers their deployments from 1 again).
        self.slots.set_version_floors(routing_versions)
        if self.deployer.retain(kept):
            self.epochs.sweep()

    def _slot_backends(self) -> Iterator[tuple[tuple[str, str, str], KeyedStateBackend]]:
        for slot in self.slots.all():
            if slot.backend is not None:
                yield _slot_labels(slot.subtask), slot.backend

    def _ttl_sweep_loop(self) -> None:
        interval = self.settings.ttl_cleanup_interval_ms / 1000.0
        while not self._stop.wait(interval):
            for slot in self.slots.all():
                backend = slot.backend
                if backend is None or not any(d.ttl for d in slot.operator.states):
                    continue
                removed: int | None = None
                try:
                    removed = backend.ttl_sweep(self.settings.ttl_cleanup_batch)
                    if removed:
                        logger.debug("ttl sweep: %s removed %d expired entries", slot.subtask, removed)
                except Exception:
                    logger.exception("ttl sweep of %s failed", slot.subtask)
                self.metrics.record_ttl_sweep(_slot_labels(slot.subtask), removed)


def _slot_labels(subtask: SubtaskId) -> tuple[str, str, str]:
    """A slot's metric labels: job_id, operator_id, subtask_index."""
    return subtask.job_id, subtask.operator_id, str(subtask.subtask_index)
