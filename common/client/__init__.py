"""The executor client: import this inside PySpark executors (no JVM needed).

from keyedstate.common.client import StateClient, ValueState
client = StateClient("jobmanager-host:6123")
counts = ValueState(client, "my-job", "counter", "count", key_serializer="str", value_serializer="int")
counts.put_many(["a", "b"], [1, 2])
"""

from keyedstate.common.claim_mode import RecoveryClaimMode
from keyedstate.common.client._batch import BatchStart, CheckpointSummary, EpochCommitted, JobProgress, status_name
from keyedstate.common.client._client import ClientSettings, StateClient, client_security
from keyedstate.common.client._epoch import EpochScope
from keyedstate.common.client._routing import Routing
from keyedstate.common.client._states import ListState, MapState, ReducingState, ValueState
from keyedstate.common.lifecycle import BatchAction, CheckpointStatus, JobStatus
from keyedstate.common.rpc.health import check_health
from keyedstate.common.security.tls import ChannelSecurity

__all__ = [
    "BatchAction",
    "BatchStart",
    "ChannelSecurity",
    "CheckpointStatus",
    "CheckpointSummary",
    "ClientSettings",
    "EpochCommitted",
    "EpochScope",
    "JobProgress",
    "JobStatus",
    "ListState",
    "MapState",
    "RecoveryClaimMode",
    "ReducingState",
    "Routing",
    "StateClient",
    "ValueState",
    "check_health",
    "client_security",
    "status_name",
]
