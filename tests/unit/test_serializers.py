"""Serializers: exact byte formats, round trips, batch paths equal to single paths, and clear errors."""

from __future__ import annotations

import math
import pickle
import sys
import types
from typing import Any, cast

import pytest

from keyedstate.common import serializers
from keyedstate.common.errors import ConfigError, InvalidArgumentError
from keyedstate.common.serializers import (
    SERIALIZER_NAMES,
    BytesSerializer,
    FloatSerializer,
    IntSerializer,
    JsonSerializer,
    MsgpackSerializer,
    PickleSerializer,
    StrSerializer,
    dumps_many,
    get_serializer,
    loads_many,
)

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

try:
    import msgpack  # noqa: F401

    HAVE_MSGPACK = True
except ImportError:
    HAVE_MSGPACK = False

SAMPLES: dict[str, list[Any]] = {
    "bytes": [b"", b"\x00", b"abc", bytes(range(256))],
    "str": ["", "a", "é✓", "\U0001f600", "\x00nul", "x" * 10_000],
    "int": [0, 1, -1, 255, -256, INT64_MIN, INT64_MAX, 1 << 40],
    "float": [0.0, -0.0, 1.5, -2.25, math.inf, -math.inf, 1e308, 5e-324],
    "json": [None, True, 0, -7, 1.5, "é", [], {}, [1, "a", None], {"b": [1, {"c": 2}], "a": "x"}],
    "pickle": [None, 1, "s", b"b", (1, 2), {1, 2}, {"k": [1.5]}, complex(1, 2)],
    "msgpack": [None, True, 0, -1, 2**63, "é", b"\x00bin", [1, "a"], {"a": 1, 2: "int key"}],
}


def _serializers() -> list[Any]:
    params = []
    for name in SERIALIZER_NAMES:
        marks = [pytest.mark.skipif(not HAVE_MSGPACK, reason="msgpack not installed")] if name == "msgpack" else []
        params.append(pytest.param(name, id=name, marks=marks))
    return params


@pytest.mark.parametrize("name", _serializers())
def test_round_trip_single_and_batch(name: str) -> None:
    ser = get_serializer(name)
    assert ser.name == name
    values = SAMPLES[name]
    encoded = [ser.dumps(v) for v in values]
    assert all(type(b) is bytes for b in encoded)
    assert [ser.loads(b) for b in encoded] == values
    assert dumps_many(ser, values) == encoded
    assert loads_many(ser, encoded) == values
    assert dumps_many(ser, []) == [] and loads_many(ser, []) == []


@pytest.mark.parametrize("name", _serializers())
def test_serializers_pickle_to_an_equal_instance(name: str) -> None:
    # Serializers travel to Spark executors inside closures.
    ser = get_serializer(name)
    assert pickle.loads(pickle.dumps(ser)) == ser


def test_int_format_is_8_byte_big_endian_twos_complement() -> None:
    ser = IntSerializer()
    assert ser.dumps(1) == b"\x00\x00\x00\x00\x00\x00\x00\x01"
    assert ser.dumps(-1) == b"\xff" * 8
    assert ser.dumps(INT64_MIN) == b"\x80" + b"\x00" * 7
    assert ser.dumps(INT64_MAX) == b"\x7f" + b"\xff" * 7
    assert ser.dumps(0x0102030405060708) == bytes([1, 2, 3, 4, 5, 6, 7, 8])
    assert ser.dumps(True) == ser.dumps(1)  # bool is an int, as in CAST(b AS BIGINT)


def test_int_serializer_accepts_index_types() -> None:
    class Index:
        def __index__(self) -> int:
            return -5

    assert IntSerializer().dumps(Index()) == IntSerializer().dumps(-5)


@pytest.mark.parametrize("value", [INT64_MAX + 1, INT64_MIN - 1, 1 << 64])
def test_int_out_of_64_bit_range_is_rejected(value: Any) -> None:
    with pytest.raises(InvalidArgumentError, match=r"outside the signed 64-bit range.*str or json serializer"):
        IntSerializer().dumps(value)
    with pytest.raises(InvalidArgumentError, match=r"^item 2: .*outside the signed 64-bit range"):
        dumps_many(IntSerializer(), [1, 2, value])


@pytest.mark.parametrize("value", ["1", 1.0, None, b"\x01"])
def test_int_serializer_rejects_non_ints(value: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="the int serializer needs an int, got"):
        IntSerializer().dumps(value)
    with pytest.raises(InvalidArgumentError, match="^item 1: the int serializer needs an int"):
        dumps_many(IntSerializer(), [7, value])


@pytest.mark.parametrize("data", [b"", b"\x00" * 7, b"\x00" * 9])
def test_int_loads_rejects_wrong_lengths(data: bytes) -> None:
    with pytest.raises(InvalidArgumentError, match=f"is {len(data)} bytes, not the 8 of the int serializer"):
        IntSerializer().loads(data)


def test_int_loads_many_checks_every_length_not_the_total() -> None:
    # 16 + 0 bytes is 2 * 8 in total: a join-and-unpack shortcut must not accept it.
    with pytest.raises(InvalidArgumentError, match="^item 1: .*is 0 bytes"):
        loads_many(IntSerializer(), [IntSerializer().dumps(1), b"", b"\x00" * 16])


def test_str_is_utf8() -> None:
    assert StrSerializer().dumps("é✓") == "é✓".encode()
    assert StrSerializer().dumps("") == b""


@pytest.mark.parametrize("value", [1, None, b"abc", ["a"]])
def test_str_serializer_rejects_non_str(value: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="the str serializer needs a str, got"):
        StrSerializer().dumps(value)
    with pytest.raises(InvalidArgumentError, match="^item 1: the str serializer needs a str"):
        dumps_many(StrSerializer(), ["ok", value, "ok"])


def test_str_serializer_rejects_lone_surrogates() -> None:
    with pytest.raises(InvalidArgumentError, match="cannot be encoded as UTF-8.*surrogates"):
        StrSerializer().dumps("a\ud800")
    with pytest.raises(InvalidArgumentError, match="^item 0: .*cannot be encoded as UTF-8"):
        dumps_many(StrSerializer(), ["\udfff"])


def test_str_loads_rejects_invalid_utf8() -> None:
    with pytest.raises(InvalidArgumentError, match="not UTF-8.*another serializer"):
        StrSerializer().loads(b"\xff\xfe")
    with pytest.raises(InvalidArgumentError, match="^item 1: .*not UTF-8"):
        loads_many(StrSerializer(), [b"ok", b"\xc3"])


def test_str_accepts_subclasses_and_buffer_inputs_on_load() -> None:
    class Name(str):
        pass

    assert StrSerializer().dumps(Name("x")) == b"x"
    # Buffers are accepted on load although loads_many is annotated for bytes.
    assert loads_many(StrSerializer(), [bytearray(b"a"), memoryview(b"b")]) == ["a", "b"]  # type: ignore[list-item]


def test_bytes_batch_of_bytes_is_returned_as_is() -> None:
    batch = [b"a", b"b"]
    assert BytesSerializer().dumps_many(batch) is batch
    assert BytesSerializer().loads_many(batch) is batch


def test_bytes_serializer_copies_buffers_and_rejects_other_types() -> None:
    assert dumps_many(BytesSerializer(), [b"a", bytearray(b"b"), memoryview(b"c")]) == [b"a", b"b", b"c"]
    assert all(type(b) is bytes for b in dumps_many(BytesSerializer(), [bytearray(b"b"), memoryview(b"c")]))
    with pytest.raises(InvalidArgumentError, match="the bytes serializer needs bytes, got str 'abc'"):
        BytesSerializer().dumps("abc")
    with pytest.raises(InvalidArgumentError, match="^item 1: the bytes serializer needs bytes, got int"):
        dumps_many(BytesSerializer(), [b"", 5])


def test_float_format_and_nan() -> None:
    ser = FloatSerializer()
    assert ser.dumps(1.0) == b"\x3f\xf0" + b"\x00" * 6
    assert ser.dumps(3) == ser.dumps(3.0)
    assert math.isnan(ser.loads(ser.dumps(math.nan)))
    assert loads_many(ser, [b"\x00" * 8, ser.dumps(-2.5)]) == [0.0, -2.5]


def test_float_serializer_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="the float serializer needs a float or int, got str"):
        FloatSerializer().dumps("1.5")
    with pytest.raises(InvalidArgumentError, match="too large for a 64-bit float"):
        FloatSerializer().dumps(10**400)
    with pytest.raises(InvalidArgumentError, match="^item 2: .*too large"):
        dumps_many(FloatSerializer(), [1.0, 2, 10**400])
    with pytest.raises(InvalidArgumentError, match="is 4 bytes, not the 8 of the float serializer"):
        FloatSerializer().loads(b"\x00" * 4)


def test_json_is_compact_sorted_and_canonical() -> None:
    ser = JsonSerializer()
    assert ser.dumps({"b": 1, "a": [1, 2], "é": None}) == '{"a":[1,2],"b":1,"é":null}'.encode()
    assert ser.dumps({"x": 1, "y": 2}) == ser.dumps({"y": 2, "x": 1})
    assert ser.loads(ser.dumps((1, 2))) == [1, 2]


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({1, 2}, "cannot be serialized as JSON.*set"),
        (math.nan, "cannot be serialized as JSON.*Out of range float"),
        (object(), "cannot be serialized as JSON"),
        ({"a": "\ud800"}, "cannot be encoded as UTF-8"),
    ],
    ids=["set", "nan", "object", "surrogate"],
)
def test_json_rejects_what_is_not_json(value: Any, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        JsonSerializer().dumps(value)
    with pytest.raises(InvalidArgumentError, match="^item 1: "):
        dumps_many(JsonSerializer(), [1, value])


def test_json_rejects_circular_structures() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(InvalidArgumentError, match="Circular reference"):
        JsonSerializer().dumps(loop)


@pytest.mark.parametrize("data", [b"{", b"\xff", b"nope"])
def test_json_loads_rejects_garbage(data: bytes) -> None:
    with pytest.raises(InvalidArgumentError, match="are not JSON.*another serializer than json"):
        JsonSerializer().loads(data)


def test_pickle_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="cannot be pickled"):
        PickleSerializer().dumps(lambda: None)
    with pytest.raises(InvalidArgumentError, match="^item 0: .*cannot be pickled"):
        dumps_many(PickleSerializer(), [lambda: None])
    with pytest.raises(InvalidArgumentError, match="cannot be unpickled"):
        PickleSerializer().loads(b"not a pickle")


def test_pickle_of_a_class_the_reader_cannot_import(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("keyedstate_vanishing_module")
    exec("class Point:\n    pass\n", module.__dict__)
    module.Point.__module__ = module.__name__
    monkeypatch.setitem(sys.modules, module.__name__, module)
    data = PickleSerializer().dumps(module.Point())
    monkeypatch.delitem(sys.modules, module.__name__)
    with pytest.raises(InvalidArgumentError, match="cannot be unpickled.*ModuleNotFoundError.*cannot be imported"):
        PickleSerializer().loads(data)


def test_pickle_protocol_is_pinned() -> None:
    assert PickleSerializer().dumps(1)[:2] == b"\x80\x05"


@pytest.mark.skipif(not HAVE_MSGPACK, reason="msgpack not installed")
def test_msgpack_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="cannot be serialized with msgpack"):
        MsgpackSerializer().dumps(object())
    with pytest.raises(InvalidArgumentError, match="cannot be serialized with msgpack"):
        MsgpackSerializer().dumps(2**64)
    with pytest.raises(InvalidArgumentError, match="are not MessagePack"):
        MsgpackSerializer().loads(b"\xc1")


def test_msgpack_missing_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "msgpack", None)  # makes `import msgpack` raise ImportError
    monkeypatch.setattr(serializers, "_INSTANCES", {})  # forget an instance built while it was there
    with pytest.raises(ConfigError, match="pip install msgpack"):
        get_serializer("msgpack")
    with pytest.raises(ConfigError, match="pip install msgpack"):
        MsgpackSerializer()


def test_registry_names_and_instances() -> None:
    assert SERIALIZER_NAMES == ("bytes", "str", "int", "float", "json", "pickle", "msgpack")
    assert get_serializer("str") is get_serializer(" STR ")
    assert isinstance(get_serializer("int"), IntSerializer)
    custom = IntSerializer()
    assert cast(object, get_serializer(custom)) is custom


def test_custom_serializer_without_batch_methods() -> None:
    class Upper:
        name = "upper"

        def dumps(self, obj: str) -> bytes:
            return obj.upper().encode()

        def loads(self, data: bytes) -> Any:
            return data.decode().lower()

    upper = Upper()
    # The module functions work with it as it is; get_serializer adds the batch methods.
    assert dumps_many(upper, ["a", "b"]) == [b"A", b"B"]
    assert loads_many(upper, [b"A"]) == ["a"]
    ser = get_serializer(upper)
    assert ser.name == "upper" and ser.dumps("x") == b"X" and ser.loads(b"X") == "x"
    assert ser.dumps_many(["a", "b"]) == [b"A", b"B"]
    assert ser.loads_many([b"A"]) == ["a"]
    assert pickle.loads(pickle.dumps(get_serializer(IntSerializer()))) == IntSerializer()


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("yaml", "unknown serializer 'yaml': use one of bytes, str, int"),
        (StrSerializer, r"not the class: StrSerializer\(\)"),
        (42, "int 42 is not a serializer"),
        (object(), "is not a serializer"),
    ],
    ids=["unknown-name", "class", "int", "object"],
)
def test_get_serializer_rejects_what_it_cannot_use(value: Any, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        get_serializer(value)


@pytest.mark.parametrize("name", ["bytes", "str", "int", "float", "json", "pickle"])
def test_batches_may_be_generators_or_tuples(name: str) -> None:
    ser = get_serializer(name)
    values = SAMPLES[name]
    encoded = [ser.dumps(v) for v in values]
    assert dumps_many(ser, (v for v in values)) == encoded
    assert dumps_many(ser, tuple(values)) == encoded
    assert loads_many(ser, (b for b in encoded)) == values
    assert loads_many(ser, tuple(encoded)) == values


def test_a_failing_generator_batch_still_names_the_item() -> None:
    with pytest.raises(InvalidArgumentError, match="^item 2: "):
        dumps_many(IntSerializer(), (v for v in [1, 2, "three"]))
