"""The state calls of one slot, as one interface: what the KeyedState servicer serves.

Two implementations, in the spirit of Quix Streams' store > partition > transaction:

* :class:`~keyedstate.taskmanager.state.KeyedStateBackend`: direct calls, applied at once
  (at-least-once writes);
* :class:`~keyedstate.taskmanager.epochs.EpochTransaction`: the calls of one task attempt of an
  epoch, whose writes are staged until the epoch commits and whose reads merge them in.

Both validate a request with the slot's one
:class:`~keyedstate.taskmanager.state.validation.RequestValidator`, so a call is refused the
same way whichever path it takes. ``namespaces`` is one ``bytes`` for every key of a batch or a
list with one per key.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol


class KeyedStateAccess(Protocol):
    """Batched keyed-state calls on one slot: each batch is validated whole, then applied whole."""

    def value_get(self, state: str, keys: list[bytes], namespaces: bytes | list[bytes]) -> list[bytes | None]:
        """The value of each (key, namespace), None where unset; reducing state reads its current vector."""

    def value_put(self, state: str, keys: list[bytes], values: list[bytes], namespaces: bytes | list[bytes]) -> None:
        """Set one value per key (a later duplicate key in the batch wins)."""

    def clear(self, state: str, keys: list[bytes], namespaces: bytes | list[bytes]) -> None:
        """Remove every entry of each (key, namespace): a value, a whole list or a whole map."""

    def reduce(
        self, state: str, keys: list[bytes], operands: list[bytes], namespaces: bytes | list[bytes], return_values: bool
    ) -> list[bytes] | None:
        """Fold each operand into the key's vector, in order; with ``return_values`` answer each new vector."""

    def list_append(self, state: str, keys: list[bytes], values: list[bytes], namespaces: bytes | list[bytes]) -> None:
        """Append one element per key (keys may repeat; order is kept)."""

    def list_get(self, state: str, keys: list[bytes], namespaces: bytes | list[bytes]) -> list[list[bytes]]:
        """Each key's whole list, bounded by ``state.limits.list.max-response-bytes`` (use list_scan beyond)."""

    def list_update(self, state: str, keys: list[bytes], values: list[bytes], namespaces: bytes | list[bytes]) -> None:
        """Replace lists: each distinct (key, namespace) becomes the values given for it, in order."""

    def list_scan(self, state: str, key: bytes, namespace: bytes) -> Iterator[bytes]:
        """Stream one list of any size; the request is validated when called, the elements read lazily."""

    def map_put(
        self,
        state: str,
        keys: list[bytes],
        user_keys: list[bytes],
        values: list[bytes],
        namespaces: bytes | list[bytes],
    ) -> None:
        """Set one map entry (user key -> value) per key."""

    def map_get(
        self, state: str, keys: list[bytes], user_keys: list[bytes], namespaces: bytes | list[bytes]
    ) -> list[bytes | None]:
        """The value of each (key, user key), None where absent."""

    def map_remove(
        self, state: str, keys: list[bytes], user_keys: list[bytes], namespaces: bytes | list[bytes]
    ) -> None:
        """Remove one map entry per key (an absent entry is no error)."""

    def map_contains(
        self, state: str, keys: list[bytes], user_keys: list[bytes], namespaces: bytes | list[bytes]
    ) -> list[bool]:
        """Whether each (key, user key) has an entry."""

    def map_scan(
        self, state: str, key: bytes, namespace: bytes, keys_only: bool = False
    ) -> Iterator[tuple[bytes, bytes]]:
        """(user key, value) of one map sorted by user-key bytes; the value is b"" with ``keys_only``."""

    def scan_keys(self, state: str) -> Iterator[tuple[bytes, bytes]]:
        """Every distinct (key, namespace) of ``state`` holding at least one live entry."""
