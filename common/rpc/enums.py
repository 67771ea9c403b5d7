"""The wire's status and outcome enums as the plain names people read (RUNNING, COMPLETED, ...).

The proto enums carry a per-enum prefix (``JOB_STATUS_RUNNING``), as proto3 style asks, and an
``*_UNSPECIFIED`` zero. statectl, logs and error messages print the bare name, as they did when
these fields were strings; an unset value reads as "".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message

if TYPE_CHECKING:
    from google.protobuf.internal.enum_type_wrapper import _EnumTypeWrapper

_V = TypeVar("_V", bound=int)


def _prefix(wrapper: _EnumTypeWrapper[Any]) -> str:
    return wrapper.Name(0).removesuffix("UNSPECIFIED")


def name_of(wrapper: _EnumTypeWrapper[Any], number: int) -> str:
    """``name_of(jm_pb.CheckpointStatus, CHECKPOINT_STATUS_COMPLETED)`` is "COMPLETED"; 0 (unspecified) is ""."""
    if number == 0:
        return ""
    return wrapper.Name(number).removeprefix(_prefix(wrapper))


def value_of(wrapper: _EnumTypeWrapper[_V], name: str) -> _V:
    """The inverse of :func:`name_of`: "COMPLETED" -> CHECKPOINT_STATUS_COMPLETED, "" -> 0."""
    if not name:
        return wrapper.Value(wrapper.Name(0))  # type: ignore[arg-type]  # 0 is every proto3 enum's first value
    return wrapper.Value(_prefix(wrapper) + name)


_PLAIN_ENUMS = frozenset(
    {
        "keyedstate.v1.JobStatus",
        "keyedstate.v1.TaskManagerStatus",
        "keyedstate.v1.CheckpointStatus",
        "keyedstate.v1.AckOutcome",
        "keyedstate.v1.DeclineReason",
    }
)


def message_to_dict(message: Message) -> dict[str, Any]:
    """``json_format.MessageToDict`` (field names as in the .proto, defaults shown), statuses as bare names.

    What statectl's --json prints: a status reads "RUNNING" as it did when it was a string field.
    """
    out = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _plain(message, out)
    return out


def _plain(message: Message, out: dict[str, Any]) -> None:
    for field in message.DESCRIPTOR.fields:
        if field.name not in out:
            continue
        value = getattr(message, field.name)
        repeated = field.is_repeated
        if field.enum_type is not None and field.enum_type.full_name in _PLAIN_ENUMS:
            prefix = field.enum_type.values_by_number[0].name.removesuffix("UNSPECIFIED")

            def bare(number: int, prefix: str = prefix, enum: Any = field.enum_type) -> str:
                return "" if number == 0 else enum.values_by_number[number].name.removeprefix(prefix)

            out[field.name] = [bare(v) for v in value] if repeated else bare(value)
        elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
            if repeated:
                for item, item_out in zip(value, out[field.name]):
                    _plain(item, item_out)
            else:
                _plain(value, out[field.name])
