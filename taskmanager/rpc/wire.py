"""Protobuf <-> domain conversions of the TaskManager's RPC edge.

Everything below the servicers and the JobManager connection works with domain types
(``common.handles``, ``state.StateLimits``, ``common.batches.Winner``). The checkpoint handles and
winners both daemons exchange are converted in ``common.rpc.convert``; these functions convert
what only the TaskManager reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common._proto.v1 import taskmanager_pb2 as tm_pb
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.rpc.packed import pack, unpack
from keyedstate.taskmanager.slots import SlotTable
from keyedstate.taskmanager.state import StateLimits


def limits_to_proto(limits: StateLimits) -> pb.StateLimits:
    """What the TaskManager reports to the JobManager, which hands it to clients (they check calls first)."""
    return pb.StateLimits(
        max_key_bytes=limits.max_key_bytes,
        max_value_bytes=limits.max_value_bytes,
        max_list_elements=limits.max_list_elements,
    )


def slot_reports(slots: SlotTable) -> list[jm_pb.SlotReport]:
    """The hosted slots as registrations and heartbeats report them."""
    return [
        jm_pb.SlotReport(
            slot_index=s.index,
            job_id=s.subtask.job_id,
            operator_id=s.subtask.operator_id,
            subtask_index=s.subtask.subtask_index,
        )
        for s in slots.all()
    ]


WIRE_VERSION = tm_pb.WIRE_VERSION_COLUMNAR
"""What every KeyedState answer advertises: clients may send this TaskManager packed columns."""

_REPEATED = ("keys", "values", "user_keys", "namespaces")
_LENGTH = np.dtype("<i4")


@dataclass(frozen=True, slots=True)
class KeyedColumns:
    """The columns of a KeyedRequest, whichever wire version carried them."""

    keys: list[bytes]
    values: list[bytes]
    user_keys: list[bytes]
    namespaces: bytes | list[bytes]
    """One namespace for every key, or one per key (their count is checked by the backend's validation)."""
    packed: bool
    """Sent as version 2: answer with packed columns too."""


def keyed_columns(request: tm_pb.KeyedRequest) -> KeyedColumns:
    """The request's columns; InvalidArgumentError naming the field for a malformed or mixed encoding."""
    if not request.HasField("packed_keys"):
        for name in ("packed_values", "packed_user_keys", "packed_namespaces"):
            if request.HasField(name):
                raise InvalidArgumentError(
                    f"{name} without packed_keys; a columnar request (wire version 2) packs its keys too"
                )
        return KeyedColumns(
            list(request.keys),
            list(request.values),
            list(request.user_keys),
            _namespaces(request.namespaces, len(request.keys), request.namespace),
            packed=False,
        )
    mixed = [name for name in _REPEATED if len(getattr(request, name))]
    if mixed:
        raise InvalidArgumentError(
            f"the request carries packed_keys and the repeated field(s) {', '.join(mixed)}; send every column "
            "packed (packed_values, packed_user_keys, packed_namespaces) or every column repeated, not both"
        )
    keys = unpack(request.packed_keys.offsets, request.packed_keys.data, "packed_keys")
    n = len(keys)
    return KeyedColumns(
        keys,
        _unpacked(request.packed_values, "packed_values", n),
        _unpacked(request.packed_user_keys, "packed_user_keys", n),
        _namespaces(_unpacked(request.packed_namespaces, "packed_namespaces", n), n, request.namespace),
        packed=True,
    )


def _unpacked(column: tm_pb.PackedBytes, field: str, n: int) -> list[bytes]:
    """A packed column other than the keys: none (a call that does not use it), or one item per key."""
    items = unpack(column.offsets, column.data, field)
    if items and len(items) != n:
        raise InvalidArgumentError(f"{field}: {len(items)} items for {n} keys in packed_keys; send exactly one per key")
    return items


def _namespaces(per_key: Sequence[bytes], n: int, shared: bytes) -> bytes | list[bytes]:
    if not per_key:
        return shared
    if len(per_key) != n:
        raise InvalidArgumentError(
            f"{len(per_key)} namespaces for {n} keys; send one namespace per key, or none and set `namespace` for all"
        )
    return list(per_key)


def values_response(values: list[bytes | None], packed: bool) -> tm_pb.ValuesResponse:
    """Values read (None: not found) in the request's wire version."""
    if packed:
        offsets, data = pack([v or b"" for v in values])
        return tm_pb.ValuesResponse(
            wire_version=WIRE_VERSION,
            packed_values=tm_pb.PackedBytes(offsets=offsets, data=data),
            found_mask=bytes([v is not None for v in values]),
        )
    return tm_pb.ValuesResponse(
        values=[v or b"" for v in values], found=[v is not None for v in values], wire_version=WIRE_VERSION
    )


def found_response(found: list[bool], packed: bool) -> tm_pb.ValuesResponse:
    """MapContains's answer in the request's wire version."""
    if packed:
        return tm_pb.ValuesResponse(wire_version=WIRE_VERSION, found_mask=bytes(found))
    return tm_pb.ValuesResponse(found=found, wire_version=WIRE_VERSION)


def reduced_response(values: list[bytes] | None, packed: bool) -> tm_pb.ValuesResponse:
    """Reduce's answer: the new vectors when asked for (every one found), else nothing but the version."""
    if not values:
        return tm_pb.ValuesResponse(wire_version=WIRE_VERSION)
    if packed:
        offsets, data = pack(values)
        return tm_pb.ValuesResponse(
            wire_version=WIRE_VERSION,
            packed_values=tm_pb.PackedBytes(offsets=offsets, data=data),
            found_mask=b"\x01" * len(values),
        )
    return tm_pb.ValuesResponse(values=values, found=[True] * len(values), wire_version=WIRE_VERSION)


def write_response(applied: int) -> tm_pb.WriteResponse:
    return tm_pb.WriteResponse(applied=applied, wire_version=WIRE_VERSION)


def lists_response(lists: list[list[bytes]], packed: bool) -> tm_pb.ListsResponse:
    """ListGet's answer in the request's wire version (packed: one column of every element, and the lengths)."""
    if packed:
        offsets, data = pack([e for elements in lists for e in elements])
        return tm_pb.ListsResponse(
            wire_version=WIRE_VERSION,
            packed_elements=tm_pb.PackedBytes(offsets=offsets, data=data),
            list_lengths=np.fromiter(map(len, lists), dtype=_LENGTH, count=len(lists)).tobytes(),
        )
    return tm_pb.ListsResponse(lists=[tm_pb.ListValue(elements=e) for e in lists], wire_version=WIRE_VERSION)
