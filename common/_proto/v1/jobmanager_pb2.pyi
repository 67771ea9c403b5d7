from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BatchAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BATCH_ACTION_UNSPECIFIED: _ClassVar[BatchAction]
    RUN: _ClassVar[BatchAction]
    ALREADY_COMMITTED: _ClassVar[BatchAction]
    WAIT: _ClassVar[BatchAction]
    STOP: _ClassVar[BatchAction]
BATCH_ACTION_UNSPECIFIED: BatchAction
RUN: BatchAction
ALREADY_COMMITTED: BatchAction
WAIT: BatchAction
STOP: BatchAction

class SlotReport(_message.Message):
    __slots__ = ("slot_index", "job_id", "operator_id", "subtask_index")
    SLOT_INDEX_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OPERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    SUBTASK_INDEX_FIELD_NUMBER: _ClassVar[int]
    slot_index: int
    job_id: str
    operator_id: str
    subtask_index: int
    def __init__(self, slot_index: _Optional[int] = ..., job_id: _Optional[str] = ..., operator_id: _Optional[str] = ..., subtask_index: _Optional[int] = ...) -> None: ...

class RegisterTaskManagerRequest(_message.Message):
    __slots__ = ("taskmanager_id", "address", "num_slots", "host", "slots", "metrics_port", "backend", "limits", "internal_address", "cluster_id")
    TASKMANAGER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    INTERNAL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    taskmanager_id: str
    address: str
    num_slots: int
    host: str
    slots: _containers.RepeatedCompositeFieldContainer[SlotReport]
    metrics_port: int
    backend: str
    limits: _common_pb2.StateLimits
    internal_address: str
    cluster_id: str
    def __init__(self, taskmanager_id: _Optional[str] = ..., address: _Optional[str] = ..., num_slots: _Optional[int] = ..., host: _Optional[str] = ..., slots: _Optional[_Iterable[_Union[SlotReport, _Mapping]]] = ..., metrics_port: _Optional[int] = ..., backend: _Optional[str] = ..., limits: _Optional[_Union[_common_pb2.StateLimits, _Mapping]] = ..., internal_address: _Optional[str] = ..., cluster_id: _Optional[str] = ...) -> None: ...

class RegisterTaskManagerResponse(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "heartbeat_timeout_ms", "jobmanager_session", "lease_duration_ms", "kept_slots", "routing_versions")
    class RoutingVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    JOBMANAGER_SESSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    KEPT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    heartbeat_timeout_ms: int
    jobmanager_session: str
    lease_duration_ms: int
    kept_slots: _containers.RepeatedCompositeFieldContainer[SlotReport]
    routing_versions: _containers.ScalarMap[str, int]
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., heartbeat_timeout_ms: _Optional[int] = ..., jobmanager_session: _Optional[str] = ..., lease_duration_ms: _Optional[int] = ..., kept_slots: _Optional[_Iterable[_Union[SlotReport, _Mapping]]] = ..., routing_versions: _Optional[_Mapping[str, int]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("taskmanager_id", "slots", "jobmanager_session")
    TASKMANAGER_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    JOBMANAGER_SESSION_FIELD_NUMBER: _ClassVar[int]
    taskmanager_id: str
    slots: _containers.RepeatedCompositeFieldContainer[SlotReport]
    jobmanager_session: str
    def __init__(self, taskmanager_id: _Optional[str] = ..., slots: _Optional[_Iterable[_Union[SlotReport, _Mapping]]] = ..., jobmanager_session: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class DeregisterTaskManagerRequest(_message.Message):
    __slots__ = ("taskmanager_id",)
    TASKMANAGER_ID_FIELD_NUMBER: _ClassVar[int]
    taskmanager_id: str
    def __init__(self, taskmanager_id: _Optional[str] = ...) -> None: ...

class DeregisterTaskManagerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("job_id", "operators", "max_parallelism", "restore_path", "config")
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OPERATORS_FIELD_NUMBER: _ClassVar[int]
    MAX_PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    RESTORE_PATH_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    operators: _containers.RepeatedCompositeFieldContainer[_common_pb2.OperatorSpec]
    max_parallelism: int
    restore_path: str
    config: _containers.ScalarMap[str, str]
    def __init__(self, job_id: _Optional[str] = ..., operators: _Optional[_Iterable[_Union[_common_pb2.OperatorSpec, _Mapping]]] = ..., max_parallelism: _Optional[int] = ..., restore_path: _Optional[str] = ..., config: _Optional[_Mapping[str, str]] = ...) -> None: ...

class JobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetRoutingRequest(_message.Message):
    __slots__ = ("job_id", "known_version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWN_VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    known_version: int
    def __init__(self, job_id: _Optional[str] = ..., known_version: _Optional[int] = ...) -> None: ...

class TaskManagerInfo(_message.Message):
    __slots__ = ("taskmanager_id", "address", "num_slots", "free_slots", "status", "last_heartbeat_age_ms", "slots", "metrics_port")
    TASKMANAGER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    taskmanager_id: str
    address: str
    num_slots: int
    free_slots: int
    status: str
    last_heartbeat_age_ms: int
    slots: _containers.RepeatedCompositeFieldContainer[SlotReport]
    metrics_port: int
    def __init__(self, taskmanager_id: _Optional[str] = ..., address: _Optional[str] = ..., num_slots: _Optional[int] = ..., free_slots: _Optional[int] = ..., status: _Optional[str] = ..., last_heartbeat_age_ms: _Optional[int] = ..., slots: _Optional[_Iterable[_Union[SlotReport, _Mapping]]] = ..., metrics_port: _Optional[int] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("job_id", "status", "max_parallelism", "operators", "latest_checkpoint_id", "latest_checkpoint_path", "committed_epoch", "failure_cause", "restarts", "routing_version", "durable_epoch", "lineage")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MAX_PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    OPERATORS_FIELD_NUMBER: _ClassVar[int]
    LATEST_CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    LATEST_CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FAILURE_CAUSE_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_VERSION_FIELD_NUMBER: _ClassVar[int]
    DURABLE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    status: str
    max_parallelism: int
    operators: _containers.RepeatedCompositeFieldContainer[_common_pb2.OperatorSpec]
    latest_checkpoint_id: int
    latest_checkpoint_path: str
    committed_epoch: int
    failure_cause: str
    restarts: int
    routing_version: int
    durable_epoch: int
    lineage: _containers.RepeatedCompositeFieldContainer[_common_pb2.LineageEntry]
    def __init__(self, job_id: _Optional[str] = ..., status: _Optional[str] = ..., max_parallelism: _Optional[int] = ..., operators: _Optional[_Iterable[_Union[_common_pb2.OperatorSpec, _Mapping]]] = ..., latest_checkpoint_id: _Optional[int] = ..., latest_checkpoint_path: _Optional[str] = ..., committed_epoch: _Optional[int] = ..., failure_cause: _Optional[str] = ..., restarts: _Optional[int] = ..., routing_version: _Optional[int] = ..., durable_epoch: _Optional[int] = ..., lineage: _Optional[_Iterable[_Union[_common_pb2.LineageEntry, _Mapping]]] = ...) -> None: ...

class ClusterOverview(_message.Message):
    __slots__ = ("taskmanagers", "jobs", "total_slots", "free_slots")
    TASKMANAGERS_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    taskmanagers: _containers.RepeatedCompositeFieldContainer[TaskManagerInfo]
    jobs: _containers.RepeatedCompositeFieldContainer[JobInfo]
    total_slots: int
    free_slots: int
    def __init__(self, taskmanagers: _Optional[_Iterable[_Union[TaskManagerInfo, _Mapping]]] = ..., jobs: _Optional[_Iterable[_Union[JobInfo, _Mapping]]] = ..., total_slots: _Optional[int] = ..., free_slots: _Optional[int] = ...) -> None: ...

class ClusterOverviewRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TriggerCheckpointRequest(_message.Message):
    __slots__ = ("job_id", "savepoint", "target_directory", "wait", "timeout_ms")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SAVEPOINT_FIELD_NUMBER: _ClassVar[int]
    TARGET_DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    savepoint: bool
    target_directory: str
    wait: bool
    timeout_ms: int
    def __init__(self, job_id: _Optional[str] = ..., savepoint: _Optional[bool] = ..., target_directory: _Optional[str] = ..., wait: _Optional[bool] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class CheckpointInfo(_message.Message):
    __slots__ = ("checkpoint_id", "path", "status", "failure_reason", "epoch", "trigger_timestamp_ms", "duration_ms", "full_size", "incremental_size", "savepoint")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REASON_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    FULL_SIZE_FIELD_NUMBER: _ClassVar[int]
    INCREMENTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAVEPOINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: int
    path: str
    status: str
    failure_reason: str
    epoch: int
    trigger_timestamp_ms: int
    duration_ms: int
    full_size: int
    incremental_size: int
    savepoint: bool
    def __init__(self, checkpoint_id: _Optional[int] = ..., path: _Optional[str] = ..., status: _Optional[str] = ..., failure_reason: _Optional[str] = ..., epoch: _Optional[int] = ..., trigger_timestamp_ms: _Optional[int] = ..., duration_ms: _Optional[int] = ..., full_size: _Optional[int] = ..., incremental_size: _Optional[int] = ..., savepoint: _Optional[bool] = ...) -> None: ...

class AcknowledgeCheckpointRequest(_message.Message):
    __slots__ = ("job_id", "checkpoint_id", "taskmanager_id", "state")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    TASKMANAGER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    checkpoint_id: int
    taskmanager_id: str
    state: _common_pb2.SubtaskStateHandle
    def __init__(self, job_id: _Optional[str] = ..., checkpoint_id: _Optional[int] = ..., taskmanager_id: _Optional[str] = ..., state: _Optional[_Union[_common_pb2.SubtaskStateHandle, _Mapping]] = ...) -> None: ...

class DeclineCheckpointRequest(_message.Message):
    __slots__ = ("job_id", "checkpoint_id", "taskmanager_id", "operator_id", "subtask_index", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    TASKMANAGER_ID_FIELD_NUMBER: _ClassVar[int]
    OPERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    SUBTASK_INDEX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    checkpoint_id: int
    taskmanager_id: str
    operator_id: str
    subtask_index: int
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., checkpoint_id: _Optional[int] = ..., taskmanager_id: _Optional[str] = ..., operator_id: _Optional[str] = ..., subtask_index: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("outcome",)
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    outcome: str
    def __init__(self, outcome: _Optional[str] = ...) -> None: ...

class BeginBatchRequest(_message.Message):
    __slots__ = ("job_id", "query_id", "batch_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    query_id: str
    batch_id: int
    def __init__(self, job_id: _Optional[str] = ..., query_id: _Optional[str] = ..., batch_id: _Optional[int] = ...) -> None: ...

class BeginBatchResponse(_message.Message):
    __slots__ = ("action", "epoch", "committed_epoch", "durable_epoch", "job_status", "failure_cause", "routing")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    DURABLE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    JOB_STATUS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_CAUSE_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    action: BatchAction
    epoch: int
    committed_epoch: int
    durable_epoch: int
    job_status: str
    failure_cause: str
    routing: _common_pb2.RoutingTable
    def __init__(self, action: _Optional[_Union[BatchAction, str]] = ..., epoch: _Optional[int] = ..., committed_epoch: _Optional[int] = ..., durable_epoch: _Optional[int] = ..., job_status: _Optional[str] = ..., failure_cause: _Optional[str] = ..., routing: _Optional[_Union[_common_pb2.RoutingTable, _Mapping]] = ...) -> None: ...

class CommitEpochRequest(_message.Message):
    __slots__ = ("job_id", "epoch", "winners", "checkpoint", "wait_for_checkpoint", "expected_routing_version", "query_id", "batch_id", "timeout_ms")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    WINNERS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_ROUTING_VERSION_FIELD_NUMBER: _ClassVar[int]
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    epoch: int
    winners: _containers.RepeatedCompositeFieldContainer[_common_pb2.PartitionAttempt]
    checkpoint: bool
    wait_for_checkpoint: bool
    expected_routing_version: int
    query_id: str
    batch_id: int
    timeout_ms: int
    def __init__(self, job_id: _Optional[str] = ..., epoch: _Optional[int] = ..., winners: _Optional[_Iterable[_Union[_common_pb2.PartitionAttempt, _Mapping]]] = ..., checkpoint: _Optional[bool] = ..., wait_for_checkpoint: _Optional[bool] = ..., expected_routing_version: _Optional[int] = ..., query_id: _Optional[str] = ..., batch_id: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class CommitEpochResponse(_message.Message):
    __slots__ = ("committed_epoch", "already_committed", "checkpoint")
    COMMITTED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ALREADY_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    committed_epoch: int
    already_committed: bool
    checkpoint: CheckpointInfo
    def __init__(self, committed_epoch: _Optional[int] = ..., already_committed: _Optional[bool] = ..., checkpoint: _Optional[_Union[CheckpointInfo, _Mapping]] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints",)
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointInfo]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[CheckpointInfo, _Mapping]]] = ...) -> None: ...

class RestoreJobRequest(_message.Message):
    __slots__ = ("job_id", "restore_path")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RESTORE_PATH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    restore_path: str
    def __init__(self, job_id: _Optional[str] = ..., restore_path: _Optional[str] = ...) -> None: ...

class RescaleJobRequest(_message.Message):
    __slots__ = ("job_id", "parallelism")
    class ParallelismEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    parallelism: _containers.ScalarMap[str, int]
    def __init__(self, job_id: _Optional[str] = ..., parallelism: _Optional[_Mapping[str, int]] = ...) -> None: ...
