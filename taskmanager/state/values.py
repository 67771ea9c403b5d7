"""Stored values: a one-byte format header, an optional TTL timestamp, then the user's bytes.

``0x00 | payload``                    a value without TTL timestamp
``0x01 | ts (8 bytes, big-endian) | payload``   ``ts`` is the last write (or read, with
                                      ON_READ_AND_WRITE) in processing-time milliseconds

Both formats are readable by every state, so enabling or disabling TTL on restore keeps the
data: a value without timestamp never expires, and a timestamp is ignored when the state has no
TTL any more. Expiry follows Flink: a value is expired when ``ts + ttl <= now``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from keyedstate.common.descriptors import StateDescriptor, TtlUpdateType
from keyedstate.common.errors import KeyedStateError, Reason

logger = logging.getLogger(__name__)

PLAIN = 0
WITH_TTL = 1
PLAIN_HEADER = b"\x00"
TTL_HEADER_LEN = 9


def ttl_header(now_ms: int) -> bytes:
    return b"\x01" + now_ms.to_bytes(8, "big")


def _corrupt(stored: bytes) -> KeyedStateError:
    return KeyedStateError(
        f"stored value has unknown format byte {stored[:1]!r}; the state data is corrupt or from a newer version",
        reason=Reason.INTERNAL,
    )


def timestamp_of(stored: bytes) -> int | None:
    """The TTL timestamp of a stored value, or None for the plain format."""
    fmt = stored[0]
    if fmt == PLAIN:
        return None
    if fmt == WITH_TTL:
        return int.from_bytes(stored[1:TTL_HEADER_LEN], "big")
    raise _corrupt(stored)


def payload_of(stored: bytes) -> bytes:
    """The user's bytes of a stored value, ignoring any timestamp."""
    fmt = stored[0]
    if fmt == PLAIN:
        return stored[1:]
    if fmt == WITH_TTL:
        return stored[TTL_HEADER_LEN:]
    raise _corrupt(stored)


@dataclass(frozen=True)
class ValueCodec:
    """Encodes and decodes the stored values of one state, applying its TTL."""

    ttl_ms: int | None
    update_on_read: bool

    @classmethod
    def for_descriptor(cls, descriptor: StateDescriptor) -> ValueCodec:
        """The codec of a state: with its TTL if it declares one, refreshing timestamps on reads for ON_READ_AND_WRITE."""
        ttl = descriptor.ttl
        if ttl is None:
            return cls(None, False)
        return cls(ttl.ttl_ms, ttl.update_type is TtlUpdateType.ON_READ_AND_WRITE)

    @property
    def has_ttl(self) -> bool:
        """True when the state's values carry a timestamp and may expire (what a TTL sweep looks at)."""
        return self.ttl_ms is not None

    def header(self, now_ms: int) -> bytes:
        """The header to put in front of every payload written at ``now_ms``."""
        return PLAIN_HEADER if self.ttl_ms is None else ttl_header(now_ms)

    def encode_many(self, payloads: Iterable[bytes], now_ms: int) -> list[bytes]:
        """Prefix every payload with the header for ``now_ms`` (a timestamp when the state has a TTL)."""
        header = self.header(now_ms)
        return [header + p for p in payloads]

    def is_expired(self, stored: bytes, now_ms: int) -> bool:
        """True when the stored value has a timestamp older than the TTL at ``now_ms``; raises on a corrupt header."""
        if self.ttl_ms is None or stored[0] != WITH_TTL:
            if stored[0] > WITH_TTL:
                raise _corrupt(stored)
            return False
        return int.from_bytes(stored[1:TTL_HEADER_LEN], "big") + self.ttl_ms <= now_ms

    def decode(self, stored: bytes | None, now_ms: int) -> bytes | None:
        """The payload, or None when absent or expired."""
        if stored is None:
            return None
        fmt = stored[0]
        if fmt == PLAIN:
            return stored[1:]
        if fmt != WITH_TTL:
            raise _corrupt(stored)
        if self.ttl_ms is not None and int.from_bytes(stored[1:TTL_HEADER_LEN], "big") + self.ttl_ms <= now_ms:
            return None
        return stored[TTL_HEADER_LEN:]

    def decode_many(self, stored: list[bytes | None], now_ms: int) -> list[bytes | None]:
        """The payloads of ``stored`` in order, None for absent or expired ones (see :meth:`decode`)."""
        if self.ttl_ms is None:
            # Hot path: plain values only need the header byte dropped.
            return [None if s is None else (s[1:] if s[0] == PLAIN else payload_of(s)) for s in stored]
        decode = self.decode
        return [decode(s, now_ms) for s in stored]

    def refreshed(self, stored: bytes, now_ms: int) -> bytes:
        """The same payload with its timestamp moved to ``now_ms`` (ON_READ_AND_WRITE reads)."""
        return ttl_header(now_ms) + payload_of(stored)
