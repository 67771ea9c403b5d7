"""Which configuration values are secrets, and how they are kept out of logs, output and storage.

A key is secret when its option says so (``ConfigOption.secret``) or when its name looks like a
credential (Flink's rule for ``GlobalConfiguration.isSensitive``: it contains ``password``,
``secret``, ``token`` …). Keys naming a *file* that holds a secret (``security.auth.token-file``)
are not secrets themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from keyedstate.common.config import options

REDACTED = "******"

_SENSITIVE_WORDS = (
    "password",
    "passwd",
    "secret",
    "token",
    "credential",
    "apikey",
    "api-key",
    "api_key",
    "access-key",
    "access.key",
    "access_key",
    "private-key",
    "private.key",
    "auth-params",
    "service-key",
    "basic-auth",
    "jaas.config",
    "account.key",
    "session-key",
)
# A path to a secret is not the secret (and operators need to see which file is used).
_FILE_SUFFIXES = ("-file", ".file", "_file", "-path", ".path", "-dir", ".dir")

SAFER_WAYS = (
    "put it in the config file (--config, readable by the daemon's user only: chmod 600), "
    "or use the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for S3, KEYEDSTATE_TOKEN or "
    "security.auth.token-file for tokens)"
)


def is_secret_key(key: str, secret_keys: Iterable[str] = ()) -> bool:
    """True if the value of ``key`` is a credential that must never be shown."""
    lowered = key.strip().lower()
    if lowered in secret_keys:
        return True
    if lowered.endswith(_FILE_SUFFIXES):
        return False
    return any(word in lowered for word in _SENSITIVE_WORDS)


def declared_secret_keys() -> frozenset[str]:
    """The keys (and legacy keys) of every option marked ``secret``."""
    keys: set[str] = set()
    for option in options.ALL:
        if option.secret:
            keys.add(option.key.lower())
            keys.update(k.lower() for k in option.fallback_keys)
    return frozenset(keys)


def redact_value(key: str, value: Any) -> Any:
    """``value``, or ``******`` when ``key`` is secret."""
    return REDACTED if is_secret_key(key, declared_secret_keys()) else value


def redacted(values: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``values`` with every secret value replaced by ``******``."""
    secret = declared_secret_keys()
    return {k: (REDACTED if is_secret_key(k, secret) else v) for k, v in values.items()}


def secret_overrides(overrides: Iterable[str]) -> list[str]:
    """The keys of ``-D key=value`` overrides whose values are secrets (they show in ``ps``)."""
    secret = declared_secret_keys()
    keys = []
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key and is_secret_key(key, secret):
            keys.append(key)
    return keys
