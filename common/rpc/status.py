"""The one table between domain errors and gRPC status codes, both directions.

Servicers call :func:`abort_with` (via :func:`rpc_method`) and clients call :func:`from_rpc_error`;
nothing else in the code base looks at ``grpc.StatusCode``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar, cast

import grpc

from keyedstate.common import errors as e
from keyedstate.common.security.tls import handshake_hint

logger = logging.getLogger(__name__)

REASON_KEY = "x-keyedstate-reason"
ROUTING_VERSION_KEY = "x-keyedstate-routing-version"

_CODES: dict[e.Reason, grpc.StatusCode] = {
    e.Reason.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    e.Reason.CONFIG: grpc.StatusCode.INVALID_ARGUMENT,
    e.Reason.UNKNOWN_JOB: grpc.StatusCode.NOT_FOUND,
    e.Reason.UNKNOWN_OPERATOR: grpc.StatusCode.NOT_FOUND,
    e.Reason.UNKNOWN_STATE: grpc.StatusCode.NOT_FOUND,
    e.Reason.UNKNOWN_SUBTASK: grpc.StatusCode.NOT_FOUND,
    e.Reason.WRONG_STATE_KIND: grpc.StatusCode.FAILED_PRECONDITION,
    e.Reason.STALE_ROUTING: grpc.StatusCode.FAILED_PRECONDITION,
    e.Reason.SIZE_LIMIT: grpc.StatusCode.INVALID_ARGUMENT,
    e.Reason.INSUFFICIENT_SLOTS: grpc.StatusCode.RESOURCE_EXHAUSTED,
    e.Reason.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    e.Reason.JOB_NOT_RUNNING: grpc.StatusCode.UNAVAILABLE,
    e.Reason.EPOCH_CONFLICT: grpc.StatusCode.ABORTED,
    e.Reason.EPOCH_GAP: grpc.StatusCode.FAILED_PRECONDITION,
    e.Reason.CHECKPOINT_FAILED: grpc.StatusCode.ABORTED,
    e.Reason.CORRUPT_CHECKPOINT: grpc.StatusCode.DATA_LOSS,
    e.Reason.INCOMPATIBLE_CHECKPOINT: grpc.StatusCode.FAILED_PRECONDITION,
    e.Reason.STORAGE: grpc.StatusCode.UNAVAILABLE,
    e.Reason.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    e.Reason.SHUTTING_DOWN: grpc.StatusCode.UNAVAILABLE,
    e.Reason.LEASE_EXPIRED: grpc.StatusCode.UNAVAILABLE,
    e.Reason.OUTCOME_UNKNOWN: grpc.StatusCode.UNAVAILABLE,
    e.Reason.EPOCH_NOT_APPLIED: grpc.StatusCode.UNAVAILABLE,
    e.Reason.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    e.Reason.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    e.Reason.WRONG_CLUSTER: grpc.StatusCode.FAILED_PRECONDITION,
    e.Reason.INTERNAL: grpc.StatusCode.INTERNAL,
}

_CLASSES: dict[e.Reason, type[e.KeyedStateError]] = {
    e.Reason.INVALID_ARGUMENT: e.InvalidArgumentError,
    e.Reason.CONFIG: e.ConfigError,
    e.Reason.UNKNOWN_JOB: e.NotFoundError,
    e.Reason.UNKNOWN_OPERATOR: e.NotFoundError,
    e.Reason.UNKNOWN_STATE: e.NotFoundError,
    e.Reason.UNKNOWN_SUBTASK: e.NotFoundError,
    e.Reason.WRONG_STATE_KIND: e.WrongStateKindError,
    e.Reason.SIZE_LIMIT: e.SizeLimitError,
    e.Reason.INSUFFICIENT_SLOTS: e.CapacityError,
    e.Reason.ALREADY_EXISTS: e.AlreadyExistsError,
    e.Reason.JOB_NOT_RUNNING: e.JobStateError,
    e.Reason.EPOCH_CONFLICT: e.EpochConflictError,
    e.Reason.EPOCH_GAP: e.EpochGapError,
    e.Reason.CHECKPOINT_FAILED: e.CheckpointError,
    e.Reason.CORRUPT_CHECKPOINT: e.CorruptCheckpointError,
    e.Reason.INCOMPATIBLE_CHECKPOINT: e.IncompatibleCheckpointError,
    e.Reason.STORAGE: e.StorageError,
    e.Reason.UNAVAILABLE: e.UnavailableError,
    e.Reason.SHUTTING_DOWN: e.UnavailableError,
    e.Reason.LEASE_EXPIRED: e.UnavailableError,
    e.Reason.OUTCOME_UNKNOWN: e.UnavailableError,
    e.Reason.EPOCH_NOT_APPLIED: e.UnavailableError,
    e.Reason.UNAUTHENTICATED: e.AuthenticationError,
    e.Reason.PERMISSION_DENIED: e.PermissionDeniedError,
    e.Reason.WRONG_CLUSTER: e.ClusterMismatchError,
}


def status_code(error: e.KeyedStateError) -> grpc.StatusCode:
    return _CODES.get(error.reason, grpc.StatusCode.INTERNAL)


MAX_DETAILS_WIRE_BYTES = 4096
"""The status message travels percent-encoded in a header; gRPC clients drop the whole answer
(RESOURCE_EXHAUSTED "metadata size exceeds hard limit", 16 KiB) when it is too large, losing the
status code and reason. Messages that echo a huge input (a 1 MiB state name) are cut to this."""


def _wire_size(text: str) -> int:
    return sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in text.encode("utf-8", "surrogatepass"))


def bounded_details(message: str) -> str:
    """``message`` itself, or its start and end around an ellipsis when its header would be too large."""
    if len(message) * 12 <= MAX_DETAILS_WIRE_BYTES or _wire_size(message) <= MAX_DETAILS_WIRE_BYTES:
        return message
    head, tail = 1200, 400  # the end usually names the fix
    while True:
        cut = f"{message[:head]} … [{len(message) - head - tail} characters cut] … {message[-tail:]}"
        if _wire_size(cut) <= MAX_DETAILS_WIRE_BYTES:
            return cut
        head, tail = head // 2, tail // 2


def abort_with(context: grpc.ServicerContext, error: e.KeyedStateError) -> None:
    """Abort the call with the error's status code, message and reason (never returns)."""
    metadata: list[tuple[str, str]] = [(REASON_KEY, error.reason.value)]
    if isinstance(error, e.StaleRoutingError):
        metadata.append((ROUTING_VERSION_KEY, str(error.current_version)))
    context.set_trailing_metadata(tuple(metadata))
    context.abort(status_code(error), bounded_details(error.message))


F = TypeVar("F", bound=Callable[..., Any])


def rpc_method(fn: F) -> F:
    """Decorate a servicer method: domain errors become gRPC statuses, bugs become INTERNAL.

    Works for unary methods and for server-streaming generators.
    """
    import inspect

    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def stream_wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            try:
                yield from fn(self, request, context)
            except e.KeyedStateError as exc:
                abort_with(context, exc)
            except Exception as exc:  # a bug must not kill the server or leak a traceback
                if _is_abort(exc):
                    raise
                logger.exception("unexpected error in %s", fn.__name__)
                abort_with(context, e.KeyedStateError(f"internal error in {fn.__name__}: {exc!r}"))

        return stream_wrapper  # type: ignore[return-value]

    @functools.wraps(fn)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except e.KeyedStateError as exc:
            abort_with(context, exc)
        except Exception as exc:
            if _is_abort(exc):
                raise
            logger.exception("unexpected error in %s", fn.__name__)
            abort_with(context, e.KeyedStateError(f"internal error in {fn.__name__}: {exc!r}"))

    return wrapper  # type: ignore[return-value]


def _is_abort(exc: Exception) -> bool:
    # context.abort() raises a plain Exception subclass private to grpc; let it through.
    return type(exc).__module__.startswith("grpc")


def from_rpc_error(err: grpc.RpcError, what: str = "", plane: str = "rest") -> e.KeyedStateError:
    """Turn a gRPC error received by a client into the matching typed domain error.

    A connection that failed in the TLS handshake gets what to fix appended, with the keys of
    ``plane`` (``rest`` for clients, ``internal`` between the daemons).
    """
    call = _as_call(err)
    code = _code(call) if call is not None else grpc.StatusCode.UNKNOWN
    details = (call.details() if call is not None else None) or str(err)
    trailing: dict[str, str] = {}
    if call is not None:
        for key, value in call.trailing_metadata() or ():
            trailing[key] = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    reason_value = trailing.get(REASON_KEY)
    prefix = f"{what}: " if what else ""
    if reason_value is not None:
        try:
            reason = e.Reason(reason_value)
        except ValueError:
            reason = e.Reason.INTERNAL
        if reason is e.Reason.STALE_ROUTING:
            version = int(trailing.get(ROUTING_VERSION_KEY, "0") or 0)
            return e.StaleRoutingError(prefix + details, current_version=version)
        cls = _CLASSES.get(reason, e.KeyedStateError)
        return cls(prefix + details, reason=reason)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        hint = handshake_hint(details, plane) if code is grpc.StatusCode.UNAVAILABLE else None
        return e.UnavailableError(f"{prefix}{code.name}: {details}" + (f" ({hint})" if hint else ""))
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return e.SizeLimitError(f"{prefix}{details}")
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return e.AuthenticationError(f"{prefix}{details}")
    if code is grpc.StatusCode.PERMISSION_DENIED:
        return e.PermissionDeniedError(f"{prefix}{details}")
    return e.KeyedStateError(f"{prefix}{code.name}: {details}")


def status_name(err: grpc.RpcError) -> str:
    """The status code's name of a received error (for logs): ``UNAVAILABLE``, ``DEADLINE_EXCEEDED``, ..."""
    call = _as_call(err)
    code = _code(call) if call is not None else grpc.StatusCode.UNKNOWN
    return str(code.name)


def is_unreachable(exc: BaseException) -> bool:
    """Whether a call failed because the server could not be reached (UNAVAILABLE): worth retrying as is."""
    call = _as_call(exc) if isinstance(exc, grpc.RpcError) else None
    return call is not None and _code(call) is grpc.StatusCode.UNAVAILABLE


def _as_call(err: BaseException) -> grpc.Call | None:
    """The error as the call it came from. grpc raises errors that are both RpcError and Call,
    which its type stubs cannot express (the two declare incompatible methods), hence the cast."""
    return cast(grpc.Call, err) if hasattr(err, "code") and hasattr(err, "details") else None


def _code(call: grpc.Call) -> grpc.StatusCode:
    # Through the grpc.Call type, not the narrowed RpcError-and-Call intersection, whose method
    # mypy does not count as grpc's own (untyped_calls_exclude).
    code: grpc.StatusCode = call.code()
    return code
