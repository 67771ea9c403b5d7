"""The server side: one interceptor per served plane authenticates every call and authorizes it.

Identity comes from a peer certificate when the plane is mutual TLS and the interceptor is told
which role such peers have (the internal plane: ``certificate_role=Role.INTERNAL``), else from the
bearer token in the ``authorization`` metadata, looked up in the :class:`TokenStore`. Then the
method's rule (``_methods.RULES``) names the permission the role must grant and the job the
caller's scope must cover. A refusal is UNAUTHENTICATED (no or unknown identity) or
PERMISSION_DENIED (naming the permission, the roles that grant it and the job), logged without
the token and counted in ``keyedstate_<component>_auth_refused_total``.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

import grpc
from prometheus_client import CollectorRegistry

from keyedstate.common.auth._methods import RULES, MethodRule
from keyedstate.common.auth._roles import Principal, Role, roles_granting
from keyedstate.common.auth._tokens import TokenStore, fingerprint
from keyedstate.common.errors import AuthenticationError, KeyedStateError, PermissionDeniedError
from keyedstate.common.metrics import MetricKind, MetricSpec, Unit
from keyedstate.common.rpc.bearer import AUTHORIZATION, BEARER
from keyedstate.common.rpc.interceptors import HandlerWrappingInterceptor
from keyedstate.common.rpc.status import abort_with

logger = logging.getLogger(__name__)

_HOW_TO_AUTHENTICATE = (
    "give the client a token: security.auth.token-file (a file readable only by you) or the KEYEDSTATE_TOKEN / "
    "KEYEDSTATE_TOKEN_FILE environment variable"
)


def auth_refused_spec(component: str) -> MetricSpec:
    """The refusal counter of ``component`` (``jobmanager`` or ``taskmanager``), as docs/metrics.md lists it."""
    return MetricSpec(
        f"keyedstate_{component}_auth_refused",
        MetricKind.COUNTER,
        Unit.COUNT,
        "Calls refused by authentication (UNAUTHENTICATED) or authorization (PERMISSION_DENIED), by method.",
        ("method", "code"),
    )


class AuthMetrics:
    """Refused calls by method and status code (the caller's name is in the log, not a label)."""

    def __init__(self, registry: CollectorRegistry, component: str) -> None:
        self.refused = auth_refused_spec(component).counter(registry)

    def count(self, method: str, code: grpc.StatusCode) -> None:
        """Count one refused call; methods missing from the rule table share the label ``unknown``."""
        # Unknown methods share one label: a caller must not grow the label set at will.
        label = method.rsplit("/", 1)[-1] if method in RULES else "unknown"
        self.refused.labels(label, code.name).inc()


def certificate_name(context: grpc.ServicerContext) -> str | None:
    """The verified peer certificate's common name (or first SAN), when the call came over mutual TLS."""
    try:
        auth = context.auth_context() or {}
    except Exception:  # an insecure port has no auth context to speak of
        return None
    if b"ssl" not in auth.get("transport_security_type", []):
        return None
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        found: bytes | list[bytes] = auth.get(key) or []
        values = [found] if isinstance(found, bytes) else list(found)
        if values:
            return values[0].decode("utf-8", "replace")
    return None


class AuthInterceptor(HandlerWrappingInterceptor):
    """Authenticates and authorizes every call on one server (one plane)."""

    def __init__(
        self,
        tokens: TokenStore | None,
        metrics: AuthMetrics,
        *,
        component: str,
        certificate_role: Role | None = None,
        rules: dict[str, MethodRule] | None = None,
    ) -> None:
        super().__init__()
        self._tokens = tokens
        self._metrics = metrics
        self._component = component
        self._certificate_role = certificate_role
        self._rules = RULES if rules is None else rules

    def wrap(self, method: str, handler: Any) -> Any:
        """The handler behind authentication and authorization by the method's rule.

        A method without a rule is refused (PERMISSION_DENIED); where the rule says so, the response
        is narrowed to the caller's job scope.
        """
        rule = self._rules.get(method)
        check = self._check

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
                principal = check(method, rule, request, context)
                response = inner(request, context)
                if rule is not None and rule.restrict is not None and principal is not None:
                    response = rule.restrict(principal, response)
                return response

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Any:
                check(method, rule, request, context)
                yield from inner_stream(request, context)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        # Client-streaming calls carry their job in a later message; none is served today, and
        # one added later is authenticated here and authorized on its permission alone.
        if handler.stream_unary is not None:
            inner_su = handler.stream_unary

            def stream_unary(requests: Any, context: grpc.ServicerContext) -> Any:
                check(method, rule, None, context)
                return inner_su(requests, context)

            return grpc.stream_unary_rpc_method_handler(
                stream_unary, handler.request_deserializer, handler.response_serializer
            )
        inner_ss = handler.stream_stream

        def stream_stream(requests: Any, context: grpc.ServicerContext) -> Any:
            check(method, rule, None, context)
            yield from inner_ss(requests, context)

        return grpc.stream_stream_rpc_method_handler(
            stream_stream, handler.request_deserializer, handler.response_serializer
        )

    # -- the checks --------------------------------------------------------------------------
    def _check(
        self, method: str, rule: MethodRule | None, request: Any, context: grpc.ServicerContext
    ) -> Principal | None:
        try:
            return self._authorize(method, rule, request, context)
        except KeyedStateError as exc:
            code = (
                grpc.StatusCode.UNAUTHENTICATED
                if isinstance(exc, AuthenticationError)
                else grpc.StatusCode.PERMISSION_DENIED
            )
            self._metrics.count(method, code)
            abort_with(context, exc)
            raise  # abort_with raises; this keeps type checkers content

    def _authorize(
        self, method: str, rule: MethodRule | None, request: Any, context: grpc.ServicerContext
    ) -> Principal | None:
        principal, presented = self._authenticate(context)
        name = method.rsplit("/", 1)[-1]
        if rule is None:
            self._refuse(
                method,
                context,
                principal,
                f"{method} has no permission defined on this {self._component}, so "
                "every caller is refused; this is a bug in keyedstate (report it)",
            )
        assert rule is not None
        permission = rule.permission_for(request) if request is not None or not callable(rule.permission) else None
        if permission is not None and permission.value == "public":
            return principal
        if principal is None:
            if presented is None:
                message = (
                    f"{name} needs an identity: this {self._component} requires authentication "
                    f"(security.auth.enabled) and the call carried no token; {_HOW_TO_AUTHENTICATE}"
                )
            else:
                message = (
                    f"{name} was refused: the token is not accepted by this {self._component} (mistyped, revoked, "
                    f"or issued for another cluster); check the token, or ask for a token in "
                    f"security.auth.tokens-file"
                )
            logger.warning(
                "auth: UNAUTHENTICATED %s from %s: %s",
                method,
                context.peer(),
                "no token" if presented is None else f"unknown token {fingerprint(presented)}",
            )
            raise AuthenticationError(message)
        if permission is None or not principal.may(permission):
            needed = permission.value if permission is not None else "(unknown)"
            roles = " or ".join(r.value for r in roles_granting(permission)) if permission is not None else "none"
            self._refuse(
                method,
                context,
                principal,
                f"{principal.describe()} may not call {name}: it needs permission {needed} "
                f"(role {roles})" + self._job_phrase(rule, request),
            )
        if rule.job is not None and request is not None:
            job = rule.job(request)
            if not principal.covers(job):
                self._refuse(
                    method,
                    context,
                    principal,
                    f"{principal.describe()} has no access to job {job!r}: {name} needs permission "
                    f"{permission.value} on job {job!r}; use a token whose jobs include {job!r}",
                )
        return principal

    @staticmethod
    def _job_phrase(rule: MethodRule, request: Any) -> str:
        if rule.job is None or request is None:
            return ""
        return f" on job {rule.job(request)!r}"

    def _refuse(
        self, method: str, context: grpc.ServicerContext, principal: Principal | None, message: str
    ) -> NoReturn:
        logger.warning("auth: PERMISSION_DENIED %s from %s: %s", method, context.peer(), message)
        raise PermissionDeniedError(message)

    def _authenticate(self, context: grpc.ServicerContext) -> tuple[Principal | None, str | None]:
        """(identity or None, the token presented or None)."""
        if self._certificate_role is not None:
            name = certificate_name(context)
            if name is not None:
                return Principal(name, self._certificate_role, None, "certificate"), None
        token: str | None = None
        for key, raw in context.invocation_metadata() or ():
            if key == AUTHORIZATION:
                # An ASCII header's value is str; a binary one would be bytes (never a valid token).
                value = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
                token = value[len(BEARER) :].strip() if value.startswith(BEARER) else value.strip()
                break
        if not token or self._tokens is None:
            return None, token or None
        return self._tokens.lookup(token), token
