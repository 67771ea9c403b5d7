"""TaskManager leases: the arithmetic, the clock-rate bound, and the Lease object on a manual clock."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from fractions import Fraction
from typing import Any

import pytest

from keyedstate.common.config import Configuration
from keyedstate.common.errors import ConfigError, Reason, UnavailableError
from keyedstate.common.ids import TaskManagerId
from keyedstate.common.lease import Lease, SharedLeaseCell, lease_bound_ms, lease_duration_ms
from keyedstate.jobmanager.registry import TaskManagerRegistry
from keyedstate.jobmanager.settings import JobManagerSettings
from tests.fakes.clock import ManualClock
from tests.fakes.scheduler import ManualScheduler

RHO = Fraction(1, 10)
INTERVALS = (10, 50, 100, 200, 1_000, 3_000, 10_000)
TIMEOUT_FACTORS = (
    Fraction(11, 10),
    Fraction(2),
    Fraction(5, 2),
    Fraction(3),
    Fraction(5),
    Fraction(7),
    Fraction(10),
    Fraction(30),
)


def settings(interval_ms: int, timeout_ms: int) -> JobManagerSettings:
    return JobManagerSettings.from_config(
        Configuration({"heartbeat.interval": f"{interval_ms} ms", "heartbeat.timeout": f"{timeout_ms} ms"})
    )


def accepted_settings() -> list[JobManagerSettings]:
    out = []
    for interval in INTERVALS:
        for factor in TIMEOUT_FACTORS:
            try:
                out.append(settings(interval, int(interval * factor)))
            except ConfigError:
                pass
    return out


# -- arithmetic --------------------------------------------------------------------------------
def test_lease_duration_is_the_smaller_of_80_percent_of_the_timeout_and_5_intervals() -> None:
    assert lease_duration_ms(50_000, 10_000) == 40_000  # the defaults: the timeout decides
    assert lease_duration_ms(10_000, 200) == 1_000  # the in-process test cluster: five intervals decide
    assert lease_duration_ms(2_500, 1_000) == 2_000
    assert lease_duration_ms(1_001, 1_000) == 800  # int() of 800.8


def test_lease_bound_is_never_below_l_times_11_over_9() -> None:
    # Never below L(1+rho)/(1-rho) in exact arithmetic (float rounding may only add a safe ms), for every L.
    for duration in range(200_001):
        exact = Fraction(duration) * (1 + RHO) / (1 - RHO)
        bound = lease_bound_ms(duration)
        assert exact <= bound <= exact + 1, (duration, bound, exact)
    assert lease_bound_ms(40_000) == 48_889
    assert lease_bound_ms(9) in (11, 12)


def test_settings_accept_exactly_the_heartbeats_a_lease_can_cover() -> None:
    for interval in range(1, 3_001):
        for timeout in (
            interval,
            interval + 1,
            2 * interval,
            (5 * interval) // 2,
            (5 * interval) // 2 + 1,
            3 * interval,
        ):
            covers = timeout > interval and lease_duration_ms(timeout, interval) >= 2 * interval
            try:
                s = settings(interval, timeout)
            except ConfigError:
                assert not covers, (interval, timeout)
                continue
            assert covers, (interval, timeout)
            assert s.lease_duration_ms == lease_duration_ms(timeout, interval)
            assert s.lease_bound_ms == lease_bound_ms(s.lease_duration_ms)
            # Declared lost by heartbeat timeout (now - last > timeout) means already fenced (now >= last + bound).
            assert s.lease_bound_ms <= timeout, (interval, timeout, s.lease_bound_ms)


@pytest.mark.parametrize("interval", [1, 3, 7, 10, 99, 200, 333, 1_000, 9_999, 10_000])
def test_a_too_short_timeout_is_refused_naming_a_timeout_that_is_then_accepted(interval: int) -> None:
    with pytest.raises(ConfigError) as info:
        settings(interval, 2 * interval)
    message = info.value.message
    assert f"heartbeat.timeout ({2 * interval} ms) is too short for heartbeat.interval ({interval} ms)" in message
    assert "must cover 2 heartbeats" in message and "or lower heartbeat.interval" in message
    suggested = int(re.search(r"raise heartbeat\.timeout to at least (\d+) ms", message).group(1))  # type: ignore[union-attr]
    assert settings(interval, suggested).lease_duration_ms >= 2 * interval
    # And it is the least such timeout.
    with pytest.raises(ConfigError):
        settings(interval, suggested - 1)


def test_a_timeout_not_above_the_interval_is_refused() -> None:
    with pytest.raises(
        ConfigError, match=r"heartbeat\.timeout \(1000 ms\) must be larger than heartbeat\.interval \(1000 ms\)"
    ):
        settings(1_000, 1_000)


# -- the clock bound -----------------------------------------------------------------------------
def test_a_lease_from_the_send_time_ends_before_the_bound_from_the_receive_time_over_a_grid() -> None:
    """docs/exactly-once.md, Clock bounds: each clock's ms lasts between 1-rho and 1+rho real ms.

    The TaskManager's lease ends at real ``send + L*p_tm``; the JobManager's bound at real
    ``receive + B*p_jm`` with ``receive >= send``. Exact rational arithmetic, every grid point.
    """
    periods = [1 - RHO + Fraction(k, 100) for k in range(21)]  # 0.90, 0.91, ..., 1.10
    delays = [Fraction(0), Fraction(1, 3), Fraction(1), Fraction(37), Fraction(500)]
    checked = 0
    for s in accepted_settings():
        lease, bound = s.lease_duration_ms, s.lease_bound_ms
        for p_tm in periods:
            tm_end = lease * p_tm  # real ms after the send
            for p_jm in periods:
                for delay in delays:
                    jm_end = delay + bound * p_jm  # real ms after the send
                    assert tm_end <= jm_end, (s.heartbeat_interval_ms, s.heartbeat_timeout_ms, p_tm, p_jm, delay)
                    checked += 1
    assert checked > 50_000
    # The check has teeth: a TaskManager clock 20% slow outlives the bound.
    s = settings(200, 10_000)
    assert s.lease_duration_ms * Fraction(12, 10) > s.lease_bound_ms * (1 - RHO)


class _RateClock:
    """A TaskManager's boot-time clock running at ``rate`` TaskManager ms per JobManager ms (integer ms)."""

    def __init__(self, jm: ManualClock, rate: Fraction, origin_ms: int) -> None:
        self._jm = jm
        self._rate = rate
        self._jm0 = jm.monotonic_ms()
        self._origin = origin_ms

    def __call__(self) -> int:
        return self._origin + int((self._jm.monotonic_ms() - self._jm0) * self._rate)


@pytest.mark.parametrize("rate", [Fraction(9, 10), Fraction(19, 20), Fraction(1), Fraction(21, 20), Fraction(11, 10)])
def test_the_registry_never_calls_a_taskmanager_fenced_while_its_lease_object_still_serves(rate: Fraction) -> None:
    """The real Lease (TaskManager) and the real registry (JobManager), on integer clocks whose rates differ by up to 10%."""
    for s in accepted_settings():
        for delay in (0, 1, 3, 250):
            for phase in (0, 1, 7):
                jm = ManualClock(monotonic_ms=5_000_000 + phase)
                registry = TaskManagerRegistry(
                    jm, ManualScheduler(jm), s.heartbeat_timeout_ms, 1_000, lease_bound_ms=s.lease_bound_ms
                )
                tm_clock = _RateClock(jm, rate, origin_ms=77_000_123)
                lease = Lease(tm_clock)
                registry.register(TaskManagerId("tm-a"), "127.0.0.1:1", "h", 1, "rocksdb", 0)
                jm.advance(s.heartbeat_interval_ms)
                sent_at = tm_clock()
                jm.advance(delay)
                assert registry.heartbeat(TaskManagerId("tm-a"))
                lease.renew(sent_at, s.lease_duration_ms)
                # The connection breaks right away: the JobManager declares it lost, unfenced.
                registry.mark_lost(TaskManagerId("tm-a"), "connection refused")
                fenced_at = registry.fenced_at_ms(TaskManagerId("tm-a"))
                assert fenced_at > jm.monotonic_ms()
                jm.advance(fenced_at - jm.monotonic_ms() - 1)
                assert registry.wait_fenced([TaskManagerId("tm-a")], 0) == [TaskManagerId("tm-a")]
                jm.advance(1)
                assert registry.wait_fenced([TaskManagerId("tm-a")], 0) == []
                assert not lease.valid(), (s.heartbeat_interval_ms, s.heartbeat_timeout_ms, rate, delay, phase)
                with pytest.raises(UnavailableError):
                    lease.check("ValuePut")


# -- the Lease object ----------------------------------------------------------------------------
@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(monotonic_ms=10_000)


def test_a_lease_never_granted_refuses_every_call_until_registration(clock: ManualClock) -> None:
    lease = Lease(clock.boottime_ms)
    assert not lease.valid() and lease.remaining_ms() == 0
    with pytest.raises(UnavailableError) as info:
        lease.check("ValuePut")
    assert info.value.reason is Reason.LEASE_EXPIRED
    assert info.value.message == (
        "this TaskManager stopped serving (the TaskManager has not registered with a JobManager yet): ValuePut refused "
        "so that no two TaskManagers serve the same key groups; refresh the routing table from the JobManager and retry"
    )


def test_a_renewal_counts_from_the_send_time_and_ends_exclusively(clock: ManualClock) -> None:
    lease = Lease(clock.boottime_ms)
    sent = clock.boottime_ms()
    clock.advance(300)  # the answer took 300 ms
    lease.renew(sent, 1_000)
    assert lease.remaining_ms() == 700
    clock.advance(699)
    lease.check("ValueGet")
    lease.check_after("ValueGet")
    clock.advance(1)  # exactly send + L: over
    assert not lease.valid() and lease.remaining_ms() == 0
    with pytest.raises(
        UnavailableError, match=r"\(no heartbeat answered by the JobManager within the lease\): Reduce refused"
    ) as info:
        lease.check("Reduce")
    assert info.value.reason is Reason.LEASE_EXPIRED


def test_a_late_answer_to_an_older_heartbeat_never_shortens_the_lease(clock: ManualClock) -> None:
    lease = Lease(clock.boottime_ms)
    now = clock.boottime_ms()
    lease.renew(now, 1_000)
    lease.renew(now - 500, 1_000)  # an older heartbeat answered late
    lease.renew(now, 10)  # a shorter lease (the JobManager's settings changed) does not cut the current one
    assert lease.remaining_ms() == 1_000
    lease.renew(now - 5_000, 1_000)  # already over when it arrives: no effect either way
    assert lease.remaining_ms() == 1_000


def test_a_renewal_already_over_when_it_arrives_grants_nothing(clock: ManualClock) -> None:
    lease = Lease(clock.boottime_ms)
    lease.renew(clock.boottime_ms() - 2_000, 1_000)
    assert not lease.valid()
    with pytest.raises(UnavailableError, match="no heartbeat answered by the JobManager within the lease"):
        lease.check("ValuePut")


def test_revoke_ends_the_lease_at_once_naming_why_and_a_later_heartbeat_restores_it(clock: ManualClock) -> None:
    lease = Lease(clock.boottime_ms)
    lease.renew(clock.boottime_ms(), 10_000)
    lease.revoke("the JobManager does not know this TaskManager (it restarted, or declared it lost)")
    assert not lease.valid() and lease.remaining_ms() == 0
    with pytest.raises(UnavailableError) as info:
        lease.check("ListAppend")
    assert info.value.reason is Reason.LEASE_EXPIRED
    assert (
        "(the JobManager does not know this TaskManager (it restarted, or declared it lost)): ListAppend refused"
        in info.value.message
    )
    clock.advance(5)
    lease.renew(clock.boottime_ms(), 2_000)  # registered again; the answer to a request sent after the revoke
    assert lease.remaining_ms() == 2_000
    lease.check("ListAppend")


def test_check_after_reports_an_outcome_unknown_when_the_lease_ran_out_during_the_call(clock: ManualClock) -> None:
    lease = Lease(clock.boottime_ms)
    lease.renew(clock.boottime_ms(), 1_000)
    lease.check("MapPut")  # the call starts under the lease ...
    clock.advance(60_000)  # ... the process is paused (SIGSTOP, GC, VM freeze) ...
    with pytest.raises(UnavailableError) as info:
        lease.check_after("MapPut")  # ... and must not acknowledge what it applied
    assert info.value.reason is Reason.OUTCOME_UNKNOWN
    assert info.value.message == (
        "this TaskManager's lease ran out while MapPut ran (no heartbeat answered by the JobManager within the lease); "
        "it may have been applied here, where it will not count: its outcome is unknown"
    )
    lease.revoke("registering with the JobManager")
    with pytest.raises(UnavailableError, match=r"while Clear ran \(registering with the JobManager\)") as info:
        lease.check_after("Clear")
    assert info.value.reason is Reason.OUTCOME_UNKNOWN


def test_concurrent_renewals_and_checks_keep_the_latest_deadline(clock: ManualClock) -> None:
    lease = Lease(clock.boottime_ms)
    base = clock.boottime_ms()
    lease.renew(base, 100_000)
    failures: list[BaseException] = []

    def renew(k: int) -> None:
        try:
            for i in range(200):
                lease.renew(base + (i * 7 + k) % 1_000, 100_000)
                lease.check("ValueGet")
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=renew, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert lease.remaining_ms() == 100_000 + max((i * 7 + k) % 1_000 for i in range(200) for k in range(8))


# -- the lease shared with slot processes ------------------------------------------------------------
_FOLLOWER = """
import sys, time
from pathlib import Path
from keyedstate.common.lease import Lease, SharedLeaseCell
lease = Lease.follow(lambda: int(sys.argv[2]), SharedLeaseCell(Path(sys.argv[1]), create=False))
try:
    lease.check("a call")
    print("SERVING")
except Exception as exc:
    print(type(exc).__name__, exc.reason.name, str(exc))
"""


def _follower_sees(path: Any, now_ms: int) -> str:
    """What a Lease.follow in another process makes of the page at ``now_ms`` (its clock)."""
    done = subprocess.run(
        [sys.executable, "-c", _FOLLOWER, str(path), str(now_ms)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_slot_process_follows_the_lease_the_daemon_keeps_on_the_shared_page(tmp_path: Any) -> None:
    cell = SharedLeaseCell(tmp_path / "lease", create=True)
    lease = Lease(lambda: 10_000, cell)  # renew and revoke read no clock; each follower has its own
    assert _follower_sees(cell.path, 10_000).startswith("UnavailableError LEASE_EXPIRED")

    lease.renew(10_000, 1_000)
    assert _follower_sees(cell.path, 10_999) == "SERVING"
    # The same instant on the host's one CLOCK_BOOTTIME: past the lease, every process refuses.
    refused = _follower_sees(cell.path, 11_000)
    assert refused.startswith("UnavailableError LEASE_EXPIRED") and "refresh the routing table" in refused

    lease.renew(10_500, 1_000)
    assert _follower_sees(cell.path, 11_200) == "SERVING"
    lease.revoke("the JobManager does not know this TaskManager")
    assert _follower_sees(cell.path, 11_200).startswith("UnavailableError LEASE_EXPIRED")
    cell.close()
