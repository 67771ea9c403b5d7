"""State descriptors on the wire: the conversions between the domain's declarations
(:mod:`keyedstate.common.descriptors`) and their protobuf messages.

Here, at the RPC edge, so that the descriptors every layer passes around carry no generated code;
the client, the servicers and the checkpoint format call these when they build or read a message.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common.descriptors import (
    NumberType,
    OperatorSpec,
    ReduceField,
    ReduceFunction,
    StateDescriptor,
    StateKind,
    TtlConfig,
    TtlUpdateType,
)
from keyedstate.common.errors import InvalidArgumentError


def state_descriptor_to_proto(descriptor: StateDescriptor) -> pb.StateDescriptor:
    msg = pb.StateDescriptor(name=descriptor.name, kind=_KIND_TO_PB[descriptor.kind])
    if descriptor.ttl is not None:
        msg.ttl_ms = descriptor.ttl.ttl_ms
        msg.ttl_update = _TTL_TO_PB[descriptor.ttl.update_type]
    for f in descriptor.reduce_fields:
        msg.reduce_fields.add(name=f.name, function=_FN_TO_PB[f.function], type=_NUM_TO_PB[f.type])
    return msg


def state_descriptor_from_proto(msg: pb.StateDescriptor) -> StateDescriptor:
    """The declaration a message carries; a message no valid declaration produces is INVALID_ARGUMENT."""
    if msg.kind not in _KIND_FROM_PB:
        raise InvalidArgumentError(f"state {msg.name!r}: kind must be VALUE, LIST, MAP, REDUCING or TIMERS")
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
    return StateDescriptor(msg.name, _KIND_FROM_PB[msg.kind], ttl, tuple(fields))


def operator_spec_to_proto(spec: OperatorSpec) -> pb.OperatorSpec:
    return pb.OperatorSpec(
        operator_id=spec.operator_id,
        parallelism=spec.parallelism,
        states=[state_descriptor_to_proto(s) for s in spec.states],
    )


def operator_spec_from_proto(msg: pb.OperatorSpec) -> OperatorSpec:
    """The operator a message declares, validated as :class:`OperatorSpec` validates any."""
    return OperatorSpec(msg.operator_id, msg.parallelism, tuple(state_descriptor_from_proto(s) for s in msg.states))


def operator_spec_to_json(spec: OperatorSpec) -> dict[str, Any]:
    """The operator as protobuf JSON: how high-availability job records store a job's operators."""
    return json_format.MessageToDict(operator_spec_to_proto(spec))


def operator_spec_from_json(data: dict[str, Any]) -> OperatorSpec:
    """The inverse of :func:`operator_spec_to_json` (any protobuf JSON of an ``OperatorSpec``)."""
    return operator_spec_from_proto(json_format.ParseDict(data, pb.OperatorSpec()))


_KIND_TO_PB = {
    StateKind.VALUE: pb.VALUE,
    StateKind.LIST: pb.LIST,
    StateKind.MAP: pb.MAP,
    StateKind.REDUCING: pb.REDUCING,
    StateKind.TIMERS: pb.TIMERS,
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
