"""The TaskManager's settings, read once from the Configuration."""

from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass
from pathlib import Path

from keyedstate.common.config import Configuration
from keyedstate.common.config import options as o
from keyedstate.common.errors import ConfigError
from keyedstate.common.security.transport import jobmanager_internal_port


@dataclass(frozen=True)
class TaskManagerSettings:
    jobmanager_address: str
    """host:port of the JobManager's internal services (its client port when the planes share a server)."""
    host: str
    """The address reported to the JobManager and used by clients."""
    bind_host: str
    rpc_port: int
    num_slots: int
    resource_id: str
    backend: str
    local_dir: Path
    metrics_ports: tuple[int, int]
    registration_timeout_ms: int
    rpc_threads: int
    max_message_bytes: int
    transfer_threads: int
    """Files in flight per slot transfer (state.backend.rocksdb.checkpoint.transfer.thread.num)."""
    transfer_processes: int
    """Checkpoint transfer worker processes; 0 moves files inside this process."""
    transfer_nice: int
    """CPU niceness of the transfer processes (or threads)."""
    ttl_cleanup_interval_ms: int
    ttl_cleanup_batch: int
    local_recovery: bool
    slot_processes: int = 1
    """Processes serving the slots (``taskmanager.slot-processes``); 1: this process serves them all."""
    cluster_id: str = "default"
    """high-availability.cluster-id, sent at registration: a JobManager of another cluster refuses us."""

    @classmethod
    def from_config(cls, conf: Configuration) -> TaskManagerSettings:
        host = conf.get(o.TASKMANAGER_HOST)
        local_dir = Path(conf.get(o.ROCKSDB_LOCALDIR)).expanduser().absolute()
        resource_id = conf.get(o.TASKMANAGER_RESOURCE_ID) or _default_resource_id(local_dir)
        return cls(
            jobmanager_address=f"{conf.get(o.JOBMANAGER_ADDRESS)}:{_jobmanager_internal_port(conf)}",
            host=host,
            bind_host=conf.get(o.TASKMANAGER_BIND_HOST) or host,
            rpc_port=conf.get(o.TASKMANAGER_PORT),
            num_slots=conf.get(o.TASKMANAGER_SLOTS),
            resource_id=resource_id,
            backend=conf.get(o.STATE_BACKEND),
            local_dir=local_dir,
            metrics_ports=conf.get(o.PROM_PORT),
            registration_timeout_ms=conf.get(o.TASKMANAGER_REGISTRATION_TIMEOUT),
            rpc_threads=conf.get(o.RPC_WORKERS),
            max_message_bytes=conf.get(o.RPC_MAX_MESSAGE),
            transfer_threads=conf.get(o.ROCKSDB_TRANSFER_THREADS),
            transfer_processes=conf.get(o.TASKMANAGER_TRANSFER_PROCESSES),
            transfer_nice=conf.get(o.TASKMANAGER_TRANSFER_NICE),
            ttl_cleanup_interval_ms=conf.get(o.TTL_CLEANUP_INTERVAL),
            ttl_cleanup_batch=conf.get(o.TTL_CLEANUP_BATCH),
            local_recovery=conf.get(o.LOCAL_RECOVERY),
            slot_processes=conf.get(o.TASKMANAGER_SLOT_PROCESSES),
            cluster_id=o.cluster_id(conf),
        )


def _jobmanager_internal_port(conf: Configuration) -> int:
    port = jobmanager_internal_port(conf)
    if port == 0:
        key = "jobmanager.internal.port" if conf.is_set(o.JOBMANAGER_INTERNAL_PORT) else "jobmanager.rpc.port"
        raise ConfigError(f"{key} is 0 on a TaskManager: set it to the port the JobManager printed at start-up")
    return port


def _default_resource_id(local_dir: Path) -> str:
    # Stable across restarts on the same host with the same local directory, so the JobManager
    # recognises a restarted TaskManager and local recovery finds its files again.
    digest = hashlib.sha1(str(local_dir).encode()).hexdigest()[:8]
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())[:40] or "tm"
    return f"{name}-{digest}"


def working_dir(settings: TaskManagerSettings) -> Path:
    return settings.local_dir / f"tm_{settings.resource_id}"
