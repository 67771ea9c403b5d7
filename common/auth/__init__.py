"""Identity and authorization: tokens, roles, the per-method permission table, the interceptors.

Server side, a daemon builds one :class:`AuthInterceptor` per plane it serves
(:func:`server_interceptors`); client side, :func:`resolve_token` finds this process's token and
:class:`BearerTokenInterceptor` sends it. ``docs/security.md`` describes the model.
"""

from __future__ import annotations

from typing import Any

from keyedstate.common.auth._credentials import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    read_token_file,
    resolve_token,
    token_from_config,
)
from keyedstate.common.auth._interceptor import AuthInterceptor, AuthMetrics, auth_refused_spec, certificate_name
from keyedstate.common.auth._methods import RULES, SERVICE_RULES, MethodRule
from keyedstate.common.auth._roles import ALL_JOBS, ROLE_PERMISSIONS, Permission, Principal, Role, roles_granting
from keyedstate.common.auth._tokens import (
    TokenEntry,
    TokenStore,
    fingerprint,
    hash_token,
    new_token,
    parse_entry,
    parse_tokens,
)
from keyedstate.common.rpc.bearer import BearerTokenInterceptor


def server_interceptors(
    conf: Any, metrics: AuthMetrics, component: str, *, certificate_role: Role | None = None
) -> list[AuthInterceptor]:
    """The interceptors of one served plane: none when ``security.auth.enabled`` is off.

    ``certificate_role``: the role of a caller that presents a verified client certificate
    (the internal mTLS plane passes ``Role.INTERNAL``); None accepts tokens only.
    """
    from keyedstate.common.config import options as o
    from keyedstate.common.errors import ConfigError

    if not conf.get(o.AUTH_ENABLED):
        return []
    path = conf.get(o.AUTH_TOKENS_FILE)
    if not path and certificate_role is None:
        raise ConfigError(
            "security.auth.enabled is true but security.auth.tokens-file is not set; point it at the YAML file of "
            "accepted token hashes (statectl auth token creates entries)"
        )
    tokens = TokenStore(path) if path else None
    return [AuthInterceptor(tokens, metrics, component=component, certificate_role=certificate_role)]


def internal_token(conf: Any, component: str, role: str, *, internal_tls: bool) -> str | None:
    """The token a daemon presents to the other daemons, when auth is on.

    With ``security.ssl.internal.enabled`` the internal plane authenticates by certificate and
    no token is needed; otherwise auth without one would refuse every internal call, so it is a
    ConfigError at start-up.
    """
    from keyedstate.common.config import options as o
    from keyedstate.common.errors import ConfigError

    if not conf.get(o.AUTH_ENABLED):
        return None
    token = token_from_config(conf)
    if token is None and not internal_tls:
        raise ConfigError(
            f"security.auth.enabled is true, so the {component} needs its own token (role {role}) for its calls to the "
            f"other daemons: put it in a file named by security.auth.token-file (chmod 600), or in KEYEDSTATE_TOKEN_FILE / "
            f"KEYEDSTATE_TOKEN; or enable internal mutual TLS (security.ssl.internal.enabled)"
        )
    return token


__all__ = [
    "ALL_JOBS",
    "ROLE_PERMISSIONS",
    "RULES",
    "SERVICE_RULES",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "AuthInterceptor",
    "AuthMetrics",
    "BearerTokenInterceptor",
    "MethodRule",
    "Permission",
    "Principal",
    "Role",
    "TokenEntry",
    "TokenStore",
    "auth_refused_spec",
    "certificate_name",
    "fingerprint",
    "hash_token",
    "internal_token",
    "new_token",
    "parse_entry",
    "parse_tokens",
    "read_token_file",
    "resolve_token",
    "roles_granting",
    "server_interceptors",
    "token_from_config",
]
