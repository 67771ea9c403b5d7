"""Value parsers: how one raw configuration value (YAML or ``-D``) becomes a typed one.

The option table (``options``) names a parser per key; :class:`Configuration` applies it. Kept
apart from both so the table does not depend on the object that reads it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from keyedstate.common.errors import ConfigError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_DURATION_UNITS = {
    "": 1,
    "ms": 1,
    "milli": 1,
    "millis": 1,
    "millisecond": 1,
    "milliseconds": 1,
    "s": 1000,
    "sec": 1000,
    "secs": 1000,
    "second": 1000,
    "seconds": 1000,
    "m": 60_000,
    "min": 60_000,
    "mins": 60_000,
    "minute": 60_000,
    "minutes": 60_000,
    "h": 3_600_000,
    "hour": 3_600_000,
    "hours": 3_600_000,
    "d": 86_400_000,
    "day": 86_400_000,
    "days": 86_400_000,
}
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_MEMORY_UNITS = {
    "": 1,
    "b": 1,
    "bytes": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kibibytes": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mebibytes": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gibibytes": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "tebibytes": 1 << 40,
}


def parse_duration_ms(value: Any, key: str = "duration") -> int:
    """Parse a Flink duration (``10 s``, ``500ms``, ``1 min``; a bare number is milliseconds)."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a duration such as '10 s' or '500 ms', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"{key}: a duration cannot be negative, got {value!r}")
        return int(value)
    match = _DURATION.match(str(value))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _DURATION_UNITS:
        raise ConfigError(
            f"{key}: cannot parse duration {value!r}; use a number with a unit: ms, s, min, h or d (for example '30 s')"
        )
    return int(float(match.group(1)) * _DURATION_UNITS[unit])


def parse_memory_bytes(value: Any, key: str = "memory size") -> int:
    """Parse a Flink memory size (``256mb``, ``1 gb``, ``64k``; a bare number is bytes)."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a memory size such as '256mb', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"{key}: a memory size cannot be negative, got {value!r}")
        return int(value)
    match = _MEMORY.match(str(value))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _MEMORY_UNITS:
        raise ConfigError(
            f"{key}: cannot parse memory size {value!r}; use a number with a unit: b, kb, mb, gb or tb (for example '256mb')"
        )
    return int(float(match.group(1)) * _MEMORY_UNITS[unit])


def string_parser(key: str, value: Any) -> str:
    if isinstance(value, (Mapping, list)):
        raise ConfigError(f"{key}: expected a string, got {type(value).__name__}")
    return str(value)


def int_parser(minimum: int | None = None, maximum: int | None = None) -> Callable[[str, Any], int]:
    def parse(key: str, value: Any) -> int:
        try:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            number = int(str(value).strip()) if not isinstance(value, int) else value
        except ValueError:
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
        if minimum is not None and number < minimum:
            raise ConfigError(f"{key}: must be at least {minimum}, got {number}")
        if maximum is not None and number > maximum:
            raise ConfigError(f"{key}: must be at most {maximum}, got {number}")
        return number

    return parse


def float_parser(minimum: float | None = None) -> Callable[[str, Any], float]:
    def parse(key: str, value: Any) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if minimum is not None and number < minimum:
            raise ConfigError(f"{key}: must be at least {minimum}, got {number}")
        return number

    return parse


def bool_parser(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "on", "1"):
        return True
    if text in ("false", "no", "off", "0"):
        return False
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def enum_parser(*choices: str, refused: Mapping[str, str] | None = None) -> Callable[[str, Any], str]:
    """One of ``choices`` (case-insensitive). ``refused`` maps values that are known (Flink has
    them) but not offered here to the reason and the alternative, given instead of "not one of"."""

    def parse(key: str, value: Any) -> str:
        text = str(value).strip().lower()
        if refused and text in refused:
            raise ConfigError(f"{key}: {value!r} is not supported: {refused[text]}")
        if text not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(choices)}")
        return text

    return parse


def duration_parser(key: str, value: Any) -> int:
    return parse_duration_ms(value, key)


def optional_duration_parser(key: str, value: Any) -> int | None:
    if value is None or str(value).strip().lower() in ("", "none", "null", "off", "disabled"):
        return None
    return parse_duration_ms(value, key)


def memory_parser(key: str, value: Any) -> int:
    return parse_memory_bytes(value, key)


def memory_at_least(minimum: int) -> Callable[[str, Any], int]:
    """A memory size of at least ``minimum`` bytes (a limit of 0 would refuse everything)."""

    def parse(key: str, value: Any) -> int:
        size = parse_memory_bytes(value, key)
        if size < minimum:
            raise ConfigError(
                f"{key}: must be at least {minimum} byte{'s' if minimum != 1 else ''}, got {value!r}; "
                f"set a size such as '64kb' or '16mb', or remove {key} for the default"
            )
        return size

    return parse


def port_parser(key: str, value: Any) -> int:
    return int_parser(0, 65535)(key, value)


def port_range_parser(key: str, value: Any) -> tuple[int, int]:
    """A port (``9249``) or a range (``9250-9260``); 0 means any free port; -1 disables."""
    text = str(value).strip()
    try:
        if "-" in text[1:]:
            low, high = (int(p) for p in text.split("-", 1))
        else:
            low = high = int(text)
    except ValueError:
        raise ConfigError(f"{key}: expected a port or a range such as 9250-9260, got {value!r}") from None
    if low == -1 and high == -1:
        return (-1, -1)
    if not (0 <= low <= high <= 65535):
        raise ConfigError(f"{key}: {value!r} is not a valid port range within 0-65535 (-1 disables)")
    return (low, high)
