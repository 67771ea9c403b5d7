"""Who may read what over REST: the gRPC API's bearer tokens, roles and job scopes, checked per request.

With ``security.auth.enabled`` every JSON endpoint needs ``Authorization: Bearer <token>`` with a
token of ``security.auth.tokens-file`` (the same file, roles and scopes as the gRPC client plane,
docs/security.md): cluster-wide documents need ``cluster.view``, a job's documents ``job.view``
on that job, and the job lists show only the jobs the token covers. The page's own files and
the OpenAPI document carry no cluster data and are served to anyone, so a browser can load the
page and then ask for a token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from keyedstate.common.auth import Permission, Principal, TokenStore, fingerprint, roles_granting
from keyedstate.common.config import Configuration
from keyedstate.common.config import options as o
from keyedstate.common.errors import AuthenticationError, ConfigError, PermissionDeniedError

logger = logging.getLogger(__name__)

BEARER = "Bearer "

_HOW = (
    "send the header 'Authorization: Bearer <token>' with a token of security.auth.tokens-file "
    "(statectl auth token creates one; the web page asks for it)"
)


@dataclass(frozen=True)
class Caller:
    """The identity of one REST request; ``principal`` None means auth is off (everything is readable)."""

    principal: Principal | None

    def covers(self, job_id: str) -> bool:
        """True if the caller may see ``job_id``."""
        return self.principal is None or self.principal.covers(job_id)


OPEN = Caller(None)


class RestAccess:
    """Authenticates a request's bearer token and authorizes what it reads (a no-op with auth off)."""

    def __init__(self, tokens: TokenStore | None) -> None:
        self._tokens = tokens

    @classmethod
    def from_config(cls, conf: Configuration) -> RestAccess:
        """Off unless ``security.auth.enabled``; then ``security.auth.tokens-file`` is required."""
        if not conf.get(o.AUTH_ENABLED):
            return cls(None)
        path = conf.get(o.AUTH_TOKENS_FILE)
        if not path:
            raise ConfigError(
                "security.auth.enabled is true but security.auth.tokens-file is not set; the REST API (rest.port) "
                "checks the same tokens as the gRPC API: point it at the YAML file of accepted token hashes"
            )
        return cls(TokenStore(path))

    @property
    def enabled(self) -> bool:
        """True when requests need a token."""
        return self._tokens is not None

    def authenticate(self, authorization: str | None, peer: str) -> Caller:
        """The caller behind an ``Authorization`` header; AuthenticationError (HTTP 401) if none or unknown."""
        if self._tokens is None:
            return OPEN
        value = (authorization or "").strip()
        token = value[len(BEARER) :].strip() if value.startswith(BEARER) else value
        if not token:
            logger.warning("rest: 401 from %s: no token", peer)
            raise AuthenticationError(f"this JobManager requires authentication (security.auth.enabled): {_HOW}")
        principal = self._tokens.lookup(token)
        if principal is None:
            logger.warning("rest: 401 from %s: unknown token %s", peer, fingerprint(token))
            raise AuthenticationError(
                "the token is not accepted by this JobManager (mistyped, revoked, or issued for another cluster); "
                "check it, or ask for a token in security.auth.tokens-file"
            )
        return Caller(principal)

    @staticmethod
    def require(caller: Caller, permission: Permission, job_id: str | None = None) -> None:
        """PermissionDeniedError (HTTP 403) unless the caller's role grants ``permission`` (on ``job_id``)."""
        principal = caller.principal
        if principal is None:
            return
        if not principal.may(permission):
            roles = " or ".join(r.value for r in roles_granting(permission))
            raise PermissionDeniedError(
                f"{principal.describe()} may not read this: it needs permission {permission.value} (role {roles})"
            )
        if job_id is not None and not principal.covers(job_id):
            raise PermissionDeniedError(
                f"{principal.describe()} has no access to job {job_id!r}: use a token whose jobs include {job_id!r}"
            )
