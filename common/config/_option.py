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
        text = str(raw).strip()
        if text.startswith(_FLINK_PACKAGE):
            text = text.rsplit(".", 1)[-1]
        mapped = self.legacy_values.get(text.lower())
        return None if mapped is None or mapped == str(raw).strip().lower() else mapped


_FLINK_PACKAGE = "org.apache.flink."
