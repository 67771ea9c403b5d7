"""The changelog segment format: committed epochs' change sets, one checksummed record each.

A segment file is::

    MAGIC (4) | format version (2) | records...

and each record is::

    payload length (4) | crc32 of the payload (4) | payload

with the payload::

    epoch (8) | commit timestamp ms (8) | mutation count (4) | mutations...

and each mutation ``kind code (1) | state | key | namespace | user key | value | element count (4) |
elements``, every variable field a 4-byte length then its bytes. All integers are big-endian.

The encoding is written out field by field (not pickled or marshalled) because segments outlive
the process and the Python version that wrote them. The commit timestamp is the wall-clock time
the epoch was applied with, so a replay stamps TTL entries exactly as the original commit did.
"""

from __future__ import annotations

import logging
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from keyedstate.common.errors import CorruptCheckpointError
from keyedstate.taskmanager.state.mutation import Mutation, MutationKind

logger = logging.getLogger(__name__)

MAGIC = b"KSCL"
FORMAT_VERSION = 1
HEADER = MAGIC + FORMAT_VERSION.to_bytes(2, "big")
_RECORD_HEAD = struct.Struct(">II")
_PAYLOAD_HEAD = struct.Struct(">QQI")
_U32 = struct.Struct(">I")
MAX_RECORD_BYTES = 1 << 31
"""A record longer than this is a torn or corrupt length field, not a real change set."""

_KIND_CODES: dict[MutationKind, int] = {kind: i for i, kind in enumerate(MutationKind)}
_CODE_KINDS: dict[int, MutationKind] = {i: kind for kind, i in _KIND_CODES.items()}


@dataclass(frozen=True)
class ChangeSet:
    """One committed epoch of one slot: its mutations and the wall-clock time they were applied at."""

    epoch: int
    timestamp_ms: int
    mutations: tuple[Mutation, ...]


def encode_record(change_set: ChangeSet) -> bytes:
    """The framed, checksummed record of one change set."""
    parts = [_PAYLOAD_HEAD.pack(change_set.epoch, change_set.timestamp_ms, len(change_set.mutations))]
    pack = _U32.pack
    for m in change_set.mutations:
        state = m.state.encode("utf-8")
        parts += [
            bytes((_KIND_CODES[m.kind],)),
            pack(len(state)),
            state,
            pack(len(m.key)),
            m.key,
            pack(len(m.namespace)),
            m.namespace,
            pack(len(m.user_key)),
            m.user_key,
            pack(len(m.value)),
            m.value,
            pack(len(m.values)),
        ]
        for element in m.values:
            parts += [pack(len(element)), element]
    payload = b"".join(parts)
    return _RECORD_HEAD.pack(len(payload), zlib.crc32(payload)) + payload


def encode_segment(change_sets: Sequence[ChangeSet]) -> bytes:
    """A whole segment (header and records); used by tests and by tools writing segments at once."""
    return HEADER + b"".join(encode_record(cs) for cs in change_sets)


class _Reader:
    __slots__ = ("data", "name", "pos")

    def __init__(self, data: memoryview, name: str) -> None:
        self.data = data
        self.name = name
        self.pos = 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise _corrupt(self.name, "a change set record ends inside a field")
        out = bytes(self.data[self.pos : end])
        self.pos = end
        return out

    def u32(self) -> int:
        value: int = _U32.unpack_from(self.data, self.pos)[0] if self.pos + 4 <= len(self.data) else -1
        if value < 0:
            raise _corrupt(self.name, "a change set record ends inside a length field")
        self.pos += 4
        return value

    def field(self) -> bytes:
        return self.take(self.u32())


def _decode_payload(payload: memoryview, name: str) -> ChangeSet:
    if len(payload) < _PAYLOAD_HEAD.size:
        raise _corrupt(name, "a change set record is shorter than its header")
    epoch, timestamp_ms, count = _PAYLOAD_HEAD.unpack_from(payload, 0)
    r = _Reader(payload, name)
    r.pos = _PAYLOAD_HEAD.size
    mutations = []
    for _ in range(count):
        code = r.take(1)[0]
        kind = _CODE_KINDS.get(code)
        if kind is None:
            raise _corrupt(name, f"unknown mutation kind code {code} in epoch {epoch}")
        try:
            state = r.field().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _corrupt(name, f"a state name in epoch {epoch} is not UTF-8") from exc
        key, namespace, user_key, value = r.field(), r.field(), r.field(), r.field()
        values = tuple(r.field() for _ in range(r.u32()))
        mutations.append(Mutation(kind, state, key, namespace, user_key=user_key, value=value, values=values))
    if r.pos != len(payload):
        raise _corrupt(name, f"{len(payload) - r.pos} stray bytes after the mutations of epoch {epoch}")
    return ChangeSet(epoch, timestamp_ms, tuple(mutations))


def read_segment(data: bytes, name: str, *, torn_tail_ok: bool = False) -> Iterator[ChangeSet]:
    """The change sets of a segment, in the order they were written.

    A bad header, a checksum mismatch or a malformed record raises
    :class:`~keyedstate.common.errors.CorruptCheckpointError` naming ``name``. A record cut off
    at the end of the data is corrupt too, unless ``torn_tail_ok``: a local segment read back
    after a crash may end in a record whose write never completed, and such an epoch was never
    applied (a change set is durable before its epoch is applied), so it is dropped.
    """
    if data[: len(MAGIC)] != MAGIC:
        raise _corrupt(name, "it does not start with the changelog segment magic")
    if len(data) < len(HEADER):
        raise _corrupt(name, "its header is truncated")
    version = int.from_bytes(data[len(MAGIC) : len(HEADER)], "big")
    if version != FORMAT_VERSION:
        raise _corrupt(
            name,
            f"it has segment format version {version}, this runtime reads version {FORMAT_VERSION}; "
            "restore it with the runtime version that wrote it",
        )
    view = memoryview(data)
    pos = len(HEADER)
    end = len(data)
    while pos < end:
        if pos + _RECORD_HEAD.size > end:
            if torn_tail_ok:
                logger.warning("dropping a torn change set record at offset %d of %s", pos, name)
                return
            raise _corrupt(name, f"a record header at offset {pos} is truncated")
        length, crc = _RECORD_HEAD.unpack_from(view, pos)
        start = pos + _RECORD_HEAD.size
        if length > MAX_RECORD_BYTES or start + length > end:
            if torn_tail_ok and length <= MAX_RECORD_BYTES:
                logger.warning("dropping a torn change set record at offset %d of %s", pos, name)
                return
            raise _corrupt(name, f"the record at offset {pos} claims {length} bytes, {end - start} remain")
        payload = view[start : start + length]
        if zlib.crc32(payload) != crc:
            raise _corrupt(name, f"the record at offset {pos} fails its checksum")
        yield _decode_payload(payload, name)
        pos = start + length


def _corrupt(name: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"changelog segment {name} is corrupt: {what}. Restore from an older checkpoint that does not reference it"
    )
