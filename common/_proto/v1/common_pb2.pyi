from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StateKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_KIND_UNSPECIFIED: _ClassVar[StateKind]
    VALUE: _ClassVar[StateKind]
    LIST: _ClassVar[StateKind]
    MAP: _ClassVar[StateKind]
    REDUCING: _ClassVar[StateKind]

class TtlUpdateType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TTL_DISABLED: _ClassVar[TtlUpdateType]
    ON_CREATE_AND_WRITE: _ClassVar[TtlUpdateType]
    ON_READ_AND_WRITE: _ClassVar[TtlUpdateType]

class ReduceFunction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REDUCE_UNSPECIFIED: _ClassVar[ReduceFunction]
    SUM: _ClassVar[ReduceFunction]
    MIN: _ClassVar[ReduceFunction]
    MAX: _ClassVar[ReduceFunction]

class NumberType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NUMBER_UNSPECIFIED: _ClassVar[NumberType]
    INT64: _ClassVar[NumberType]
    FLOAT64: _ClassVar[NumberType]
STATE_KIND_UNSPECIFIED: StateKind
VALUE: StateKind
LIST: StateKind
MAP: StateKind
REDUCING: StateKind
TTL_DISABLED: TtlUpdateType
ON_CREATE_AND_WRITE: TtlUpdateType
ON_READ_AND_WRITE: TtlUpdateType
REDUCE_UNSPECIFIED: ReduceFunction
SUM: ReduceFunction
MIN: ReduceFunction
MAX: ReduceFunction
NUMBER_UNSPECIFIED: NumberType
INT64: NumberType
FLOAT64: NumberType

class ReduceField(_message.Message):
    __slots__ = ("name", "function", "type")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    function: ReduceFunction
    type: NumberType
    def __init__(self, name: _Optional[str] = ..., function: _Optional[_Union[ReduceFunction, str]] = ..., type: _Optional[_Union[NumberType, str]] = ...) -> None: ...

class StateDescriptor(_message.Message):
    __slots__ = ("name", "kind", "ttl_ms", "ttl_update", "reduce_fields")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    TTL_UPDATE_FIELD_NUMBER: _ClassVar[int]
    REDUCE_FIELDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: StateKind
    ttl_ms: int
    ttl_update: TtlUpdateType
    reduce_fields: _containers.RepeatedCompositeFieldContainer[ReduceField]
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[StateKind, str]] = ..., ttl_ms: _Optional[int] = ..., ttl_update: _Optional[_Union[TtlUpdateType, str]] = ..., reduce_fields: _Optional[_Iterable[_Union[ReduceField, _Mapping]]] = ...) -> None: ...

class OperatorSpec(_message.Message):
    __slots__ = ("operator_id", "parallelism", "states")
    OPERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    operator_id: str
    parallelism: int
    states: _containers.RepeatedCompositeFieldContainer[StateDescriptor]
    def __init__(self, operator_id: _Optional[str] = ..., parallelism: _Optional[int] = ..., states: _Optional[_Iterable[_Union[StateDescriptor, _Mapping]]] = ...) -> None: ...

class KeyGroupRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class Route(_message.Message):
    __slots__ = ("operator_id", "subtask_index", "key_groups", "taskmanager_id", "address", "slot_index")
    OPERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    SUBTASK_INDEX_FIELD_NUMBER: _ClassVar[int]
    KEY_GROUPS_FIELD_NUMBER: _ClassVar[int]
    TASKMANAGER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SLOT_INDEX_FIELD_NUMBER: _ClassVar[int]
    operator_id: str
    subtask_index: int
    key_groups: KeyGroupRange
    taskmanager_id: str
    address: str
    slot_index: int
    def __init__(self, operator_id: _Optional[str] = ..., subtask_index: _Optional[int] = ..., key_groups: _Optional[_Union[KeyGroupRange, _Mapping]] = ..., taskmanager_id: _Optional[str] = ..., address: _Optional[str] = ..., slot_index: _Optional[int] = ...) -> None: ...

class StateLimits(_message.Message):
    __slots__ = ("max_key_bytes", "max_value_bytes", "max_list_elements")
    MAX_KEY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_VALUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_LIST_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    max_key_bytes: int
    max_value_bytes: int
    max_list_elements: int
    def __init__(self, max_key_bytes: _Optional[int] = ..., max_value_bytes: _Optional[int] = ..., max_list_elements: _Optional[int] = ...) -> None: ...

class RoutingTable(_message.Message):
    __slots__ = ("job_id", "version", "max_parallelism", "routes", "job_status", "limits")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    JOB_STATUS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    max_parallelism: int
    routes: _containers.RepeatedCompositeFieldContainer[Route]
    job_status: str
    limits: StateLimits
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ..., max_parallelism: _Optional[int] = ..., routes: _Optional[_Iterable[_Union[Route, _Mapping]]] = ..., job_status: _Optional[str] = ..., limits: _Optional[_Union[StateLimits, _Mapping]] = ...) -> None: ...

class EpochContext(_message.Message):
    __slots__ = ("epoch", "partition", "attempt", "sequence")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    partition: int
    attempt: int
    sequence: int
    def __init__(self, epoch: _Optional[int] = ..., partition: _Optional[int] = ..., attempt: _Optional[int] = ..., sequence: _Optional[int] = ...) -> None: ...

class StateFileHandle(_message.Message):
    __slots__ = ("path", "size", "sha256", "local_name", "shared")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    LOCAL_NAME_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    sha256: str
    local_name: str
    shared: bool
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ..., local_name: _Optional[str] = ..., shared: _Optional[bool] = ...) -> None: ...

class SubtaskStateHandle(_message.Message):
    __slots__ = ("operator_id", "subtask_index", "key_groups", "backend", "files", "incremental_size", "full_size", "sync_duration_ms", "async_duration_ms", "committed_epoch")
    OPERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    SUBTASK_INDEX_FIELD_NUMBER: _ClassVar[int]
    KEY_GROUPS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    INCREMENTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    FULL_SIZE_FIELD_NUMBER: _ClassVar[int]
    SYNC_DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    ASYNC_DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    operator_id: str
    subtask_index: int
    key_groups: KeyGroupRange
    backend: str
    files: _containers.RepeatedCompositeFieldContainer[StateFileHandle]
    incremental_size: int
    full_size: int
    sync_duration_ms: int
    async_duration_ms: int
    committed_epoch: int
    def __init__(self, operator_id: _Optional[str] = ..., subtask_index: _Optional[int] = ..., key_groups: _Optional[_Union[KeyGroupRange, _Mapping]] = ..., backend: _Optional[str] = ..., files: _Optional[_Iterable[_Union[StateFileHandle, _Mapping]]] = ..., incremental_size: _Optional[int] = ..., full_size: _Optional[int] = ..., sync_duration_ms: _Optional[int] = ..., async_duration_ms: _Optional[int] = ..., committed_epoch: _Optional[int] = ...) -> None: ...

class SlotWrites(_message.Message):
    __slots__ = ("operator_id", "subtask_index", "requests")
    OPERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    SUBTASK_INDEX_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    operator_id: str
    subtask_index: int
    requests: int
    def __init__(self, operator_id: _Optional[str] = ..., subtask_index: _Optional[int] = ..., requests: _Optional[int] = ...) -> None: ...

class PartitionAttempt(_message.Message):
    __slots__ = ("partition", "attempt", "writes", "has_ledger")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    HAS_LEDGER_FIELD_NUMBER: _ClassVar[int]
    partition: int
    attempt: int
    writes: _containers.RepeatedCompositeFieldContainer[SlotWrites]
    has_ledger: bool
    def __init__(self, partition: _Optional[int] = ..., attempt: _Optional[int] = ..., writes: _Optional[_Iterable[_Union[SlotWrites, _Mapping]]] = ..., has_ledger: _Optional[bool] = ...) -> None: ...

class LineageEntry(_message.Message):
    __slots__ = ("query_id", "offset", "first_epoch")
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    FIRST_EPOCH_FIELD_NUMBER: _ClassVar[int]
    query_id: str
    offset: int
    first_epoch: int
    def __init__(self, query_id: _Optional[str] = ..., offset: _Optional[int] = ..., first_epoch: _Optional[int] = ...) -> None: ...
