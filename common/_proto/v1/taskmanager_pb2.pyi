from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StateTarget(_message.Message):
    __slots__ = ("job_id", "operator_id", "subtask_index", "state_name", "routing_version", "epoch")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OPERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    SUBTASK_INDEX_FIELD_NUMBER: _ClassVar[int]
    STATE_NAME_FIELD_NUMBER: _ClassVar[int]
    ROUTING_VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    operator_id: str
    subtask_index: int
    state_name: str
    routing_version: int
    epoch: _common_pb2.EpochContext
    def __init__(self, job_id: _Optional[str] = ..., operator_id: _Optional[str] = ..., subtask_index: _Optional[int] = ..., state_name: _Optional[str] = ..., routing_version: _Optional[int] = ..., epoch: _Optional[_Union[_common_pb2.EpochContext, _Mapping]] = ...) -> None: ...

class KeyedRequest(_message.Message):
    __slots__ = ("target", "keys", "values", "user_keys", "namespace", "namespaces", "return_values")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    USER_KEYS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    RETURN_VALUES_FIELD_NUMBER: _ClassVar[int]
    target: StateTarget
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    values: _containers.RepeatedScalarFieldContainer[bytes]
    user_keys: _containers.RepeatedScalarFieldContainer[bytes]
    namespace: bytes
    namespaces: _containers.RepeatedScalarFieldContainer[bytes]
    return_values: bool
    def __init__(self, target: _Optional[_Union[StateTarget, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., values: _Optional[_Iterable[bytes]] = ..., user_keys: _Optional[_Iterable[bytes]] = ..., namespace: _Optional[bytes] = ..., namespaces: _Optional[_Iterable[bytes]] = ..., return_values: _Optional[bool] = ...) -> None: ...

class ValuesResponse(_message.Message):
    __slots__ = ("values", "found")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[bytes]
    found: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, values: _Optional[_Iterable[bytes]] = ..., found: _Optional[_Iterable[bool]] = ...) -> None: ...

class WriteResponse(_message.Message):
    __slots__ = ("applied",)
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    applied: int
    def __init__(self, applied: _Optional[int] = ...) -> None: ...

class ListValue(_message.Message):
    __slots__ = ("elements",)
    ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    elements: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, elements: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ListsResponse(_message.Message):
    __slots__ = ("lists",)
    LISTS_FIELD_NUMBER: _ClassVar[int]
    lists: _containers.RepeatedCompositeFieldContainer[ListValue]
    def __init__(self, lists: _Optional[_Iterable[_Union[ListValue, _Mapping]]] = ...) -> None: ...

class ScanRequest(_message.Message):
    __slots__ = ("target", "has_key", "key", "namespace", "keys_only", "chunk_size")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    HAS_KEY_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_ONLY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    target: StateTarget
    has_key: bool
    key: bytes
    namespace: bytes
    keys_only: bool
    chunk_size: int
    def __init__(self, target: _Optional[_Union[StateTarget, _Mapping]] = ..., has_key: _Optional[bool] = ..., key: _Optional[bytes] = ..., namespace: _Optional[bytes] = ..., keys_only: _Optional[bool] = ..., chunk_size: _Optional[int] = ...) -> None: ...

class ScanChunk(_message.Message):
    __slots__ = ("keys", "namespaces", "user_keys", "values")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    USER_KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    namespaces: _containers.RepeatedScalarFieldContainer[bytes]
    user_keys: _containers.RepeatedScalarFieldContainer[bytes]
    values: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., namespaces: _Optional[_Iterable[bytes]] = ..., user_keys: _Optional[_Iterable[bytes]] = ..., values: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SlotRestore(_message.Message):
    __slots__ = ("checkpoint_path", "shared_path", "handles", "checkpoint_id")
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    SHARED_PATH_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    checkpoint_path: str
    shared_path: str
    handles: _containers.RepeatedCompositeFieldContainer[_common_pb2.SubtaskStateHandle]
    checkpoint_id: int
    def __init__(self, checkpoint_path: _Optional[str] = ..., shared_path: _Optional[str] = ..., handles: _Optional[_Iterable[_Union[_common_pb2.SubtaskStateHandle, _Mapping]]] = ..., checkpoint_id: _Optional[int] = ...) -> None: ...

class DeploySlotRequest(_message.Message):
    __slots__ = ("job_id", "operator", "subtask_index", "key_groups", "max_parallelism", "slot_index", "routing_version", "restore", "checkpoint_base", "incremental")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OPERATOR_FIELD_NUMBER: _ClassVar[int]
    SUBTASK_INDEX_FIELD_NUMBER: _ClassVar[int]
    KEY_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MAX_PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    SLOT_INDEX_FIELD_NUMBER: _ClassVar[int]
    ROUTING_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_BASE_FIELD_NUMBER: _ClassVar[int]
    INCREMENTAL_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    operator: _common_pb2.OperatorSpec
    subtask_index: int
    key_groups: _common_pb2.KeyGroupRange
    max_parallelism: int
    slot_index: int
    routing_version: int
    restore: SlotRestore
    checkpoint_base: str
    incremental: bool
    def __init__(self, job_id: _Optional[str] = ..., operator: _Optional[_Union[_common_pb2.OperatorSpec, _Mapping]] = ..., subtask_index: _Optional[int] = ..., key_groups: _Optional[_Union[_common_pb2.KeyGroupRange, _Mapping]] = ..., max_parallelism: _Optional[int] = ..., slot_index: _Optional[int] = ..., routing_version: _Optional[int] = ..., restore: _Optional[_Union[SlotRestore, _Mapping]] = ..., checkpoint_base: _Optional[str] = ..., incremental: _Optional[bool] = ...) -> None: ...

class DeploySlotResponse(_message.Message):
    __slots__ = ("restore_duration_ms", "restored_bytes", "downloaded_bytes", "committed_epoch")
    RESTORE_DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DOWNLOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    restore_duration_ms: int
    restored_bytes: int
    downloaded_bytes: int
    committed_epoch: int
    def __init__(self, restore_duration_ms: _Optional[int] = ..., restored_bytes: _Optional[int] = ..., downloaded_bytes: _Optional[int] = ..., committed_epoch: _Optional[int] = ...) -> None: ...

class ReleaseSlotRequest(_message.Message):
    __slots__ = ("job_id", "operator_id", "subtask_index", "discard_local_state", "routing_version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OPERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    SUBTASK_INDEX_FIELD_NUMBER: _ClassVar[int]
    DISCARD_LOCAL_STATE_FIELD_NUMBER: _ClassVar[int]
    ROUTING_VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    operator_id: str
    subtask_index: int
    discard_local_state: bool
    routing_version: int
    def __init__(self, job_id: _Optional[str] = ..., operator_id: _Optional[str] = ..., subtask_index: _Optional[int] = ..., discard_local_state: _Optional[bool] = ..., routing_version: _Optional[int] = ...) -> None: ...

class ReleaseSlotResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointBarrier(_message.Message):
    __slots__ = ("job_id", "checkpoint_id", "timestamp_ms", "target_path", "savepoint", "incremental", "epoch")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    SAVEPOINT_FIELD_NUMBER: _ClassVar[int]
    INCREMENTAL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    checkpoint_id: int
    timestamp_ms: int
    target_path: str
    savepoint: bool
    incremental: bool
    epoch: int
    def __init__(self, job_id: _Optional[str] = ..., checkpoint_id: _Optional[int] = ..., timestamp_ms: _Optional[int] = ..., target_path: _Optional[str] = ..., savepoint: _Optional[bool] = ..., incremental: _Optional[bool] = ..., epoch: _Optional[int] = ...) -> None: ...

class TriggerResponse(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: int
    def __init__(self, slots: _Optional[int] = ...) -> None: ...

class CheckpointNotification(_message.Message):
    __slots__ = ("job_id", "checkpoint_id", "completed")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    checkpoint_id: int
    completed: bool
    def __init__(self, job_id: _Optional[str] = ..., checkpoint_id: _Optional[int] = ..., completed: _Optional[bool] = ...) -> None: ...

class NotificationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EpochCommitRequest(_message.Message):
    __slots__ = ("job_id", "epoch", "winners", "abort", "routing_version", "prepare")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    WINNERS_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    ROUTING_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREPARE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    epoch: int
    winners: _containers.RepeatedCompositeFieldContainer[_common_pb2.PartitionAttempt]
    abort: bool
    routing_version: int
    prepare: bool
    def __init__(self, job_id: _Optional[str] = ..., epoch: _Optional[int] = ..., winners: _Optional[_Iterable[_Union[_common_pb2.PartitionAttempt, _Mapping]]] = ..., abort: _Optional[bool] = ..., routing_version: _Optional[int] = ..., prepare: _Optional[bool] = ...) -> None: ...

class EpochCommitResponse(_message.Message):
    __slots__ = ("committed_epoch", "applied_entries")
    COMMITTED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    APPLIED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    committed_epoch: int
    applied_entries: int
    def __init__(self, committed_epoch: _Optional[int] = ..., applied_entries: _Optional[int] = ...) -> None: ...
