"""The retry loop's deadline (driven by the injected clock) and its immediate retries."""

from __future__ import annotations

import pytest

from keyedstate.common.errors import ConfigError
from keyedstate.common.retry import RetryPolicy, call_with_retries


class FakeTime:
    """A clock and a waiter in one: waiting advances the clock, nothing sleeps."""

    def __init__(self) -> None:
        self.ms = 0
        self.waits: list[float] = []

    def now_ms(self) -> int:
        return self.ms

    def monotonic_ms(self) -> int:
        return self.ms

    def boottime_ms(self) -> int:
        return self.ms

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout or 0.0)
        self.ms += int((timeout or 0.0) * 1000)
        return False


class Flaky(Exception):
    pass


def failing(times: list[int], clock: FakeTime):  # type: ignore[no-untyped-def]
    def fn() -> str:
        times.append(clock.ms)
        raise Flaky("not yet")

    return fn


def test_a_deadline_ends_the_retries_and_the_last_wait_is_cut_to_it() -> None:
    clock = FakeTime()
    times: list[int] = []
    policy = RetryPolicy(max_attempts=1000, initial_backoff_s=0.3, multiplier=1.0, jitter=0.0, deadline_s=1.0)
    with pytest.raises(Flaky):
        call_with_retries(
            failing(times, clock),
            what="probe",
            policy=policy,
            waiter=clock,
            is_transient=lambda e: isinstance(e, Flaky),
            clock=clock,
        )
    assert times == [0, 300, 600, 900, 1000]  # the last attempt starts at the deadline, none after it
    assert clock.waits == [0.3, 0.3, 0.3, pytest.approx(0.1)]


def test_max_attempts_still_bounds_a_policy_with_a_deadline() -> None:
    clock = FakeTime()
    times: list[int] = []
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.1, jitter=0.0, deadline_s=60.0)
    with pytest.raises(Flaky):
        call_with_retries(
            failing(times, clock), what="probe", policy=policy, waiter=clock, is_transient=lambda e: True, clock=clock
        )
    assert len(times) == 3


def test_immediate_errors_are_retried_without_a_wait_and_do_not_grow_the_backoff() -> None:
    clock = FakeTime()
    errors = [Flaky("stale"), Flaky("down"), Flaky("stale"), Flaky("down")]

    def fn() -> str:
        if errors:
            raise errors.pop(0)
        return "ok"

    policy = RetryPolicy(max_attempts=10, initial_backoff_s=0.1, multiplier=2.0, jitter=0.0)
    result = call_with_retries(
        fn,
        what="call",
        policy=policy,
        waiter=clock,
        is_transient=lambda e: True,
        immediate=lambda e: str(e) == "stale",
    )
    assert result == "ok"
    assert clock.waits == [0.0, 0.1, 0.0, 0.2]


def test_a_negative_deadline_is_refused() -> None:
    with pytest.raises(ConfigError, match="deadline_s"):
        RetryPolicy(deadline_s=-1)


def test_a_polling_policy_tries_at_a_fixed_interval_until_its_deadline_or_its_attempts() -> None:
    clock = FakeTime()
    times: list[int] = []
    with pytest.raises(Flaky):
        call_with_retries(
            failing(times, clock),
            what="poll",
            policy=RetryPolicy.polling(0.25, deadline_s=1.0),
            waiter=clock,
            is_transient=lambda e: isinstance(e, Flaky),
            clock=clock,
        )
    assert times == [0, 250, 500, 750, 1000]  # no growth, no jitter; only the deadline ends it
    clock, times = FakeTime(), []
    with pytest.raises(Flaky):
        call_with_retries(
            failing(times, clock),
            what="poll",
            policy=RetryPolicy.polling(0.25, max_attempts=3),
            waiter=clock,
            is_transient=lambda e: isinstance(e, Flaky),
            clock=clock,
        )
    assert times == [0, 250, 500]
