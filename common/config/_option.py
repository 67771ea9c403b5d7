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
    """For fallback keys whose values were renamed (``state.backend: filesystem`` → ``hashmap``)."""
    secret: bool = False
    """A credential: never logged, printed or stored; on the command line (``-D``) it draws a warning."""
