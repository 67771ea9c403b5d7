"""The one retry mechanism: a backoff policy, an interruptible waiter, and the loop that uses them.

Every retry in the project (storage calls, the client's calls to TaskManagers and the
JobManager, the TaskManager's uploads, the Spark helper's batch attempts) goes through
:func:`call_with_retries` with a :class:`RetryPolicy`, so backoff, jitter, logging and
shutdown behave the same everywhere. What counts as transient is the caller's predicate.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from keyedstate.common.clock import SYSTEM_CLOCK, Clock
from keyedstate.common.errors import ConfigError, KeyedStateError, Reason, UnavailableError

logger = logging.getLogger(__name__)

T = TypeVar("T")


UNBOUNDED = 2**31
"""``max_attempts`` of a policy that only its deadline (or an interruption) ends."""


class Waiter(Protocol):
    """Waits out a backoff; returns True when interrupted (``threading.Event`` fits)."""

    def wait(self, timeout: float | None = None) -> bool:
        """Block up to ``timeout`` seconds (None: forever), as ``threading.Event.wait``.

        True when woken (e.g. shutdown was set): the caller stops retrying; False on timeout.
        """


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a call is retried on a transient error."""

    max_attempts: int = 5
    """Attempts in total, including the first."""
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.5
    """Each wait is reduced by a random fraction up to this, so that many callers retrying at
    once do not hit a server in lockstep. 0 makes waits exact (tests)."""
    deadline_s: float | None = None
    """Retry no longer than this after the first attempt began (on the clock given to
    :func:`call_with_retries`); the last wait is cut short so the last attempt starts at the
    deadline. None: only ``max_attempts`` bounds the retries."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"RetryPolicy.max_attempts must be at least 1, got {self.max_attempts}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.multiplier < 1:
            raise ConfigError("RetryPolicy backoffs must be >= 0 and the multiplier >= 1")
        if not 0 <= self.jitter <= 1:
            raise ConfigError(f"RetryPolicy.jitter must be within [0, 1], got {self.jitter}")
        if self.deadline_s is not None and self.deadline_s < 0:
            raise ConfigError(f"RetryPolicy.deadline_s must be >= 0, got {self.deadline_s}")

    @classmethod
    def polling(
        cls, interval_s: float, *, deadline_s: float | None = None, max_attempts: int = UNBOUNDED
    ) -> RetryPolicy:
        """Try again every ``interval_s``, exactly (no growth, no jitter), until ``deadline_s``
        or ``max_attempts``: waiting for a condition (a cluster to fill, a job to run) rather
        than backing off from an overloaded server."""
        return cls(
            max_attempts=max_attempts,
            initial_backoff_s=interval_s,
            multiplier=1.0,
            jitter=0.0,
            deadline_s=deadline_s,
        )

    def backoff_s(self, failed_attempts: int, rng: random.Random | None = None) -> float:
        """The wait after the ``failed_attempts``-th consecutive failure (1-based)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (failed_attempts - 1))
        if self.jitter:
            base *= 1.0 - (rng or random).random() * self.jitter
        return base


def _shutting_down(what: str) -> KeyedStateError:
    return UnavailableError(
        f"{what} abandoned while waiting to retry because the process is shutting down",
        reason=Reason.SHUTTING_DOWN,
    )


def call_with_retries(
    fn: Callable[[], T],
    *,
    what: str,
    policy: RetryPolicy,
    waiter: Waiter,
    is_transient: Callable[[BaseException], bool],
    interrupted: Callable[[str], KeyedStateError] = _shutting_down,
    clock: Clock = SYSTEM_CLOCK,
    immediate: Callable[[BaseException], bool] | None = None,
    log_level: int = logging.WARNING,
) -> T:
    """Run ``fn``; retry transient errors with backoff; re-raise the last one when exhausted.

    The caller maps what escapes (the final transient error or any permanent one). A waiter
    that reports an interruption (shutdown) ends the loop at once with ``interrupted(what)``.

    ``immediate``: transient errors worth retrying without a wait (the client after a stale
    routing: the fresh table is fetched by the retry itself); they do not grow the backoff.
    ``clock`` measures ``policy.deadline_s``. ``log_level``: hot paths that retry as a matter of
    course (the client) log at DEBUG.
    """
    deadline_ms = None if policy.deadline_s is None else clock.monotonic_ms() + int(policy.deadline_s * 1000)
    attempt = 1
    waits = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            if not is_transient(exc) or attempt >= policy.max_attempts:
                raise
            if immediate is not None and immediate(exc):
                delay = 0.0
            else:
                waits += 1
                delay = policy.backoff_s(waits)
            if deadline_ms is not None:
                left_s = (deadline_ms - clock.monotonic_ms()) / 1000.0
                if left_s <= 0:
                    raise
                delay = min(delay, left_s)
            logger.log(
                log_level,
                "%s failed (attempt %d of %d), retrying in %.2f s: %s",
                what,
                attempt,
                policy.max_attempts,
                delay,
                exc,
            )
            if waiter.wait(delay):
                raise interrupted(what) from exc
            attempt += 1
