"""The Configuration object: raw values from YAML and ``-D``, parsed through typed options."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from keyedstate.common.config import options as _options
from keyedstate.common.config._option import ConfigOption
from keyedstate.common.config._secrets import REDACTED, is_secret_key, redacted
from keyedstate.common.errors import ConfigError

logger = logging.getLogger(__name__)

T = TypeVar("T")


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
        """Set the raw value of ``key`` in place and return self (chainable); parsed only when read."""
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
            return self._parse(option, option.key)
        for legacy in option.fallback_keys:
            if legacy in self._values:
                return self._parse(option, legacy)
        return option.default  # type: ignore[return-value]

    def _parse(self, option: ConfigOption[T], key: str) -> T:
        """Parse the value under ``key`` (the option's key or a legacy one), reading a renamed value
        as its current one; each deprecated key and value is warned about once, naming what to set."""
        raw = self._values[key]
        mapped = option.renamed_value(raw)
        value = raw if mapped is None else mapped
        if key != option.key or mapped is not None:
            warned = key if mapped is None else f"{key}={str(raw).strip().lower()}"
            if warned not in self._warned:
                self._warned.add(warned)
                shown_raw, shown = (REDACTED, REDACTED) if option.secret else (raw, value)
                if key == option.key:
                    message = f"config value {shown_raw!r} of {key!r} is deprecated (read as {shown!r})"
                else:
                    read_as = f" (value {shown_raw!r} read as {shown!r})" if mapped is not None else ""
                    message = f"config key {key!r} is deprecated{read_as}; use {option.key!r} instead"
                note = "" if option.secret or mapped is None else option.legacy_note(raw)
                logger.warning("%s; set %s: %s%s", message, option.key, shown, f" ({note})" if note else "")
        return option.parser(key, value)

    def get_raw(self, key: str, default: Any = None) -> Any:
        """The unparsed value stored under exactly ``key``, or ``default``: no fallback keys, no option default."""
        return self._values.get(key, default)

    def is_set(self, option: ConfigOption[Any]) -> bool:
        """True if the option's key or one of its legacy fallback keys was given (the default does not count)."""
        return option.key in self._values or any(k in self._values for k in option.fallback_keys)

    def validate(self, known: Iterable[ConfigOption[Any]] | None = None) -> list[str]:
        """Parse every known key (raising on a bad value) and warn about unknown keys.

        Returns the warnings, which are also logged.
        """
        known_options = list(known) if known is not None else _options.ALL
        by_key: dict[str, ConfigOption[Any]] = {}
        for opt in known_options:
            by_key[opt.key] = opt
            for legacy in opt.fallback_keys:
                by_key[legacy] = opt
        warnings: list[str] = []
        for key in self._values:
            found = by_key.get(key)
            if found is None:
                close = difflib.get_close_matches(key, list(by_key), n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                msg = f"unknown config key {key!r} is ignored{hint}"
                logger.warning(msg)
                warnings.append(msg)
                continue
            if key == found.key:
                self._parse(found, key)
        for opt in known_options:
            if opt.key not in self._values and any(k in self._values for k in opt.fallback_keys):
                self.get(opt)  # parses and logs the deprecation
        return warnings
