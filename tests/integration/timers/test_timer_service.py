"""TimerService against real TaskManagers on both backends: a reference model, epochs, and rescale.

The model test drives random register/delete/advance schedules with a manual clock (processing
time) and a watermark (event time) and compares every firing with a plain-Python reference.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from keyedstate.common._proto.v1 import common_pb2
from keyedstate.common.client import MapState, TimeDomain, TimerService, timers_state
from keyedstate.common.client._timers import anchor_keys
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind, TtlConfig
from keyedstate.common.errors import InvalidArgumentError, WrongStateKindError
from keyedstate.common.keygroups import key_group
from tests.fakes.clock import ManualClock
from tests.integration.epochs.test_epoch_transactions_grpc import _commit

JOB = "epochs"  # _commit addresses this job
OP = "sessions"
MAX_PARALLELISM = 16
OPERATORS = [OperatorSpec(OP, 3, (timers_state(), StateDescriptor("plain", StateKind.VALUE)))]


def test_anchor_keys_cover_every_key_group_once() -> None:
    for m in (1, 7, 128, 4096):
        anchors = anchor_keys(m)
        assert [key_group(a, m) for a in anchors] == list(range(m))


class _Model:
    """The reference: a set of (domain, key, timestamp)."""

    def __init__(self) -> None:
        self.timers: set[tuple[TimeDomain, str, int]] = set()

    def pop_due(self, domain: TimeDomain, up_to: int) -> set[tuple[str, int]]:
        due = {(k, t) for d, k, t in self.timers if d is domain and t <= up_to}
        self.timers -= {(domain, k, t) for k, t in due}
        return due


@pytest.mark.parametrize("backend", ["rocksdb", "hashmap"])
def test_fired_timers_match_a_reference_model(inprocess_cluster: Any, backend: str) -> None:
    cluster = inprocess_cluster(taskmanagers=2, slots=2, backend=backend)
    client = cluster.client()
    client.submit_job(JOB, OPERATORS, max_parallelism=MAX_PARALLELISM)
    timers: TimerService[str] = TimerService(client, JOB, OP)
    clock = ManualClock(now_ms=1_000)
    watermark = 0
    model = _Model()
    rng = random.Random(7)
    keys = [f"user-{i}" for i in range(40)]
    fired_total = 0
    for _ in range(60):
        step = rng.random()
        if step < 0.5:
            domain = rng.choice(list(TimeDomain))
            base = clock.now_ms() if domain is TimeDomain.PROCESSING_TIME else watermark
            batch = [(rng.choice(keys), base + rng.randrange(-50, 400)) for _ in range(rng.randrange(1, 30))]
            timers.register_many(domain, [k for k, _ in batch], [t for _, t in batch])
            model.timers |= {(domain, k, t) for k, t in batch}
        elif step < 0.7 and model.timers:
            victims = rng.sample(sorted(model.timers, key=str), min(len(model.timers), rng.randrange(1, 6)))
            victims.append((TimeDomain.EVENT_TIME, "never-registered", 5))
            for d in TimeDomain:
                chosen = [(k, t) for dd, k, t in victims if dd is d]
                timers.delete_many(d, [k for k, _ in chosen], [t for _, t in chosen])
            model.timers -= set(victims)
        else:
            clock.advance(rng.randrange(0, 200))
            watermark += rng.randrange(0, 200)
            for domain, now in ((TimeDomain.PROCESSING_TIME, clock.now_ms()), (TimeDomain.EVENT_TIME, watermark)):
                fired = timers.pop_due(domain, now)
                expected = model.pop_due(domain, now)
                assert {(t.key, t.timestamp_ms) for t in fired} == expected
                assert len(fired) == len(expected)  # never the same timer twice
                assert all(t.domain is domain for t in fired)
                # Within a key group, timers come in time order.
                by_group: dict[int, list[int]] = {}
                for t in fired:
                    by_group.setdefault(key_group(t.key.encode(), MAX_PARALLELISM), []).append(t.timestamp_ms)
                assert all(ts == sorted(ts) for ts in by_group.values())
                fired_total += len(fired)
    assert fired_total > 50
    for domain in TimeDomain:
        assert {(t.key, t.timestamp_ms) for t in timers.due(domain, 1 << 62)} == {
            (k, t) for d, k, t in model.timers if d is domain
        }
    some = next(iter(model.timers))
    assert some[2] in timers.timers_of(some[1], some[0])


def test_negative_and_extreme_timestamps_keep_their_order(inprocess_cluster: Any) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=3)
    client = cluster.client()
    client.submit_job(JOB, OPERATORS, max_parallelism=MAX_PARALLELISM)
    timers: TimerService[str] = TimerService(client, JOB, OP)
    stamps = [-(1 << 63), -5, 0, 3, (1 << 63) - 1]
    timers.register_many(TimeDomain.EVENT_TIME, ["k"] * len(stamps), list(reversed(stamps)))
    assert timers.timers_of("k", TimeDomain.EVENT_TIME) == stamps
    assert [t.timestamp_ms for t in timers.pop_due(TimeDomain.EVENT_TIME, 0)] == stamps[:3]
    with pytest.raises(InvalidArgumentError, match="signed 64-bit"):
        timers.register_event_time_timer("k", 1 << 63)
    with pytest.raises(InvalidArgumentError, match="one timestamp per key"):
        timers.register_many(TimeDomain.EVENT_TIME, ["a", "b"], [1])
    with pytest.raises(WrongStateKindError, match="timers_state"):
        TimerService(client, JOB, OP, name="plain")
    # The timers state is its own kind: map handles are refused, and so is a TTL.
    with pytest.raises(WrongStateKindError, match="use TimerService"):
        MapState(client, JOB, OP, "timers")
    with pytest.raises(InvalidArgumentError, match="cannot have a TTL"):
        StateDescriptor("t", StateKind.TIMERS, TtlConfig(1000))
    assert client.descriptor(JOB, OP, "timers").kind is StateKind.TIMERS


@pytest.mark.parametrize("backend", ["rocksdb", "hashmap"])
def test_timers_are_staged_with_the_epoch_and_fire_once(inprocess_cluster: Any, backend: str) -> None:
    cluster = inprocess_cluster(taskmanagers=2, slots=2, backend=backend)
    client = cluster.client()
    client.submit_job(JOB, OPERATORS, max_parallelism=MAX_PARALLELISM)
    direct: TimerService[str] = TimerService(client, JOB, OP)
    keys = [f"k{i}" for i in range(30)]
    direct.register_many(TimeDomain.EVENT_TIME, keys, [100] * 30)

    def scoped(epoch: int, attempt: int) -> TimerService[str]:
        return TimerService(client, JOB, OP, epoch=common_pb2.EpochContext(epoch=epoch, partition=0, attempt=attempt))

    winner, loser = scoped(0, 1), scoped(0, 2)
    assert len(winner.pop_due(TimeDomain.EVENT_TIME, 100)) == 30
    winner.register_processing_time_timer("k0", 500)
    assert len(loser.pop_due(TimeDomain.EVENT_TIME, 100)) == 30  # the loser sees committed timers only
    assert list(winner.due(TimeDomain.EVENT_TIME, 100)) == []  # read-your-own deletes
    assert len(list(direct.due(TimeDomain.EVENT_TIME, 100))) == 30  # nothing committed yet
    _commit(cluster, 0, {0: 1})
    assert list(direct.due(TimeDomain.EVENT_TIME, 100)) == []
    assert [(t.key, t.timestamp_ms) for t in direct.due(TimeDomain.PROCESSING_TIME, 500)] == [("k0", 500)]
    # An aborted epoch leaves the timers where they were.
    aborted = scoped(1, 3)
    assert len(aborted.pop_due(TimeDomain.PROCESSING_TIME, 500)) == 1
    _commit(cluster, 1, {0: 3}, abort=True)
    assert len(list(direct.due(TimeDomain.PROCESSING_TIME, 500))) == 1


@pytest.mark.parametrize("backend", ["rocksdb", "hashmap"])
def test_timers_move_with_their_key_groups_on_rescale(inprocess_cluster: Any, backend: str) -> None:
    cluster = inprocess_cluster(taskmanagers=2, slots=4, backend=backend)
    client = cluster.client()
    client.submit_job(JOB, OPERATORS, max_parallelism=MAX_PARALLELISM)
    timers: TimerService[str] = TimerService(client, JOB, OP)
    keys = [f"user-{i}" for i in range(200)]
    timers.register_many(TimeDomain.EVENT_TIME, keys, list(range(200)))
    timers.register_many(TimeDomain.PROCESSING_TIME, keys, [7] * 200)
    client.rescale_job(JOB, 2)
    assert client.routing(JOB, refresh=True).operator(OP).parallelism == 2
    rescaled: TimerService[str] = TimerService(client, JOB, OP)
    assert sorted((t.key, t.timestamp_ms) for t in rescaled.pop_due(TimeDomain.EVENT_TIME, 99)) == sorted(
        zip(keys[:100], range(100))
    )
    client.rescale_job(JOB, 4)
    assert len(list(rescaled.due(TimeDomain.EVENT_TIME, 1 << 40))) == 100
    assert {t.key for t in rescaled.due(TimeDomain.PROCESSING_TIME, 7)} == set(keys)
