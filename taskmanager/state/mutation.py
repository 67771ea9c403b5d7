"""Logical mutations: what :meth:`KeyedStateBackend.apply` writes atomically (epoch commits)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class MutationKind(enum.Enum):
    VALUE_PUT = "VALUE_PUT"
    CLEAR = "CLEAR"
    """Removes every entry of (key, namespace): a value, a whole list or a whole map."""
    REDUCE = "REDUCE"
    LIST_APPEND = "LIST_APPEND"
    """Appends ``values`` in order."""
    LIST_REPLACE = "LIST_REPLACE"
    """The list becomes ``values`` (empty ``values`` clears it)."""
    MAP_PUT = "MAP_PUT"
    MAP_REMOVE = "MAP_REMOVE"


@dataclass(frozen=True)
class Mutation:
    """One logical write; ``value`` for VALUE_PUT/REDUCE/MAP_PUT, ``values`` for the list kinds."""

    kind: MutationKind
    state: str
    key: bytes
    namespace: bytes
    user_key: bytes = b""
    value: bytes = b""
    values: tuple[bytes, ...] = ()
