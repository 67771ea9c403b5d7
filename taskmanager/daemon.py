"""The TaskManager daemon: slots, the gRPC servers, the JobManager connection, metrics.

Two gRPC servers, one per plane: the client server (taskmanager.rpc.port: KeyedState) and the
internal server (taskmanager.internal.port: TaskExecutor, which only the JobManager calls; mutual
TLS when security.ssl.internal.enabled). With TLS off on both planes and no internal port set,
one server carries both (docs/security.md).

Process layout: with ``taskmanager.slot-processes: 1`` this process serves every slot (a
:class:`~keyedstate.taskmanager.slot_host.SlotHost`); with N > 1 the slots live in N slot
processes (:class:`~keyedstate.taskmanager.slot_processes.SlotProcessGroup`) and this process
keeps the JobManager connection, the lease they all read, the internal plane (forwarding each
TaskExecutor call) and the metrics endpoint.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
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
from keyedstate.common.lease import Lease, SharedLeaseCell
from keyedstate.common.metrics import MetricsServer
from keyedstate.common.rpc.channels import create_server
from keyedstate.common.rpc.server_metrics import RpcLatencyInterceptor
from keyedstate.common.security import INTERNAL, REST, TransportSecurity, internal_plane_separate
from keyedstate.taskmanager.metrics import SLOTS, SLOTS_AVAILABLE, RocksDBNativeMetricOptions, TaskManagerMetrics
from keyedstate.taskmanager.rpc.jobmanager_connection import JobManagerConnection
from keyedstate.taskmanager.rpc.keyed_state import KeyedStateServicer
from keyedstate.taskmanager.rpc.task_executor_forwarding import ForwardingTaskExecutorServicer
from keyedstate.taskmanager.rpc.wire import slot_reports
from keyedstate.taskmanager.settings import TaskManagerSettings, working_dir
from keyedstate.taskmanager.slot_host import SlotHost
from keyedstate.taskmanager.slot_process import SLOT_PROCESS_EXIT_WAIT_S, wait_for_slot_processes_gone
from keyedstate.taskmanager.slot_processes import MergedMetrics, SlotProcessGroup, remove_leftover_control_dir
from keyedstate.taskmanager.slots import SlotTable
from keyedstate.taskmanager.state import StateLimits

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
        self.failure: str | None = None
        """Why the TaskManager stopped by itself (a slot process that could not be replaced); None: it did not."""
        self._lock_file: int | None = None
        self._server: grpc.Server | None = None
        self._internal_server: grpc.Server | None = None
        self._health = health.HealthServicer()
        self._metrics_server: MetricsServer | None = None

        self.host: SlotHost | None = None
        self.slot_processes: SlotProcessGroup | None = None
        self._lease_cell: SharedLeaseCell | None = None
        if s.slot_processes == 1:
            # Serving needs a lease from the JobManager (granted at registration, renewed by heartbeats).
            self.lease = Lease(clock.boottime_ms)
            self.connection = self._jobmanager_connection()
            self.host = SlotHost(
                conf, s, self.id, working_dir(s), self.lease, self.connection, self.metrics, clock, self._stop
            )
            self.slots = self.host.slots
            self.backends = self.host.backends
            self.transfers = self.host.transfers
            self.checkpoints = self.host.checkpoints
            self.deployer = self.host.deployer
            self.epochs = self.host.epochs
            self._keyed_state = self.host.keyed_state
        else:
            group = SlotProcessGroup(
                conf,
                s.slot_processes,
                s.num_slots,
                s.host,
                s.resource_id,
                self._slot_process_replaced,
                self._slot_process_lost,
            )
            self.slot_processes = group
            # The lease lives on a page every slot process reads before and after each call.
            self._lease_cell = SharedLeaseCell(group.lease_path, create=True)
            self.lease = Lease(clock.boottime_ms, self._lease_cell)
            self.connection = self._jobmanager_connection()
            # Clients of an old routing table that still call this port hear "refresh the routing table".
            self.slots = SlotTable(s.num_slots, self.id)
            self._keyed_state = KeyedStateServicer(self.slots, self.metrics, self.lease)
            self._forwarder = ForwardingTaskExecutorServicer(group, self.lease)

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
            self.slot_processes.reports if self.slot_processes is not None else lambda: slot_reports(self.slots),
            self._retain_slots,
            self.lease,
            self.clock,
            self._stop,
            limits=StateLimits.from_config(self.conf),
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
        if self.host is not None:
            self.host.start_transfers()  # transfer processes load their storage clients while the servers start
        if self.slot_processes is not None:
            self.slot_processes.start(work)
        server, internal = self._bind_servers()
        self._serve(server, internal)
        self.metrics.slots_total.set(s.num_slots)
        self.metrics.slots_available.set_function(self._free_slots)
        exposed = self.registry
        if self.host is not None:
            self.host.start()
        else:
            self.metrics.watch_local_dir(work)
            assert self.slot_processes is not None
            exposed = CollectorRegistry()
            exposed.register(
                MergedMetrics(self.registry, self.slot_processes, frozenset({SLOTS.name, SLOTS_AVAILABLE.name}))
            )
        self._metrics_server = MetricsServer(
            exposed, s.metrics_ports, host=s.bind_host, tls=self.security.http_context()
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
            self.slot_processes.slot_addresses() if self.slot_processes is not None else None,
            self.slot_processes.processes() if self.slot_processes is not None else None,
        )
        self.connection.register(s.registration_timeout_ms)
        self.connection.start_heartbeats()

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
        if self.host is not None:
            self.host.add_to(server, internal)
        else:
            self._keyed_state.add_to(server)
            self._forwarder.add_to(internal)
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
        if self.host is not None:
            self.host.close()
        if self.slot_processes is not None:
            self.slot_processes.close()
        self.connection.deregister()
        self.connection.close()
        if self._metrics_server is not None:
            self._metrics_server.close()
        if self._lease_cell is not None:
            self._lease_cell.close()
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
        wait_for_slot_processes_gone(work, SLOT_PROCESS_EXIT_WAIT_S)
        remove_leftover_control_dir(work)  # a killed predecessor's lease page and sockets
        return work

    def _retain_slots(self, kept: set[SubtaskId], routing_versions: dict[JobId, int]) -> None:
        if self.host is not None:
            self.host.retain(kept, routing_versions)
        elif self.slot_processes is not None:
            self.slot_processes.retain(kept, routing_versions)

    def _free_slots(self) -> int:
        if self.slot_processes is not None:
            return self.settings.num_slots - len(self.slot_processes.reports())
        return self.slots.free_count()

    def _slot_process_replaced(self, index: int) -> None:
        assert self.slot_processes is not None
        logger.warning(
            "taskmanager %s: slot process %d replaced; registering again with its new address", self.id, index
        )
        self.connection.readvertise_slots(self.slot_processes.slot_addresses(), self.slot_processes.processes())

    def _slot_process_lost(self, why: str) -> None:
        logger.error("taskmanager %s: %s; stopping", self.id, why)
        self.failure = why
        self._stop.set()
