"""The JobManager's settings, read once from the Configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass

from keyedstate.common.config import Configuration
from keyedstate.common.config import options as o
from keyedstate.common.errors import ConfigError
from keyedstate.common.lease import LEASE_FRACTION, MIN_RENEWALS, lease_bound_ms, lease_duration_ms


@dataclass(frozen=True)
class JobManagerSettings:
    address: str
    bind_host: str
    port: int
    rest_port: int
    heartbeat_interval_ms: int
    heartbeat_timeout_ms: int
    max_parallelism: int
    checkpoints_dir: str | None
    savepoints_dir: str | None
    metrics_ports: tuple[int, int]
    rpc_threads: int
    max_message_bytes: int
    ha_type: str
    ha_storage_dir: str | None
    connection_loss_detection: bool = True
    lease_duration_ms: int = 0
    """How long one answered heartbeat lets a TaskManager serve (common.lease)."""
    lease_bound_ms: int = 0
    """How long after a heartbeat the JobManager waits before that TaskManager's lease is certainly over."""
    epoch_commit_timeout_ms: int = 600_000
    """How long a CommitEpoch call waits for a checkpoint holding the epoch when the caller names no timeout."""
    web_refresh_interval_ms: int = 3_000
    """web.refresh-interval: how often the web page refreshes."""
    cluster_id: str = "default"
    """high-availability.cluster-id: TaskManagers registering with another id are refused."""

    @classmethod
    def from_config(cls, conf: Configuration) -> JobManagerSettings:
        address = conf.get(o.JOBMANAGER_ADDRESS)
        interval = conf.get(o.HEARTBEAT_INTERVAL)
        timeout = conf.get(o.HEARTBEAT_TIMEOUT)
        if timeout <= interval:
            raise ConfigError(
                f"heartbeat.timeout ({timeout} ms) must be larger than heartbeat.interval ({interval} ms); "
                "a common choice is five intervals"
            )
        o.checkpoints_in_jobmanager_memory(conf)
        lease = lease_duration_ms(timeout, interval)
        if lease < MIN_RENEWALS * interval:
            raise ConfigError(
                f"heartbeat.timeout ({timeout} ms) is too short for heartbeat.interval ({interval} ms): a TaskManager's "
                f"lease ({lease} ms, at most {LEASE_FRACTION:.0%} of the timeout) must cover {MIN_RENEWALS} heartbeats, or one "
                f"late heartbeat stops it serving; raise heartbeat.timeout to at least "
                f"{math.ceil(MIN_RENEWALS * interval / LEASE_FRACTION)} ms or lower heartbeat.interval"
            )
        return cls(
            address=address,
            bind_host=conf.get(o.JOBMANAGER_BIND_HOST) or address,
            port=conf.get(o.JOBMANAGER_PORT),
            rest_port=conf.get(o.REST_PORT),
            heartbeat_interval_ms=interval,
            heartbeat_timeout_ms=timeout,
            max_parallelism=conf.get(o.MAX_PARALLELISM),
            checkpoints_dir=conf.get(o.CHECKPOINTS_DIR),
            savepoints_dir=conf.get(o.SAVEPOINTS_DIR),
            metrics_ports=conf.get(o.PROM_PORT),
            rpc_threads=conf.get(o.RPC_WORKERS),
            max_message_bytes=conf.get(o.RPC_MAX_MESSAGE),
            ha_type=conf.get(o.HA_TYPE),
            ha_storage_dir=conf.get(o.HA_STORAGE_DIR),
            connection_loss_detection=conf.get(o.HEARTBEAT_CONNECTION_LOSS),
            lease_duration_ms=lease,
            lease_bound_ms=lease_bound_ms(lease),
            web_refresh_interval_ms=conf.get(o.WEB_REFRESH_INTERVAL),
            cluster_id=o.cluster_id(conf),
        )
