"""The JobManager daemon: registry, dispatcher, checkpointing, the gRPC servers, metrics.

Two gRPC servers, one per plane: the client server (jobmanager.rpc.port: the JobManager service
for clients and statectl) and the internal server (jobmanager.internal.port: ResourceManager and
CheckpointCoordinatorGateway for TaskManagers, mutual TLS when security.ssl.internal.enabled).
With TLS off on both planes and no internal port set, one server carries both (docs/security.md).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from keyedstate.common._proto.v1 import jobmanager_pb2_grpc as jm_grpc
from keyedstate.common.auth import AuthMetrics, Role, internal_token, server_interceptors
from keyedstate.common.clock import SYSTEM_CLOCK, Clock, Scheduler, ThreadScheduler
from keyedstate.common.config import Configuration
from keyedstate.common.config import options as o
from keyedstate.common.metrics import MetricsServer
from keyedstate.common.rpc.channels import create_server
from keyedstate.common.rpc.server_metrics import RpcLatencyInterceptor
from keyedstate.common.security import INTERNAL, REST, TransportSecurity, internal_plane_separate
from keyedstate.common.security.transport import DEFAULT_JOBMANAGER_INTERNAL_PORT
from keyedstate.jobmanager.checkpointing import Checkpointing
from keyedstate.jobmanager.dispatcher import Dispatcher
from keyedstate.jobmanager.epochs.coordinator import EpochCoordinator
from keyedstate.jobmanager.metrics import JobManagerMetrics
from keyedstate.jobmanager.registry import TaskManagerRegistry
from keyedstate.jobmanager.rest import ClusterView, RestAccess, RestApi, RestServer
from keyedstate.jobmanager.rpc.internal import CheckpointCoordinatorGatewayServicer, ResourceManagerServicer
from keyedstate.jobmanager.rpc.servicer import JobManagerServicer
from keyedstate.jobmanager.settings import JobManagerSettings
from keyedstate.jobmanager.taskmanager_gateway import TaskManagerGateways

logger = logging.getLogger(__name__)


class JobManager:
    """One JobManager process. ``start()`` serves; ``stop()`` shuts down.

    The one place the JobManager is put together: the constructor creates every collaborator
    (registry, TaskManager gateways, the pool, checkpointing and the HA store, the Dispatcher, the
    epoch coordinator, the servicers) and hands each what it needs; ``start()`` only binds servers.
    """

    def __init__(
        self,
        conf: Configuration,
        clock: Clock = SYSTEM_CLOCK,
        scheduler: Scheduler | None = None,
        security: TransportSecurity | None = None,
    ) -> None:
        self.conf = conf
        self.settings = JobManagerSettings.from_config(conf)
        # Loads and checks every certificate now: a bad file stops the start with the key to fix.
        self.security = security if security is not None else TransportSecurity.from_config(conf)
        self.clock = clock
        self.scheduler = scheduler if scheduler is not None else ThreadScheduler()
        self.metrics_registry = CollectorRegistry()
        s = self.settings
        self.registry = TaskManagerRegistry(
            clock,
            self.scheduler,
            s.heartbeat_timeout_ms,
            check_interval_ms=max(10, min(s.heartbeat_interval_ms, 1000)),
            lease_bound_ms=s.lease_bound_ms,
        )
        # The JobManager's own identity toward TaskManagers: its certificate on the internal mTLS
        # plane, else (auth on) a token of role jobmanager.
        self.gateways = TaskManagerGateways(
            s.max_message_bytes,
            security=self.security.channel_security(INTERNAL),
            token=internal_token(conf, "JobManager", "jobmanager", internal_tls=self.security.enabled(INTERNAL)),
        )
        self.auth_metrics = AuthMetrics(self.metrics_registry, "jobmanager")
        # Calls to TaskManagers in parallel (deploys, releases, notifications) and background failovers.
        self.executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix="jm-deploy")
        self.checkpointing = Checkpointing(
            conf, clock, self.scheduler, self.metrics_registry, self.gateways, self.executor
        )
        self.dispatcher = Dispatcher(
            s, conf, self.registry, self.gateways, self.checkpointing, self.executor, clock, self.scheduler
        )
        self.epochs = EpochCoordinator(
            jobs=self.dispatcher.job,
            commit_on=self.gateways.commit_epoch,
            executor=self.executor,
            fail_over_now=self.dispatcher.fail_over_now,
            clock=self.clock,
            closed=self.dispatcher.closed,
            default_timeout_ms=s.epoch_commit_timeout_ms,
            decisions=self.checkpointing.decision_log,
        )
        self.metrics = JobManagerMetrics(
            self.metrics_registry,
            taskmanagers=lambda: len(self.registry.all()),
            total_slots=self.registry.total_slot_count,
            free_slots=self.registry.free_slot_count,
            jobs=self.dispatcher.jobs,
        )
        self.registry.add_lost_listener(lambda record, cause: self.metrics.taskmanager_lost())
        self.rpc_latency = RpcLatencyInterceptor(self.metrics_registry, "jobmanager")
        self._jobmanager_servicer = JobManagerServicer(self.dispatcher, self.checkpointing, self.epochs)
        self._resource_manager_servicer = ResourceManagerServicer(self.dispatcher)
        self._checkpoint_gateway_servicer = CheckpointCoordinatorGatewayServicer(self.dispatcher, self.checkpointing)
        self._health = health.HealthServicer()
        # The REST API reads through a view of the Dispatcher's public queries; its access checks
        # the same tokens as the gRPC interceptors (security.auth.*).
        self._rest_api = (
            RestApi(
                ClusterView(self.dispatcher.overview, self.dispatcher.jobs, conf, clock),
                RestAccess.from_config(conf),
                refresh_interval_ms=s.web_refresh_interval_ms,
            )
            if s.rest_port >= 0
            else None
        )
        self.port = 0
        self.rest_port: int | None = None
        """The bound REST port (None: ``rest.port`` is -1, or not started)."""
        self.internal_port = 0
        """The port TaskManagers register at (the client port when the planes share a server)."""
        self._server: grpc.Server | None = None
        self._internal_server: grpc.Server | None = None
        self._metrics_server: MetricsServer | None = None
        self._rest_server: RestServer | None = None
        self._stopped = threading.Event()

    @property
    def metrics_port(self) -> int | None:
        """The port the Prometheus endpoint serves on (None: not serving, or metrics.reporter.prom.port -1)."""
        return self._metrics_server.port if self._metrics_server is not None else None

    @property
    def address(self) -> str:
        """Where clients reach this JobManager (``jobmanager.rpc.address`` and the bound port)."""
        return f"{self.settings.address}:{self.port}"

    def start(self) -> None:
        """Bind the servers, recover jobs from the HA store, and serve; a failed start leaves nothing behind."""
        try:
            self._start()
        except BaseException:
            # A failed start inside a long-lived process must not leave the server or port behind.
            self.stop(grace_s=0)
            raise

    def _start(self) -> None:
        s = self.settings
        server, internal = self._create_servers()
        # Jobs come back from the HA store before the first call is served, so that a Spark
        # driver resubmitting its job after the restart finds it instead of creating it anew.
        recovered = self.dispatcher.recover(f"{s.address}:{self.port}", self._leadership_lost)
        self._serve(server, internal)
        self._metrics_server = MetricsServer(
            self.metrics_registry, s.metrics_ports, host=s.bind_host, tls=self.security.http_context()
        )
        self._start_rest()
        self.registry.start()
        for job in recovered:
            if not job.status.terminal:
                self.dispatcher.resume_recovered(job)
        if internal is not server:
            logger.info(
                "jobmanager: internal services (TaskManagers) on %s:%d%s",
                s.address,
                self.internal_port,
                " with mutual TLS" if self.security.enabled(INTERNAL) else "",
            )
        logger.info("jobmanager: serving on %s", self.address)

    def _start_rest(self) -> None:
        """Serve the REST API and web UI on ``rest.port`` (HTTPS with the rest plane's TLS), unless it is -1."""
        if self._rest_api is None:
            return
        s = self.settings
        self.security.check_protected_mode("JobManager's REST API", s.bind_host, REST, "rest.port")
        self._rest_server = RestServer(self._rest_api, s.bind_host, s.rest_port, tls=self.security.http_context())
        self._rest_server.start()
        self.rest_port = self._rest_server.port
        logger.info(
            "jobmanager: web UI and REST API on %s://%s:%d/", self._rest_server.scheme, s.address, self.rest_port
        )

    def _create_servers(self) -> tuple[grpc.Server, grpc.Server]:
        """The client-facing server and the internal one (the same server unless the internal plane is separate).

        Binds both ports (``self.port``, ``self.internal_port``) but starts neither: jobs are
        recovered from the HA store first.
        """
        s = self.settings
        security = self.security
        separate = internal_plane_separate(self.conf, o.JOBMANAGER_INTERNAL_PORT)
        security.check_protected_mode("JobManager", s.bind_host, REST, "jobmanager.bind-host")
        if separate:
            security.check_protected_mode("JobManager's internal port", s.bind_host, INTERNAL, "jobmanager.bind-host")
        server, self.port = create_server(
            s.bind_host,
            s.port,
            threads=s.rpc_threads,
            max_message_bytes=s.max_message_bytes,
            what="JobManager",
            port_key="jobmanager.rpc.port",
            credentials=security.server_credentials(REST),
            interceptors=[self.rpc_latency, *server_interceptors(self.conf, self.auth_metrics, "JobManager")],
        )
        self._server = server
        self.internal_port = self.port
        if not separate:
            return server, server
        internal_port = self.conf.get(o.JOBMANAGER_INTERNAL_PORT)
        internal, self.internal_port = create_server(
            s.bind_host,
            DEFAULT_JOBMANAGER_INTERNAL_PORT if internal_port is None else internal_port,
            threads=s.rpc_threads,
            max_message_bytes=s.max_message_bytes,
            what="JobManager-internal",
            port_key="jobmanager.internal.port",
            credentials=security.server_credentials(INTERNAL),
            interceptors=[
                self.rpc_latency,
                *server_interceptors(
                    self.conf,
                    self.auth_metrics,
                    "JobManager",
                    certificate_role=(Role.INTERNAL if security.enabled(INTERNAL) else None),
                ),
            ],
        )
        self._internal_server = internal
        return server, internal

    def _serve(self, server: grpc.Server, internal: grpc.Server) -> None:
        """Register the servicers and health on their planes, start both servers, report SERVING."""
        jm_grpc.add_JobManagerServicer_to_server(self._jobmanager_servicer, server)
        jm_grpc.add_ResourceManagerServicer_to_server(self._resource_manager_servicer, internal)
        jm_grpc.add_CheckpointCoordinatorGatewayServicer_to_server(self._checkpoint_gateway_servicer, internal)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        if internal is not server:
            health_pb2_grpc.add_HealthServicer_to_server(self._health, internal)
            internal.start()
        server.start()
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)

    def _leadership_lost(self, message: str) -> None:
        # Fencing: another JobManager owns the HA directory now. Stop serving at once; the
        # process exits and its supervisor (systemd, Kubernetes) decides what happens next.
        logger.critical("jobmanager: stopping: %s", message)
        threading.Thread(target=self.stop, kwargs={"grace_s": 0}, name="jm-fenced", daemon=True).start()

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop serving (waiting up to ``grace_s`` for calls under way) and shut every collaborator down."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._rest_server is not None:
            self._rest_server.close()
        self.registry.stop()
        servers = [srv for srv in (self._server, self._internal_server) if srv is not None]
        events = [srv.stop(grace_s) for srv in servers]
        for event in events:
            event.wait(grace_s + 1)
        self.dispatcher.shutdown()
        if self._metrics_server is not None:
            self._metrics_server.close()
        logger.info("jobmanager: stopped")

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until stopped (True) or ``timeout_s`` passed (False)."""
        return self._stopped.wait(timeout_s)
