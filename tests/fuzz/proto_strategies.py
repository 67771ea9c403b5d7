"""Hypothesis strategies that build any protobuf message from its descriptor, and raw-byte mutations.

Nothing here knows the keyedstate protocol: a message type added to the .proto files is
generated the same way. Values lean on the edges (extreme integers, empty and huge strings and
bytes, separators and control characters, enum numbers nobody declared), because those are what
a validation misses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from google.protobuf import descriptor as d
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

FD = d.FieldDescriptor

INT32_EDGES = [0, 1, -1, 2, 7, 127, 128, 255, 32767, 65535, 2**31 - 1, -(2**31), 2**31 - 2]
INT64_EDGES = [*INT32_EDGES, 2**32, 2**53 + 1, 2**62, 2**63 - 1, -(2**63), -(2**63) + 1]

# Strings an id, a name or a path check must refuse, plus a few that look like real ones.
HOSTILE_TEXT = [
    "",
    " ",
    ".",
    "..",
    "../..",
    "../../etc/passwd",
    "a/b",
    "/abs",
    "a\\b",
    "a\x00b",
    "\x00",
    "\n",
    "\r\n",
    "a..b",
    "-a",
    "_meta",
    "default",
    "chk-1",
    "shared",
    "taskowned",
    "_metadata",
    "%2e%2e",
    "ünïcødé",
    "\u202e",
    "\U0001f600",
    "x" * 129,
    "x" * 4096,
    "file:///",
    "s3://b/../x",
    "NaN",
    "-1",
    "9" * 40,
]

# A name made of the characters an id allows, so structure survives to the deeper checks.
NAMEISH = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABC0123456789_.-", min_size=1, max_size=12)

HUGE_SIZES = [64 << 10, 1 << 20]
MAX_RAW_BYTES = 4 << 20
"""Raw bodies stay below this: building larger ones in the test process starves the in-process daemons."""


def int_strategy(bits: int, signed: bool) -> st.SearchStrategy[int]:
    if signed:
        lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        edges = INT64_EDGES if bits == 64 else INT32_EDGES
    else:
        lo, hi = 0, 2**bits - 1
        edges = [0, 1, 2, 255, 2**31, 2**32 - 1] + ([2**63, 2**64 - 1] if bits == 64 else [])
    edges = [v for v in edges if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(-3, 300).filter(lambda v: lo <= v <= hi), st.integers(lo, hi))


def text_strategy(huge: bool = True) -> st.SearchStrategy[str]:
    # Surrogates cannot be set on a protobuf string (the client refuses them); invalid UTF-8 on the
    # wire comes from the raw-bytes mutations instead.
    plain = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
    options = [plain, plain, NAMEISH, st.sampled_from(HOSTILE_TEXT)]
    if huge:
        options.append(st.sampled_from(HUGE_SIZES).map(lambda n: "y" * n))
    return st.one_of(*options)


def bytes_strategy(huge: bool = True) -> st.SearchStrategy[bytes]:
    options = [st.binary(max_size=40), st.binary(max_size=40), st.sampled_from([b"", b"\x00", b"\xff" * 8])]
    if huge:
        options.append(st.sampled_from(HUGE_SIZES).map(lambda n: b"\xff" * n))
    return st.one_of(*options)


def scalar_strategy(field: d.FieldDescriptor, huge: bool = True) -> st.SearchStrategy[Any]:
    """Values of a scalar field; ``huge=False`` leaves out the 64 KiB and 1 MiB strings and bytes."""
    t = field.type
    if t in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32):
        return int_strategy(32, True)
    if t in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return int_strategy(64, True)
    if t in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        return int_strategy(32, False)
    if t in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        return int_strategy(64, False)
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t == FD.TYPE_FLOAT:
        return st.floats(width=32)
    if t == FD.TYPE_DOUBLE:
        return st.floats()
    if t == FD.TYPE_STRING:
        return text_strategy(huge)
    if t == FD.TYPE_BYTES:
        return bytes_strategy(huge)
    if t == FD.TYPE_ENUM:
        assert field.enum_type is not None, field.full_name
        declared = [v.number for v in field.enum_type.values]
        # proto3 enums are open: an undeclared number travels and must be refused by the server.
        return st.one_of(st.sampled_from(declared), int_strategy(32, True))
    raise TypeError(f"no strategy for field type {t} of {field.full_name}")


def message_type(field: d.FieldDescriptor) -> d.Descriptor:
    """A message field's type (types-protobuf types it optional: a scalar field has none)."""
    assert field.message_type is not None, field.full_name
    return field.message_type


def _is_map(field: d.FieldDescriptor) -> bool:
    return field.type == FD.TYPE_MESSAGE and message_type(field).GetOptions().map_entry


def _repeated(field: d.FieldDescriptor) -> bool:
    return bool(field.is_repeated)


FieldOverride = Callable[[d.FieldDescriptor], "st.SearchStrategy[Any] | None"]


def message_strategy(
    descriptor: d.Descriptor,
    *,
    max_depth: int = 4,
    max_items: int = 6,
    override: FieldOverride | None = None,
    huge: bool = True,
) -> st.SearchStrategy[Message]:
    """Any message of ``descriptor``'s type: each field absent or set, nested messages to ``max_depth``.

    ``override(field)`` may return a strategy for a field's (scalar or element) value, used instead
    of the generic one (the fuzz tests keep addresses on loopback and paths in a sandbox with it).
    """
    cls = GetMessageClass(descriptor)

    def field_value(field: d.FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
        if override is not None:
            chosen = override(field)
            if chosen is not None:
                return chosen
        if field.type == FD.TYPE_MESSAGE:
            return build(message_type(field), depth + 1)
        return scalar_strategy(field, huge)

    def build(desc: d.Descriptor, depth: int) -> st.SearchStrategy[Message]:
        @st.composite
        def make(draw: st.DrawFn) -> Message:
            msg = GetMessageClass(desc)()
            for field in desc.fields:
                if not draw(st.booleans()):
                    continue
                if _is_map(field):
                    if depth >= max_depth:
                        continue
                    key_f, value_f = (
                        message_type(field).fields_by_name["key"],
                        message_type(field).fields_by_name["value"],
                    )
                    entries = draw(
                        st.dictionaries(field_value(key_f, depth), field_value(value_f, depth), max_size=max_items)
                    )
                    target = getattr(msg, field.name)
                    for k, v in entries.items():
                        if value_f.type == FD.TYPE_MESSAGE:
                            target[k].CopyFrom(v)
                        else:
                            target[k] = v
                elif _repeated(field):
                    if field.type == FD.TYPE_MESSAGE and depth >= max_depth:
                        continue
                    values = draw(st.lists(field_value(field, depth), max_size=max_items))
                    getattr(msg, field.name).extend(values)
                elif field.type == FD.TYPE_MESSAGE:
                    if depth >= max_depth:
                        continue
                    getattr(msg, field.name).CopyFrom(draw(field_value(field, depth)))
                else:
                    setattr(msg, field.name, draw(field_value(field, depth)))
            return msg

        return make()

    return build(cast(d.Descriptor, cls.DESCRIPTOR), 0)


# -- raw bytes ------------------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def invalid_utf8_string_field(descriptor: d.Descriptor) -> bytes | None:
    """A wire-format message whose first string field holds bytes that are not UTF-8."""
    for field in descriptor.fields:
        if field.type == FD.TYPE_STRING:
            payload = b"ok\xff\xfe\xc3("
            return _varint(field.number << 3 | 2) + _varint(len(payload)) + payload
    return None


@st.composite
def mutated_bytes(draw: st.DrawFn, valid: bytes) -> bytes:
    """``valid`` truncated, bit-flipped, spliced with garbage, or with a lying length prefix."""
    data = bytearray(valid)
    kind = draw(st.sampled_from(["truncate", "flip", "splice", "length", "random", "repeat"]))
    if kind == "truncate" and data:
        return bytes(data[: draw(st.integers(0, len(data) - 1))])
    if kind == "flip" and data:
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        return bytes(data)
    if kind == "splice":
        at = draw(st.integers(0, len(data)))
        return bytes(data[:at]) + draw(st.binary(min_size=1, max_size=16)) + bytes(data[at:])
    if kind == "length":
        # A length-delimited field claiming far more bytes than follow.
        number = draw(st.integers(1, 12))
        return bytes(data) + _varint(number << 3 | 2) + _varint(draw(st.sampled_from([2**31, 2**32 + 5, 2**63]))) + b"x"
    if kind == "repeat":
        return bytes(data) * min(draw(st.integers(2, 50)), max(2, MAX_RAW_BYTES // max(1, len(data))))
    return draw(st.binary(max_size=64))
