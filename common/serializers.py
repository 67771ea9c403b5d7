"""Serializers: how keys and values become the bytes that state is stored and routed by.

The key serializer fixes a key's bytes, and a key's bytes fix its key group
(:mod:`keyedstate.common.keygroups`), so the same serializer must be used wherever a key is
routed: by the executor client, and by Spark SQL when a DataFrame is partitioned natively
(:func:`keyedstate.common.spark.key_group_column`). The ``str``, ``int`` and ``bytes`` formats are
chosen so that Spark SQL can produce identical bytes without a Python UDF.

Every serializer is a small stateless, picklable object (it travels to Spark executors inside
closures). :func:`get_serializer` resolves a registered name or passes a custom object through;
:func:`dumps_many` and :func:`loads_many` are the batch paths used by the client.
"""

from __future__ import annotations

import json
import logging
import pickle
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

from keyedstate.common.errors import ConfigError, InvalidArgumentError

logger = logging.getLogger(__name__)

_INT64 = struct.Struct(">q")
_FLOAT64 = struct.Struct(">d")
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
# The pickle protocol is pinned, not HIGHEST_PROTOCOL, so a driver and executors on different
# Python versions write identical bytes.
PICKLE_PROTOCOL = 5


T = TypeVar("T")


class Serializer(Protocol[T]):
    """Turns objects into bytes and back. ``loads(dumps(x)) == x`` for every accepted ``x``.

    Every serializer :func:`get_serializer` returns has the batch methods. A custom serializer
    needs only ``name``, ``dumps`` and ``loads``: :func:`get_serializer` adds the batch methods
    to one that lacks them.
    """

    @property
    def name(self) -> str:
        """The name this serializer is registered under and known by in messages (``str``, ``json``, ...)."""

    def dumps(self, obj: T) -> bytes:
        """The bytes of ``obj``; raises InvalidArgumentError naming the value when it cannot be encoded."""

    def loads(self, data: bytes) -> T:
        """The object stored as ``data``; raises InvalidArgumentError when another serializer wrote the bytes."""

    def dumps_many(self, objs: Iterable[T]) -> list[bytes]:
        """``dumps`` over a batch, in order; an error names the failing item's index."""

    def loads_many(self, datas: Iterable[bytes]) -> list[T]:
        """``loads`` over a batch, in order; an error names the failing item's index."""


def _describe(obj: Any) -> str:
    text = repr(obj)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(obj).__name__} {text}"


def _as_list(items: Iterable[Any]) -> list[Any]:
    # Batch paths look at a batch twice (a fast try, then a precise retry), which a generator
    # would not survive.
    return items if type(items) is list else list(items)


def _dumps_each(dumps: Any, objs: Iterable[Any]) -> list[bytes]:
    """Item-by-item serialization whose errors name the failing item's index."""
    out: list[bytes] = []
    append = out.append
    for i, obj in enumerate(objs):
        try:
            append(dumps(obj))
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"item {i}: {exc.message}") from None
    return out


def _loads_each(loads: Any, datas: Iterable[bytes]) -> list[Any]:
    out: list[Any] = []
    append = out.append
    for i, data in enumerate(datas):
        try:
            append(loads(data))
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"item {i}: {exc.message}") from None
    return out


@dataclass(frozen=True)
class BytesSerializer:
    """Keys and values that already are bytes (``bytearray`` and ``memoryview`` are copied)."""

    name: ClassVar[str] = "bytes"

    def dumps(self, obj: Any) -> bytes:
        """``obj`` itself when it is ``bytes`` (no copy), a copy of a ``bytearray`` or ``memoryview``.

        Raises InvalidArgumentError for anything else: encode it first or pick another serializer.
        """
        if type(obj) is bytes:
            return obj
        if isinstance(obj, (bytes, bytearray, memoryview)):
            return bytes(obj)
        raise InvalidArgumentError(
            f"the bytes serializer needs bytes, got {_describe(obj)}: encode it first or pick a "
            "serializer for its type (str, int, json, ...)"
        )

    def loads(self, data: bytes) -> bytes:
        """``data`` as ``bytes``, copied only when it is another buffer type."""
        return data if type(data) is bytes else bytes(data)

    def dumps_many(self, objs: Iterable[Any]) -> list[bytes]:
        """A list of plain ``bytes`` is returned as the same list object (no copy): do not mutate it afterwards."""
        objs = _as_list(objs)
        # One C-level pass over the types; a batch of plain bytes is returned as it is.
        if set(map(type, objs)) <= {bytes}:
            return objs
        return _dumps_each(self.dumps, objs)

    def loads_many(self, datas: Iterable[bytes]) -> list[bytes]:
        """A list of plain ``bytes`` is returned as the same list object (no copy); other buffers are copied."""
        datas = _as_list(datas)
        if set(map(type, datas)) <= {bytes}:
            return datas
        return [bytes(d) for d in datas]


@dataclass(frozen=True)
class StrSerializer:
    """``str`` as UTF-8; Spark SQL produces the same bytes with ``CAST(col AS BINARY)``."""

    name: ClassVar[str] = "str"

    def dumps(self, obj: Any) -> bytes:
        """UTF-8 bytes of a ``str``; InvalidArgumentError for a non-str or a string with lone surrogates."""
        try:
            return str.encode(obj)
        except TypeError:
            raise InvalidArgumentError(
                f"the str serializer needs a str, got {_describe(obj)}: convert it with str() or "
                "pick a serializer for its type (int, bytes, json, ...)"
            ) from None
        except UnicodeEncodeError as exc:
            raise InvalidArgumentError(
                f"{_describe(obj)} cannot be encoded as UTF-8 ({exc.reason}): remove lone surrogates"
            ) from None

    def loads(self, data: bytes) -> str:
        """Decode UTF-8; InvalidArgumentError if the bytes are not UTF-8 (another serializer wrote them)."""
        try:
            return str(data, "utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidArgumentError(
                f"stored bytes {bytes(data)[:32]!r} are not UTF-8 ({exc.reason}): they were written "
                "with another serializer than str"
            ) from None

    def dumps_many(self, objs: Iterable[Any]) -> list[bytes]:
        """Encode a batch in one C-level pass; on a bad item, retry item by item so the error names its index."""
        objs = _as_list(objs)
        try:
            return list(map(str.encode, objs))
        except (TypeError, UnicodeEncodeError):
            return _dumps_each(self.dumps, objs)

    def loads_many(self, datas: Iterable[bytes]) -> list[str]:
        """Decode a batch in one C-level pass; on a bad item, retry item by item so the error names its index."""
        datas = _as_list(datas)
        try:
            return list(map(bytes.decode, datas))
        except (TypeError, UnicodeDecodeError):
            return _loads_each(self.loads, datas)


@dataclass(frozen=True)
class IntSerializer:
    """Signed 64-bit ints as 8 bytes big-endian two's complement.

    Spark SQL produces the same bytes for a bigint column with
    ``unhex(lpad(hex(col), 16, '0'))`` (``hex`` of a negative bigint is its two's complement).
    ``bool`` counts as an int (``True`` is 1), as it does in Python and in ``CAST(b AS BIGINT)``.
    """

    name: ClassVar[str] = "int"

    def dumps(self, obj: Any) -> bytes:
        """8 bytes big-endian; InvalidArgumentError for a non-int or an int outside the signed 64-bit range."""
        try:
            return _INT64.pack(obj)
        except struct.error:
            raise self._error(obj) from None

    def loads(self, data: bytes) -> int:
        """The int in 8 bytes big-endian; InvalidArgumentError for any other length."""
        try:
            value: int = _INT64.unpack(data)[0]
            return value
        except (struct.error, TypeError):
            raise InvalidArgumentError(
                f"stored value {bytes(data)[:32]!r} is {len(data)} bytes, not the 8 of the int "
                "serializer: it was written with another serializer"
            ) from None

    def dumps_many(self, objs: Iterable[Any]) -> list[bytes]:
        """Pack a batch in one C-level pass; on a bad item, retry item by item so the error names its index."""
        objs = _as_list(objs)
        try:
            return list(map(_INT64.pack, objs))
        except struct.error:
            return _dumps_each(self.dumps, objs)

    def loads_many(self, datas: Iterable[bytes]) -> list[int]:
        """Unpack a batch of 8-byte items with a single ``struct.unpack``; an error names the bad item's index."""
        datas = _as_list(datas)
        if set(map(len, datas)) <= {8}:
            # One unpack of the joined batch beats one call per item; the length check above
            # guarantees item boundaries fall on multiples of 8.
            return list(struct.unpack(f">{len(datas)}q", b"".join(datas)))
        return _loads_each(self.loads, datas)

    @staticmethod
    def _error(obj: Any) -> InvalidArgumentError:
        if isinstance(obj, int):
            return InvalidArgumentError(
                f"int {obj} is outside the signed 64-bit range [{_INT64_MIN}, {_INT64_MAX}] of the int "
                "serializer: use the str or json serializer for larger numbers"
            )
        return InvalidArgumentError(
            f"the int serializer needs an int, got {_describe(obj)}: convert it with int() or pick "
            "a serializer for its type (str, float, json, ...)"
        )


@dataclass(frozen=True)
class FloatSerializer:
    """Floats as 8 bytes big-endian IEEE 754 double. Ints are converted as ``float()`` does."""

    name: ClassVar[str] = "float"

    def dumps(self, obj: Any) -> bytes:
        """8 bytes big-endian IEEE 754 (NaN and infinities included); InvalidArgumentError for a non-number
        or an int too large for a double.
        """
        try:
            return _FLOAT64.pack(obj)
        except (struct.error, OverflowError) as exc:
            raise self._error(obj, exc) from None

    def loads(self, data: bytes) -> float:
        """The float in 8 bytes big-endian; InvalidArgumentError for any other length."""
        try:
            value: float = _FLOAT64.unpack(data)[0]
            return value
        except (struct.error, TypeError):
            raise InvalidArgumentError(
                f"stored value {bytes(data)[:32]!r} is {len(data)} bytes, not the 8 of the float "
                "serializer: it was written with another serializer"
            ) from None

    def dumps_many(self, objs: Iterable[Any]) -> list[bytes]:
        """Pack a batch in one C-level pass; on a bad item, retry item by item so the error names its index."""
        objs = _as_list(objs)
        try:
            return list(map(_FLOAT64.pack, objs))
        except (struct.error, OverflowError):
            return _dumps_each(self.dumps, objs)

    def loads_many(self, datas: Iterable[bytes]) -> list[float]:
        """Unpack a batch of 8-byte items with a single ``struct.unpack``; an error names the bad item's index."""
        datas = _as_list(datas)
        if set(map(len, datas)) <= {8}:
            return list(struct.unpack(f">{len(datas)}d", b"".join(datas)))
        return _loads_each(self.loads, datas)

    @staticmethod
    def _error(obj: Any, exc: Exception) -> InvalidArgumentError:
        if isinstance(exc, OverflowError) or isinstance(obj, int):
            return InvalidArgumentError(
                f"{_describe(obj)} is too large for a 64-bit float: use the str or json serializer"
            )
        return InvalidArgumentError(
            f"the float serializer needs a float or int, got {_describe(obj)}: convert it with "
            "float() or pick a serializer for its type"
        )


# Compact and canonical: equal objects give equal bytes, which matters when they are keys.
_JSON_ENCODER = json.JSONEncoder(separators=(",", ":"), sort_keys=True, ensure_ascii=False, allow_nan=False)
_JSON_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class JsonSerializer:
    """JSON as compact UTF-8 with sorted keys (equal objects give equal bytes; tuples become lists).

    NaN and infinities are rejected: they are not JSON and other languages cannot read them.
    """

    name: ClassVar[str] = "json"

    def dumps(self, obj: Any) -> bytes:
        """Canonical compact UTF-8 JSON; InvalidArgumentError for NaN, infinities, cycles and types JSON
        cannot hold (use the pickle serializer for arbitrary objects).
        """
        try:
            return _JSON_ENCODER.encode(obj).encode()
        except UnicodeEncodeError as exc:
            # Before ValueError, of which it is a subclass.
            raise InvalidArgumentError(f"{_describe(obj)} cannot be encoded as UTF-8 ({exc.reason})") from None
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidArgumentError(
                f"{_describe(obj)} cannot be serialized as JSON ({exc}): convert it to dicts, lists, "
                "str, int, float, bool and None, or use the pickle serializer"
            ) from None

    def loads(self, data: bytes) -> Any:
        """Parse UTF-8 JSON (arrays come back as lists); InvalidArgumentError if the bytes are not JSON."""
        try:
            # Decoding here skips json.loads' per-call encoding sniffing: dumps always writes UTF-8.
            return _JSON_DECODER.decode(str(data, "utf-8"))
        except (ValueError, TypeError) as exc:
            raise InvalidArgumentError(
                f"stored bytes {bytes(data)[:32]!r} are not JSON ({exc}): they were written with "
                "another serializer than json"
            ) from None

    def dumps_many(self, objs: Iterable[Any]) -> list[bytes]:
        """Item by item; an error names the failing item's index."""
        return _dumps_each(self.dumps, objs)

    def loads_many(self, datas: Iterable[bytes]) -> list[Any]:
        """Item by item; an error names the failing item's index."""
        return _loads_each(self.loads, datas)


@dataclass(frozen=True)
class PickleSerializer:
    """Any picklable object, with pickle protocol 5.

    Only for trusted data: unpickling runs arbitrary code, so never read state that someone
    else could have written. Not canonical either (equal dicts or sets can pickle differently),
    so prefer json, str or int for keys.
    """

    name: ClassVar[str] = "pickle"

    def dumps(self, obj: Any) -> bytes:
        """Pickle with the pinned protocol 5; InvalidArgumentError for an object that cannot be pickled."""
        try:
            return pickle.dumps(obj, PICKLE_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError, RecursionError) as exc:
            raise InvalidArgumentError(f"{_describe(obj)} cannot be pickled ({exc})") from None

    def loads(self, data: bytes) -> Any:
        """Unpickle: runs code the bytes name, so only for state this job wrote itself.

        Any failure (including a class that cannot be imported here) is an InvalidArgumentError.
        """
        try:
            return pickle.loads(data)
        except Exception as exc:  # unpickling can fail with any error type
            raise InvalidArgumentError(
                f"stored bytes {bytes(data)[:32]!r} cannot be unpickled ({type(exc).__name__}: {exc}): "
                "they were written with another serializer, or a class they need cannot be imported"
            ) from None

    def dumps_many(self, objs: Iterable[Any]) -> list[bytes]:
        """Item by item; an error names the failing item's index."""
        return _dumps_each(self.dumps, objs)

    def loads_many(self, datas: Iterable[bytes]) -> list[Any]:
        """Item by item; an error names the failing item's index (trusted data only, as :meth:`loads`)."""
        return _loads_each(self.loads, datas)


def _msgpack() -> Any:
    try:
        import msgpack
    except ImportError:
        raise ConfigError(
            "the msgpack serializer needs the msgpack package, which is not installed: "
            "pip install msgpack (it is part of keyedstate[bench]), or use the json serializer"
        ) from None
    return msgpack


@dataclass(frozen=True)
class MsgpackSerializer:
    """MessagePack (``use_bin_type``, str round-trips as str); needs the optional ``msgpack`` package.

    Creating one fails with a :class:`ConfigError` naming ``pip install msgpack`` when it is missing.
    """

    name: ClassVar[str] = "msgpack"

    def __post_init__(self) -> None:
        _msgpack()

    def dumps(self, obj: Any) -> bytes:
        """Pack with ``use_bin_type`` (tuples come back as lists); InvalidArgumentError for types or ints
        MessagePack cannot hold.
        """
        msgpack = _msgpack()
        try:
            packed: bytes = msgpack.packb(obj, use_bin_type=True)
            return packed
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidArgumentError(f"{_describe(obj)} cannot be serialized with msgpack ({exc})") from None

    def loads(self, data: bytes) -> Any:
        """Unpack (``raw=False``: str stays str; map keys of any type); InvalidArgumentError if the bytes
        are not MessagePack.
        """
        msgpack = _msgpack()
        try:
            return msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types
            raise InvalidArgumentError(
                f"stored bytes {bytes(data)[:32]!r} are not MessagePack ({type(exc).__name__}: {exc}): "
                "they were written with another serializer"
            ) from None

    def dumps_many(self, objs: Iterable[Any]) -> list[bytes]:
        """Item by item; an error names the failing item's index."""
        return _dumps_each(self.dumps, objs)

    def loads_many(self, datas: Iterable[bytes]) -> list[Any]:
        """Item by item; an error names the failing item's index."""
        return _loads_each(self.loads, datas)


_REGISTRY: dict[str, type] = {
    cls.name: cls
    for cls in (
        BytesSerializer,
        StrSerializer,
        IntSerializer,
        FloatSerializer,
        JsonSerializer,
        PickleSerializer,
        MsgpackSerializer,
    )
}
SERIALIZER_NAMES: tuple[str, ...] = tuple(_REGISTRY)
_INSTANCES: dict[str, Serializer[Any]] = {}


@dataclass(frozen=True)
class _Batched:
    """Gives a custom serializer that has only ``dumps``/``loads`` the batch methods."""

    inner: Any

    @property
    def name(self) -> str:
        return str(getattr(self.inner, "name", type(self.inner).__name__))

    def dumps(self, obj: Any) -> bytes:
        data: bytes = self.inner.dumps(obj)
        return data

    def loads(self, data: bytes) -> Any:
        return self.inner.loads(data)

    def dumps_many(self, objs: Iterable[Any]) -> list[bytes]:
        return _dumps_each(self.inner.dumps, objs)

    def loads_many(self, datas: Iterable[bytes]) -> list[Any]:
        return _loads_each(self.inner.loads, datas)


def _has_method(obj: Any, name: str) -> bool:
    return callable(getattr(obj, name, None))


def get_serializer(name_or_obj: str | Any) -> Serializer[Any]:
    """The serializer registered under a name (``bytes``, ``str``, ``int``, ``float``, ``json``,
    ``pickle``, ``msgpack``), or a custom object with ``name``, ``dumps`` and ``loads``.

    A custom object is returned as it is when it has ``dumps_many`` and ``loads_many`` too, and
    wrapped to get them otherwise.
    """
    if isinstance(name_or_obj, str):
        key = name_or_obj.strip().lower()
        found = _INSTANCES.get(key)
        if found is not None:
            return found
        cls = _REGISTRY.get(key)
        if cls is None:
            raise InvalidArgumentError(
                f"unknown serializer {name_or_obj!r}: use one of {', '.join(SERIALIZER_NAMES)}, or pass an "
                "object with name, dumps(obj) -> bytes and loads(bytes)"
            )
        instance: Serializer[Any] = cls()
        _INSTANCES[key] = instance
        return instance
    if isinstance(name_or_obj, type):
        raise InvalidArgumentError(f"pass a serializer instance, not the class: {name_or_obj.__name__}()")
    if hasattr(name_or_obj, "name") and _has_method(name_or_obj, "dumps") and _has_method(name_or_obj, "loads"):
        if _has_method(name_or_obj, "dumps_many") and _has_method(name_or_obj, "loads_many"):
            return name_or_obj  # type: ignore[no-any-return]
        return _Batched(name_or_obj)
    raise InvalidArgumentError(
        f"{_describe(name_or_obj)} is not a serializer: pass one of {', '.join(SERIALIZER_NAMES)}, or an "
        "object with name, dumps(obj) -> bytes and loads(bytes)"
    )


def dumps_many(serializer: Any, objs: Iterable[Any]) -> list[bytes]:
    """Serialize a batch with any serializer; uses its own ``dumps_many`` when it has one."""
    batch = getattr(serializer, "dumps_many", None)
    if batch is not None:
        encoded: list[bytes] = batch(objs)
        return encoded
    dumps = serializer.dumps
    return [dumps(o) for o in objs]


def loads_many(serializer: Any, datas: Iterable[bytes]) -> list[Any]:
    """Deserialize a batch with any serializer; uses its own ``loads_many`` when it has one."""
    batch = getattr(serializer, "loads_many", None)
    if batch is not None:
        decoded: list[Any] = batch(datas)
        return decoded
    loads = serializer.loads
    return [loads(d) for d in datas]
