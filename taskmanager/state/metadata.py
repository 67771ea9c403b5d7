"""Reserved names of the state layer: the metadata column family, its keys, snapshot file names.

State names must start with a letter (``StateDescriptor`` checks it), so names starting with
``_`` can never clash with a user's state.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from keyedstate.common.descriptors import (
    NumberType,
    ReduceField,
    ReduceFunction,
    StateDescriptor,
    StateKind,
    TtlConfig,
    TtlUpdateType,
)
from keyedstate.common.errors import KeyedStateError, Reason

logger = logging.getLogger(__name__)

META_CF = "_meta"
"""Column family (RocksDB) / table (HashMap) for slot metadata."""

DEFAULT_CF = "default"
"""RocksDB's own column family; unused, but it always exists."""

INTERNAL_META_PREFIX = b"\x00"
"""Meta keys the backend owns start with this byte; callers' keys must not."""

META_LAYOUT = b"\x00layout-version"
META_MAX_PARALLELISM = b"\x00max-parallelism"
META_KEY_GROUPS = b"\x00key-groups"
META_STATES = b"\x00states"

COMMITTED_EPOCH = b"committed-epoch"
"""Meta key of the last committed epoch of a slot (written with ``apply(..., meta=...)``)."""

SNAPSHOT_MANIFEST = "_snapshot.json"
"""Written last into every local snapshot directory; a directory without it is incomplete."""

SNAPSHOT_FORMAT_VERSION = 1
HASHMAP_STATE_FILE = "state-{name}.kvs"
HASHMAP_META_FILE = "meta.kvs"


def descriptor_to_json(descriptor: StateDescriptor) -> dict[str, Any]:
    out: dict[str, Any] = {"name": descriptor.name, "kind": descriptor.kind.value}
    if descriptor.ttl is not None:
        out["ttl_ms"] = descriptor.ttl.ttl_ms
        out["ttl_update"] = descriptor.ttl.update_type.value
    if descriptor.reduce_fields:
        out["reduce_fields"] = [
            {"name": f.name, "function": f.function.value, "type": f.type.value} for f in descriptor.reduce_fields
        ]
    return out


def descriptor_from_json(data: dict[str, Any]) -> StateDescriptor:
    try:
        ttl = None
        if data.get("ttl_ms"):
            ttl = TtlConfig(
                int(data["ttl_ms"]), TtlUpdateType(data.get("ttl_update", TtlUpdateType.ON_CREATE_AND_WRITE.value))
            )
        fields = tuple(
            ReduceField(f["name"], ReduceFunction(f["function"]), NumberType(f["type"]))
            for f in data.get("reduce_fields", ())
        )
        return StateDescriptor(data["name"], StateKind(data["kind"]), ttl, fields)
    except (KeyError, ValueError, TypeError) as exc:
        raise KeyedStateError(
            f"malformed state descriptor {data!r} in slot metadata: {exc}", reason=Reason.INTERNAL
        ) from exc


def encode_states(descriptors: list[StateDescriptor]) -> bytes:
    return json.dumps([descriptor_to_json(d) for d in descriptors], sort_keys=True).encode()


def decode_states(data: bytes) -> list[StateDescriptor]:
    return [descriptor_from_json(d) for d in json.loads(data)]
