"""The Configuration object: raw values from YAML and ``-D``, parsed through typed options."""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from keyedstate.common.config._option import ConfigOption
from keyedstate.common.config._secrets import REDACTED, is_secret_key, redacted
from keyedstate.common.errors import ConfigError

logger = logging.getLogger(__name__)

T = TypeVar("T")

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


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    # Flink 1.19+ config.yaml allows nested maps; legacy flink-conf.yaml uses flat dotted keys.
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


class Configuration:
    """Raw key/value pairs plus typed access through :class:`ConfigOption`.

    Values are validated when the configuration is built (:meth:`validate`), so a malformed
    value stops a daemon at start-up with a message naming the key, never later.
    """

    def __init__(self, values: Mapping[str, Any] | None = None) -> None:
        self._values: dict[str, Any] = {}
        self._warned: set[str] = set()
        for k, v in (values or {}).items():
            _flatten(str(k), v, self._values)

    # -- building ---------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        overrides: Iterable[str] = (),
        *,
        base: Mapping[str, Any] | None = None,
        known: Iterable[ConfigOption[Any]] | None = None,
    ) -> Configuration:
        """Read ``path`` (YAML), apply ``-D key=value`` overrides, validate every known key."""
        conf = cls(base)
        if path is not None:
            p = Path(path)
            try:
                text = p.read_text(encoding="utf-8")
            except OSError as exc:
                raise ConfigError(
                    f"cannot read config file {p}: {exc.strerror or exc}; pass an existing YAML file to --config"
                ) from exc
            except UnicodeDecodeError as exc:
                raise ConfigError(
                    f"config file {p} is not UTF-8 text ({exc.reason} at byte {exc.start}); pass a YAML file"
                ) from exc
            try:
                data = yaml.safe_load(text) or {}
            except yaml.YAMLError as exc:
                # One line naming the spot; str(exc) spans several lines with a source excerpt.
                mark = getattr(exc, "problem_mark", None)
                where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
                problem = getattr(exc, "problem", None) or str(exc).replace("\n", " ")
                raise ConfigError(f"config file {p} is not valid YAML{where}: {problem}") from exc
            if not isinstance(data, Mapping):
                raise ConfigError(f"config file {p} must hold a mapping of keys to values, not {type(data).__name__}")
            _flatten("", data, conf._values)
        for item in overrides:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                shown = REDACTED if is_secret_key(key) else repr(item)
                raise ConfigError(f"-D {shown}: expected key=value, for example -D taskmanager.numberOfTaskSlots=4")
            conf._values[key.strip()] = value.strip()
        conf.validate(known)
        return conf

    def set(self, key: str, value: Any) -> Configuration:
        self._values[key] = value
        return self

    def with_values(self, values: Mapping[str, Any]) -> Configuration:
        """A copy with ``values`` applied on top (per-job overrides)."""
        copy = Configuration(self._values)
        for k, v in values.items():
            _flatten(str(k), v, copy._values)
        return copy

    def to_dict(self) -> dict[str, Any]:
        """Every raw value, secrets included: never log or print this (use :meth:`redacted`)."""
        return dict(self._values)

    def redacted(self) -> dict[str, Any]:
        """Every raw value, with secrets (``ConfigOption.secret`` and credential-like keys) as ``******``."""
        return redacted(self._values)

    def __repr__(self) -> str:
        return f"Configuration({self.redacted()!r})"

    def __contains__(self, key: str) -> bool:
        return key in self._values

    # -- typed access -----------------------------------------------------------------------
    def get(self, option: ConfigOption[T]) -> T:
        """The option's value: its own key, else a legacy key (with a warning), else the default."""
        if option.key in self._values:
            return option.parser(option.key, self._values[option.key])
        for legacy in option.fallback_keys:
            if legacy in self._values:
                raw = self._values[legacy]
                mapped = option.legacy_values.get(str(raw).strip().lower(), raw)
                if legacy not in self._warned:
                    self._warned.add(legacy)
                    shown_raw, shown_mapped = (REDACTED, REDACTED) if option.secret else (raw, mapped)
                    logger.warning(
                        "config key %r is deprecated; use %r instead (value %r read as %r)",
                        legacy,
                        option.key,
                        shown_raw,
                        shown_mapped,
                    )
                return option.parser(legacy, mapped)
        return option.default  # type: ignore[return-value]

    def get_raw(self, key: str, default: Any = None) -> Any:
        return self._values.get(key, default)

    def is_set(self, option: ConfigOption[Any]) -> bool:
        return option.key in self._values or any(k in self._values for k in option.fallback_keys)

    def validate(self, known: Iterable[ConfigOption[Any]] | None = None) -> list[str]:
        """Parse every known key (raising on a bad value) and warn about unknown keys.

        Returns the warnings, which are also logged.
        """
        from keyedstate.common.config import options as _options

        known_options = list(known) if known is not None else _options.ALL
        by_key: dict[str, ConfigOption[Any]] = {}
        for opt in known_options:
            by_key[opt.key] = opt
            for legacy in opt.fallback_keys:
                by_key[legacy] = opt
        warnings: list[str] = []
        for key in self._values:
            opt = by_key.get(key)
            if opt is None:
                close = difflib.get_close_matches(key, list(by_key), n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                msg = f"unknown config key {key!r} is ignored{hint}"
                logger.warning(msg)
                warnings.append(msg)
                continue
            if key == opt.key:
                opt.parser(key, self._values[key])
        for opt in known_options:
            if opt.key not in self._values and any(k in self._values for k in opt.fallback_keys):
                self.get(opt)  # parses and logs the deprecation
        return warnings


# -- parsers used by the option table -----------------------------------------------------------


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


def enum_parser(*choices: str) -> Callable[[str, Any], str]:
    def parse(key: str, value: Any) -> str:
        text = str(value).strip().lower()
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
