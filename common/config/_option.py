"""One configuration key: its type, default, documentation and the legacy keys it replaces."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class ConfigOption(Generic[T]):
    key: str
    """The Flink-style key, for example ``state.backend.type``."""
    parser: Callable[[str, Any], T]
    """Turns a raw YAML/CLI value into the typed value; raises ConfigError naming the key."""
    default: T | None
    description: str
    type_name: str
    """Shown in the documentation table and in error messages (``duration``, ``memory`` …)."""
    fallback_keys: tuple[str, ...] = ()
    """Older keys still accepted, each with a deprecation warning."""
    legacy_values: dict[str, str] = field(default_factory=dict)
    """Renamed values, under the key or a fallback key, each read with a deprecation warning
    (``state.backend: filesystem`` → ``hashmap``). Looked up case-insensitively; a Java class name
    also matches without its ``org.apache.flink.`` package (see :meth:`renamed_value`)."""
    legacy_notes: dict[str, str] = field(default_factory=dict)
    """What a renamed value meant beyond its new name, added to its deprecation warning (same lookup)."""
    secret: bool = False
    """A credential: never logged, printed or stored; on the command line (``-D``) it draws a warning."""

    def renamed_value(self, raw: Any) -> str | None:
        """The current value a deprecated ``raw`` value stands for, or None if ``raw`` is not one.

        Flink accepts class names for some values (``state.backend.type:
        org.apache.flink.runtime.state.hashmap.HashMapStateBackend``), so a value naming a class in
        Flink's packages is also looked up by its simple class name.
        """
        if not self.legacy_values or isinstance(raw, (dict, list)):
            return None
        mapped = self.legacy_values.get(_simple_name(raw))
        return None if mapped is None or mapped == str(raw).strip().lower() else mapped

    def legacy_note(self, raw: Any) -> str:
        """The note on a renamed value (:attr:`legacy_notes`), or ``""``."""
        return "" if isinstance(raw, (dict, list)) else self.legacy_notes.get(_simple_name(raw), "")


_FLINK_PACKAGE = "org.apache.flink."


def _simple_name(raw: Any) -> str:
    """``raw`` lower-cased, a class in Flink's packages by its simple name."""
    text = str(raw).strip()
    if text.startswith(_FLINK_PACKAGE):
        text = text.rsplit(".", 1)[-1]
    return text.lower()
