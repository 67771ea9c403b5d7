"""Size limits a slot enforces on every call (so one bad request cannot exhaust a TaskManager)."""

from __future__ import annotations

from dataclasses import dataclass

from keyedstate.common.config import Configuration, options
from keyedstate.common.errors import ConfigError

_KEYS = {
    "max_key_bytes": options.MAX_KEY_BYTES.key,
    "max_value_bytes": options.MAX_VALUE_BYTES.key,
    "max_list_response_bytes": options.MAX_LIST_RESPONSE_BYTES.key,
    "max_list_elements": options.MAX_LIST_ELEMENTS.key,
}
"""The configuration key of each limit, for messages."""


@dataclass(frozen=True)
class StateLimits:
    max_key_bytes: int = 64 << 10
    """Largest key, namespace or map user key (``state.limits.max-key-bytes``)."""
    max_value_bytes: int = 16 << 20
    """Largest value, list element or reduce operand (``state.limits.max-value-bytes``)."""
    max_list_response_bytes: int = 64 << 20
    """Largest total of one ListGet answer (``state.limits.list.max-response-bytes``)."""
    max_list_elements: int = 10_000_000
    """Most elements one list may hold (``state.limits.list.max-elements``)."""

    def __post_init__(self) -> None:
        for name, key in _KEYS.items():
            if getattr(self, name) < 1:
                raise ConfigError(f"{key}: must be at least 1, got {getattr(self, name)}")

    @classmethod
    def from_config(cls, conf: Configuration) -> StateLimits:
        return cls(
            max_key_bytes=conf.get(options.MAX_KEY_BYTES),
            max_value_bytes=conf.get(options.MAX_VALUE_BYTES),
            max_list_response_bytes=conf.get(options.MAX_LIST_RESPONSE_BYTES),
            max_list_elements=conf.get(options.MAX_LIST_ELEMENTS),
        )
