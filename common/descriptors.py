"""State descriptors: what a job declares about each state (name, kind, TTL, reduce fields)."""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.ids import validate_id, validate_name


class StateKind(enum.Enum):
    VALUE = "value"
    LIST = "list"
    MAP = "map"
    REDUCING = "reducing"


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
        if self.kind is not StateKind.REDUCING and self.reduce_fields:
            raise InvalidArgumentError(
                f"state {self.name!r} is {self.kind.value}; only reducing state has reduce fields"
            )

    # -- reducing-state vectors ---------------------------------------------------------------
    @property
    def vector_format(self) -> struct.Struct:
        """The fixed binary layout of a reducing state's value (big-endian int64/float64 fields)."""
        return struct.Struct(">" + "".join("q" if f.type is NumberType.INT64 else "d" for f in self.reduce_fields))

    # -- proto --------------------------------------------------------------------------------
    def to_proto(self) -> pb.StateDescriptor:
        msg = pb.StateDescriptor(name=self.name, kind=_KIND_TO_PB[self.kind])
        if self.ttl is not None:
            msg.ttl_ms = self.ttl.ttl_ms
            msg.ttl_update = _TTL_TO_PB[self.ttl.update_type]
        for f in self.reduce_fields:
            msg.reduce_fields.add(name=f.name, function=_FN_TO_PB[f.function], type=_NUM_TO_PB[f.type])
        return msg

    @classmethod
    def from_proto(cls, msg: pb.StateDescriptor) -> StateDescriptor:
        if msg.kind not in _KIND_FROM_PB:
            raise InvalidArgumentError(f"state {msg.name!r}: kind must be VALUE, LIST, MAP or REDUCING")
        ttl = None
        if msg.ttl_ms:
            if msg.ttl_ms < 0:
                raise InvalidArgumentError(f"state {msg.name!r}: TTL must be positive, got {msg.ttl_ms} ms")
            ttl = TtlConfig(msg.ttl_ms, _TTL_FROM_PB.get(msg.ttl_update, TtlUpdateType.ON_CREATE_AND_WRITE))
        fields = []
        for f in msg.reduce_fields:
            if f.function not in _FN_FROM_PB or f.type not in _NUM_FROM_PB:
                raise InvalidArgumentError(
                    f"state {msg.name!r}: reduce field {f.name!r} needs a function (SUM, MIN, MAX) and a type (INT64, FLOAT64)"
                )
            fields.append(ReduceField(f.name, _FN_FROM_PB[f.function], _NUM_FROM_PB[f.type]))
        return cls(msg.name, _KIND_FROM_PB[msg.kind], ttl, tuple(fields))


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
        for s in self.states:
            if s.name == name:
                return s
        raise KeyError(name)

    def to_proto(self) -> pb.OperatorSpec:
        return pb.OperatorSpec(
            operator_id=self.operator_id, parallelism=self.parallelism, states=[s.to_proto() for s in self.states]
        )

    @classmethod
    def from_proto(cls, msg: pb.OperatorSpec) -> OperatorSpec:
        return cls(msg.operator_id, msg.parallelism, tuple(StateDescriptor.from_proto(s) for s in msg.states))


_KIND_TO_PB = {
    StateKind.VALUE: pb.VALUE,
    StateKind.LIST: pb.LIST,
    StateKind.MAP: pb.MAP,
    StateKind.REDUCING: pb.REDUCING,
}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}
_TTL_TO_PB = {
    TtlUpdateType.ON_CREATE_AND_WRITE: pb.ON_CREATE_AND_WRITE,
    TtlUpdateType.ON_READ_AND_WRITE: pb.ON_READ_AND_WRITE,
}
_TTL_FROM_PB = {v: k for k, v in _TTL_TO_PB.items()}
_FN_TO_PB = {ReduceFunction.SUM: pb.SUM, ReduceFunction.MIN: pb.MIN, ReduceFunction.MAX: pb.MAX}
_FN_FROM_PB = {v: k for k, v in _FN_TO_PB.items()}
_NUM_TO_PB = {NumberType.INT64: pb.INT64, NumberType.FLOAT64: pb.FLOAT64}
_NUM_FROM_PB = {v: k for k, v in _NUM_TO_PB.items()}
