"""A slot process: serves a share of its TaskManager's slots with a GIL of its own.

Started by :class:`~keyedstate.taskmanager.slot_processes.SlotProcessGroup` as
``python -m keyedstate.taskmanager.slot_process <fd>`` (``taskmanager.slot-processes`` > 1), where
``<fd>`` is its end of a socket pair. The first message is a :class:`SlotProcessSpec`; the process
builds a :class:`~keyedstate.taskmanager.slot_host.SlotHost` (its own RocksDB instances, within
its share of the managed memory, and its own niced checkpoint transfer processes), serves
KeyedState on a port of its own (clients reach it straight from the routing table) and
TaskExecutor plus the :class:`SlotProcessServicer` on a Unix socket only its TaskManager uses,
then answers :class:`SlotProcessReady`.

It serves only while its TaskManager's lease holds: the lease is a read-only view of the page
the TaskManager renews (:class:`~keyedstate.common.lease.SharedLeaseCell`), checked before and
after every call as in the TaskManager itself. Checkpoint acknowledgements go straight to the
JobManager under the TaskManager's id. The process lives as long as its TaskManager: when the
TaskManager's end of the socket closes (a stop, a crash, ``kill -9``) it stops serving, closes
its backends and exits.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest

from keyedstate.common.auth import AuthMetrics, internal_token, server_interceptors
from keyedstate.common.child_process import connect_to_parent
from keyedstate.common.clock import SYSTEM_CLOCK, Clock
from keyedstate.common.config import Configuration
from keyedstate.common.errors import ConfigError
from keyedstate.common.ids import TaskManagerId
from keyedstate.common.lease import Lease, SharedLeaseCell
from keyedstate.common.rpc.channels import create_server, server_options
from keyedstate.common.rpc.server_metrics import RpcLatencyInterceptor
from keyedstate.common.security import INTERNAL, REST, TransportSecurity
from keyedstate.taskmanager.metrics import RocksDBNativeMetricOptions, TaskManagerMetrics
from keyedstate.taskmanager.rpc.jobmanager_connection import JobManagerConnection
from keyedstate.taskmanager.rpc.slot_process_control import SlotProcessServicer
from keyedstate.taskmanager.settings import TaskManagerSettings, working_dir
from keyedstate.taskmanager.slot_host import SlotHost

logger = logging.getLogger(__name__)

MODULE = "keyedstate.taskmanager.slot_process"
"""What a TaskManager runs (``python -m``) to start a slot process."""
_STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class SlotProcessSpec:
    """What a slot process is told first: its place, its configuration and where its lease and control live."""

    index: int
    count: int
    config: dict[str, Any]
    """The TaskManager's configuration with this process's share of the managed memory."""
    lease_path: str
    control_path: str
    """The Unix socket path of its private server (TaskExecutor and SlotProcess)."""


@dataclass(frozen=True)
class SlotProcessReady:
    """The process serves: clients reach its slots on ``port``."""

    port: int


@dataclass(frozen=True)
class SlotProcessFailed:
    """The process could not start; ``message`` says why (a ConfigError's message names the key)."""

    message: str


SLOT_PROCESS_EXIT_WAIT_S = 60.0
"""How long a starting TaskManager waits for the slot processes of its killed predecessor to close their RocksDB."""
_SLOT_LOCK = "slot-processes.lock"


def hold_slot_process_lock(work_dir: Path) -> int:
    """Called by a slot process: a shared lock on the work directory's slot-process lock, held until it exits.

    Returns the descriptor (the lock lives as long as it is open, so the kernel drops it when the
    process dies in any way).
    """
    fd = os.open(work_dir / _SLOT_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def wait_for_slot_processes_gone(work_dir: Path, timeout_s: float) -> None:
    """Wait until no slot process of an earlier TaskManager on ``work_dir`` lives (ConfigError after ``timeout_s``).

    A TaskManager killed with -9 leaves its slot processes closing their RocksDB instances for a
    moment; a successor that deployed meanwhile would find the databases locked.
    """
    fd = os.open(work_dir / _SLOT_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return  # closing the descriptor below releases it for this TaskManager's own slot processes
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ConfigError(
                        f"slot processes of an earlier TaskManager still use {work_dir} after {timeout_s:.0f} s; "
                        "stop them (they exit once their TaskManager is gone) and start again"
                    ) from None
                time.sleep(0.1)
    finally:
        os.close(fd)


class SlotProcess:
    """The slots of one slot process, its client-plane server and its private server."""

    def __init__(self, spec: SlotProcessSpec, clock: Clock = SYSTEM_CLOCK) -> None:
        conf = Configuration(spec.config)
        s = TaskManagerSettings.from_config(conf)
        self.spec = spec
        self.conf = conf
        self.settings = s
        self.security = TransportSecurity.from_config(conf)
        self.id = TaskManagerId(s.resource_id)
        self.registry = CollectorRegistry()
        self.metrics = TaskManagerMetrics(self.registry, self.id, RocksDBNativeMetricOptions.from_config(conf))
        self.rpc_latency = RpcLatencyInterceptor(self.registry, "taskmanager")
        self._stop = threading.Event()
        work = working_dir(s)
        # Held while this process lives: a successor TaskManager waits for it before deploying here.
        self._work_lock = hold_slot_process_lock(work)
        self._cell = SharedLeaseCell(Path(spec.lease_path), create=False)
        self.lease = Lease.follow(clock.boottime_ms, self._cell)
        # Only its checkpoint reports use this connection: the TaskManager registers and heartbeats.
        self.reporter = JobManagerConnection(
            s.jobmanager_address,
            self.id,
            "",
            s.host,
            s.num_slots,
            s.backend,
            0,
            list,
            lambda kept, versions: None,
            self.lease,
            clock,
            self._stop,
            security=self.security.channel_security(INTERNAL),
            cluster_id=s.cluster_id,
            token=internal_token(conf, "TaskManager", "taskmanager", internal_tls=self.security.enabled(INTERNAL)),
        )
        self.host = SlotHost(conf, s, self.id, work, self.lease, self.reporter, self.metrics, clock, self._stop)
        self._health = health.HealthServicer()
        self._server: grpc.Server | None = None
        self._control: grpc.Server | None = None

    def start(self) -> int:
        """Serve; returns the client-plane port."""
        s = self.settings
        self.host.start_transfers()
        server, port = create_server(
            s.bind_host,
            0,
            threads=s.rpc_threads,
            max_message_bytes=s.max_message_bytes,
            what=f"slot process {self.spec.index}",
            port_key="taskmanager.rpc.port",
            credentials=self.security.server_credentials(REST),
            interceptors=[
                self.rpc_latency,
                *server_interceptors(self.conf, AuthMetrics(self.registry, "taskmanager"), "TaskManager"),
            ],
        )
        self._server = server
        control = grpc.server(
            futures.ThreadPoolExecutor(max_workers=s.rpc_threads, thread_name_prefix="slot-control"),
            options=server_options(s.max_message_bytes),
        )
        if control.add_insecure_port(f"unix:{self.spec.control_path}") == 0:
            raise OSError(f"slot process {self.spec.index} cannot listen on {self.spec.control_path}")
        self._control = control
        self.host.add_to(server, control)
        SlotProcessServicer(self.host.slots, self.host.retain, lambda: generate_latest(self.registry)).add_to(control)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        control.start()
        server.start()
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._health.set("keyedstate.v1.KeyedState", health_pb2.HealthCheckResponse.SERVING)
        self.host.start()
        logger.info(
            "slot process %d of %d (taskmanager %s): serving on %s:%d",
            self.spec.index,
            self.spec.count,
            self.id,
            s.host,
            port,
        )
        return port

    def stop(self) -> None:
        """Stop serving, finish the calls in flight, close every backend."""
        self._stop.set()
        self._health.enter_graceful_shutdown()
        servers = [srv for srv in (self._server, self._control) if srv is not None]
        for event in [srv.stop(_STOP_GRACE_S) for srv in servers]:
            event.wait(_STOP_GRACE_S + 1)
        self._server = self._control = None
        self.host.close()
        self.reporter.close()
        self._cell.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``slot_process <socket fd>``."""
    link = connect_to_parent(sys.argv[1:] if argv is None else argv, MODULE, SlotProcessSpec, "slot process")
    if isinstance(link, int):
        return link
    spec = link.first
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s slot-process-{spec.index}[{os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    try:
        process = SlotProcess(spec)
        port = process.start()
    except Exception as exc:  # told to the TaskManager, which stops with it
        logger.exception("slot process %d failed to start", spec.index)
        link.conn.send(SlotProcessFailed(getattr(exc, "message", None) or str(exc)))
        return 1
    link.conn.send(SlotProcessReady(port))
    link.wait_parent_gone()  # nothing more is sent: this returns when the TaskManager's end closes
    process.stop()
    return 0


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy's: the spec the TaskManager sends
    # unpickles as keyedstate.taskmanager.slot_process.SlotProcessSpec.
    from keyedstate.taskmanager.slot_process import main as _main

    sys.exit(_main())
