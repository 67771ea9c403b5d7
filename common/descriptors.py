"""State descriptors: what a job declares about each state (name, kind, TTL, reduce fields)."""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field

from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.ids import validate_id, validate_name


class StateKind(enum.Enum):
    VALUE = "value"
    LIST = "list"
    MAP = "map"
    REDUCING = "reducing"
    TIMERS = "timers"
    """Per-key timers (:class:`keyedstate.common.client.TimerService`), stored as map state
    ordered by time within each key group."""

    @property
    def storage_kind(self) -> StateKind:
        """The kind whose stored layout this kind uses (timers are map entries; the rest their own)."""
        return StateKind.MAP if self is StateKind.TIMERS else self


class TtlUpdateType(enum.Enum):
    """When the TTL clock of an entry restarts (Flink's ``StateTtlConfig.UpdateType``)."""

    ON_CREATE_AND_WRITE = "OnCreateAndWrite"
    ON_READ_AND_WRITE = "OnReadAndWrite"


class ReduceFunction(enum.Enum):
    SUM = "sum"
    MIN = "min"
    MAX = "max"


class NumberType(enum.Enum):
    INT64 = "int64"
    FLOAT64 = "float64"


@dataclass(frozen=True)
class TtlConfig:
    """Processing-time TTL; expired values are never returned (``NeverReturnExpired``)."""

    ttl_ms: int
    update_type: TtlUpdateType = TtlUpdateType.ON_CREATE_AND_WRITE

    def __post_init__(self) -> None:
        if self.ttl_ms <= 0:
            raise InvalidArgumentError(f"TTL must be positive, got {self.ttl_ms} ms")


@dataclass(frozen=True)
class ReduceField:
    name: str
    function: ReduceFunction = ReduceFunction.SUM
    type: NumberType = NumberType.INT64


STATE_NAME_LENGTH = 64


@dataclass(frozen=True)
class StateDescriptor:
    """One named state of an operator. Each becomes one RocksDB column family."""

    name: str
    kind: StateKind
    ttl: TtlConfig | None = None
    reduce_fields: tuple[ReduceField, ...] = ()

    def __post_init__(self) -> None:
        validate_name("state name", self.name, max_length=STATE_NAME_LENGTH, letter_first=True)
        if self.kind is StateKind.REDUCING and not self.reduce_fields:
            raise InvalidArgumentError(f"reducing state {self.name!r} needs at least one reduce field")
        if self.kind is StateKind.TIMERS and self.ttl is not None:
            raise InvalidArgumentError(
                f"timers state {self.name!r} cannot have a TTL: a timer must never expire unfired"
            )
        if self.kind is not StateKind.REDUCING and self.reduce_fields:
            raise InvalidArgumentError(
                f"state {self.name!r} is {self.kind.value}; only reducing state has reduce fields"
            )

    # -- reducing-state vectors ---------------------------------------------------------------
    @property
    def vector_format(self) -> struct.Struct:
        """The fixed binary layout of a reducing state's value (big-endian int64/float64 fields)."""
        return struct.Struct(">" + "".join("q" if f.type is NumberType.INT64 else "d" for f in self.reduce_fields))


@dataclass(frozen=True)
class OperatorSpec:
    """An operator of a job: its id, parallelism and declared states."""

    operator_id: str
    parallelism: int
    states: tuple[StateDescriptor, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        validate_id("operator id", self.operator_id)
        names = [s.name for s in self.states]
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            raise InvalidArgumentError(f"operator {self.operator_id!r} declares state {sorted(dupes)[0]!r} twice")
        if self.parallelism < 1:
            raise InvalidArgumentError(
                f"operator {self.operator_id!r}: parallelism must be at least 1, got {self.parallelism}"
            )

    def state(self, name: str) -> StateDescriptor:
        """The descriptor of the operator's state ``name``; KeyError if it declares none of that name."""
        for s in self.states:
            if s.name == name:
                return s
        raise KeyError(name)
