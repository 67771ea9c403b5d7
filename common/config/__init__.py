"""Flink-style configuration: typed options, YAML files, ``-D key=value`` overrides."""

from keyedstate.common.config import options
from keyedstate.common.config._configuration import Configuration
from keyedstate.common.config._option import ConfigOption
from keyedstate.common.config._parsers import parse_duration_ms, parse_memory_bytes
from keyedstate.common.config._secrets import (
    REDACTED,
    SAFER_WAYS,
    is_secret_key,
    redact_value,
    redacted,
    secret_overrides,
)

__all__ = [
    "REDACTED",
    "SAFER_WAYS",
    "ConfigOption",
    "Configuration",
    "is_secret_key",
    "options",
    "parse_duration_ms",
    "parse_memory_bytes",
    "redact_value",
    "redacted",
    "secret_overrides",
]
