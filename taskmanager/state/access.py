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

    def value_get(self, state: str, keys: list[bytes], namespaces: bytes | list[bytes]) -> list[bytes | None]: ...

    def value_put(
        self, state: str, keys: list[bytes], values: list[bytes], namespaces: bytes | list[bytes]
    ) -> None: ...

    def clear(self, state: str, keys: list[bytes], namespaces: bytes | list[bytes]) -> None: ...

    def reduce(
        self, state: str, keys: list[bytes], operands: list[bytes], namespaces: bytes | list[bytes], return_values: bool
    ) -> list[bytes] | None: ...

    def list_append(
        self, state: str, keys: list[bytes], values: list[bytes], namespaces: bytes | list[bytes]
    ) -> None: ...

    def list_get(self, state: str, keys: list[bytes], namespaces: bytes | list[bytes]) -> list[list[bytes]]: ...

    def list_update(
        self, state: str, keys: list[bytes], values: list[bytes], namespaces: bytes | list[bytes]
    ) -> None: ...

    def list_scan(self, state: str, key: bytes, namespace: bytes) -> Iterator[bytes]: ...

    def map_put(
        self,
        state: str,
        keys: list[bytes],
        user_keys: list[bytes],
        values: list[bytes],
        namespaces: bytes | list[bytes],
    ) -> None: ...

    def map_get(
        self, state: str, keys: list[bytes], user_keys: list[bytes], namespaces: bytes | list[bytes]
    ) -> list[bytes | None]: ...

    def map_remove(
        self, state: str, keys: list[bytes], user_keys: list[bytes], namespaces: bytes | list[bytes]
    ) -> None: ...

    def map_contains(
        self, state: str, keys: list[bytes], user_keys: list[bytes], namespaces: bytes | list[bytes]
    ) -> list[bool]: ...

    def map_scan(
        self, state: str, key: bytes, namespace: bytes, keys_only: bool = False
    ) -> Iterator[tuple[bytes, bytes]]: ...

    def scan_keys(self, state: str) -> Iterator[tuple[bytes, bytes]]: ...
