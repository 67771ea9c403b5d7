"""Stored entries as columns: keys and values decoded through the serializers the job wrote them with.

A checkpoint records each state's kind, TTL and reduce fields, not the serializers (they live in
the job's code), so the reader is told them, as a :class:`StateSerializers`. The columns of a
state's table:

============  =====================================================================================
key_group     int32: the key group (xxhash64 of the key's bytes modulo the max parallelism)
key           the key, through ``key``
namespace     binary: the namespace the client wrote under (empty by default)
index         list state: int64, the element's position within the key's list
user_key      map state: the user key, through ``user_key``
value         value, list and map state: the value, through ``value``
<field>       reducing state: one int64/float64 column per reduce field
timestamp_ms  states with TTL: int64, the value's last write (null when it carries none)
============  =====================================================================================
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from keyedstate.common.descriptors import NumberType, StateDescriptor, StateKind
from keyedstate.common.errors import CorruptCheckpointError, InvalidArgumentError, KeyedStateError
from keyedstate.common.serializers import get_serializer
from keyedstate.state_processor.savepoint import RawEntry
from keyedstate.taskmanager.state import values

logger = logging.getLogger(__name__)

_ARROW_TYPES: dict[str, pa.DataType] = {
    "str": pa.string(),
    "int": pa.int64(),
    "float": pa.float64(),
    "bytes": pa.binary(),
}
"""Arrow types of the registered serializers with a fixed Python type; the others are inferred."""


@dataclass(frozen=True)
class StateSerializers:
    """The serializers a state was written with: names (``str``, ``int``, ``json``, ...) or custom objects."""

    key: Any = "bytes"
    value: Any = "bytes"
    user_key: Any = "bytes"
    """Map state only."""


def arrow_type(serializer: Any) -> pa.DataType | None:
    """The Arrow type of what ``serializer`` decodes to, or None when it must be inferred from the data."""
    return _ARROW_TYPES.get(get_serializer(serializer).name)


def columns(
    descriptor: StateDescriptor, entries: Iterable[RawEntry], serializers: StateSerializers, now_ms: int | None
) -> dict[str, list[Any]]:
    """The state's rows as Python columns; entries expired at ``now_ms`` are left out (None: keep all)."""
    kind = descriptor.kind
    _refuse_timers(descriptor)
    codec = values.ValueCodec.for_descriptor(descriptor)
    key_groups: list[int] = []
    keys: list[bytes] = []
    namespaces: list[bytes] = []
    suffixes: list[bytes] = []
    payloads: list[bytes] = []
    stamps: list[int | None] = []
    for e in entries:
        try:
            if now_ms is not None and codec.is_expired(e.stored_value, now_ms):
                continue
            payload, stamp = values.payload_of(e.stored_value), values.timestamp_of(e.stored_value)
        except (KeyedStateError, IndexError) as exc:
            raise CorruptCheckpointError(
                f"state {descriptor.name!r} holds a malformed value under key {e.key[:40]!r}: {exc}"
            ) from exc
        key_groups.append(e.key_group)
        keys.append(e.key)
        namespaces.append(e.namespace)
        suffixes.append(e.suffix)
        payloads.append(payload)
        stamps.append(stamp)
    out: dict[str, list[Any]] = {
        "key_group": key_groups,
        "key": _decode(serializers.key, keys, descriptor.name, "key"),
        "namespace": namespaces,
    }
    if kind is StateKind.LIST:
        out["index"] = _positions(keys, namespaces)
        out["value"] = _decode(serializers.value, payloads, descriptor.name, "value")
    elif kind is StateKind.MAP:
        out["user_key"] = _decode(serializers.user_key, suffixes, descriptor.name, "user key")
        out["value"] = _decode(serializers.value, payloads, descriptor.name, "value")
    elif kind is StateKind.REDUCING:
        fmt = descriptor.vector_format
        try:
            vectors = [fmt.unpack(p) for p in payloads]
        except Exception as exc:
            raise CorruptCheckpointError(
                f"reducing state {descriptor.name!r} holds a vector that is not {fmt.size} bytes: {exc}"
            ) from exc
        for i, f in enumerate(descriptor.reduce_fields):
            out[f.name] = [v[i] for v in vectors]
    else:
        out["value"] = _decode(serializers.value, payloads, descriptor.name, "value")
    if descriptor.ttl is not None:
        out["timestamp_ms"] = stamps
    return out


def _refuse_timers(descriptor: StateDescriptor) -> None:
    if descriptor.kind is StateKind.TIMERS:
        raise InvalidArgumentError(
            f"state {descriptor.name!r} holds timers, which the State Processor API does not read or write as tables; "
            "leave it out (transform() carries it over unchanged)"
        )


def schema(descriptor: StateDescriptor, serializers: StateSerializers) -> list[tuple[str, pa.DataType | None]]:
    """Column names and Arrow types (None: inferred) of a state's table, in order."""
    _refuse_timers(descriptor)
    cols: list[tuple[str, pa.DataType | None]] = [
        ("key_group", pa.int32()),
        ("key", arrow_type(serializers.key)),
        ("namespace", pa.binary()),
    ]
    if descriptor.kind is StateKind.LIST:
        cols += [("index", pa.int64()), ("value", arrow_type(serializers.value))]
    elif descriptor.kind is StateKind.MAP:
        cols += [("user_key", arrow_type(serializers.user_key)), ("value", arrow_type(serializers.value))]
    elif descriptor.kind is StateKind.REDUCING:
        cols += [(f.name, pa.int64() if f.type is NumberType.INT64 else pa.float64()) for f in descriptor.reduce_fields]
    else:
        cols.append(("value", arrow_type(serializers.value)))
    if descriptor.ttl is not None:
        cols.append(("timestamp_ms", pa.int64()))
    return cols


def to_arrow(descriptor: StateDescriptor, cols: dict[str, list[Any]], serializers: StateSerializers) -> pa.Table:
    """The columns as an Arrow table; a value Arrow cannot hold is an InvalidArgumentError naming the fix."""
    arrays = []
    names = []
    for name, typ in schema(descriptor, serializers):
        try:
            arrays.append(pa.array(cols[name], type=typ))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(
                f"column {name!r} of state {descriptor.name!r} cannot be an Arrow column ({exc}); read it as "
                "pandas (to_pandas keeps Python objects) or with the bytes serializer"
            ) from exc
        names.append(name)
    return pa.Table.from_arrays(arrays, names=names)


def _positions(keys: list[bytes], namespaces: list[bytes]) -> list[int]:
    """Each list element's position in its (key, namespace): entries arrive in sequence order per key."""
    out: list[int] = []
    previous: tuple[bytes, bytes] | None = None
    n = 0
    for k, ns in zip(keys, namespaces):
        n = n + 1 if (k, ns) == previous else 0
        previous = (k, ns)
        out.append(n)
    return out


def _decode(serializer: Any, data: list[bytes], state: str, what: str) -> list[Any]:
    ser = get_serializer(serializer)
    try:
        decoded: list[Any] = ser.loads_many(data)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(
            f"the {what}s of state {state!r} do not decode with the {ser.name} serializer ({exc.message}); pass the "
            f"serializer the job wrote them with"
        ) from exc
    return decoded
