"""Fuzz every RPC of every service against a real JobManager and real TaskManagers.

Each call is one of: a message generated from the request's descriptor ("generated"), a valid
request against the live fuzz job with one field broken ("mutated"; an unbroken one now and
then, so the success paths run too), or bytes that are not a valid request at all ("raw":
truncated, bit-flipped, spliced, lying length prefixes, invalid UTF-8 in a string field).

The oracle (rpc_harness.judge): every answer is OK or a typed error with an expected status
code; never UNKNOWN/INTERNAL, never a hang. After the run every daemon still serves, the
reference job's state reads back unchanged, and no file appeared outside the sandbox.

Default run: a seeded, bounded number of calls per service. ``-m fuzz_long`` runs each service
for KEYEDSTATE_FUZZ_SECONDS (default 300) with a new seed every few hundred calls.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import FlakyReplay, FlakyStrategyDefinition

from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from tests.fuzz import proto_strategies as ps
from tests.fuzz.conftest import FuzzCluster, default_examples, long_seconds, write_report
from tests.fuzz.rpc_harness import (
    PRIVATE_SERVICES,
    SERVED_BY,
    Method,
    Stats,
    all_methods,
    all_services,
    call_raw,
    methods_of,
)
from tests.fuzz.world import World, broken

MODES = ["generated", "mutated", "mutated", "mutated", "raw"]
"""Mostly mutations of valid requests: they get past the first validation."""
REFRESH_EVERY = 20


def fuzz_method(world: World, method: Method, stats: Stats, examples: int, run_seed: int) -> None:
    """``examples`` calls of ``method``, all drawn from ``run_seed``.

    One hypothesis run per method: what a run draws must not depend on state outside it (the
    method, the live job's shape), or hypothesis refuses the run as flaky.
    """
    counter = {"n": 0}

    @seed(run_seed)
    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def one_call(data: st.DataObject) -> None:
        counter["n"] += 1
        if counter["n"] % REFRESH_EVERY == 0:
            world.refresh()
        mode = data.draw(st.sampled_from(MODES), label="mode")
        subtask = data.draw(st.integers(0, 1), label="subtask")
        template = world.template(method.service, method.name, subtask)
        any_address = (
            data.draw(st.sampled_from(world.tm_addresses))
            if SERVED_BY[method.service] == "taskmanager"
            else world.jm_address
        )
        if mode == "mutated" and template is None:
            mode = "generated"
        if mode == "generated":
            msg = data.draw(ps.message_strategy(method.input, override=world.override), label="request")
            address = any_address
        elif mode == "mutated":
            assert template is not None
            valid, address = template
            msg = (
                valid
                if data.draw(st.integers(0, 9)) == 0
                else data.draw(broken(valid, world.override), label="request")
            )
        else:
            msg = (
                template[0]
                if template is not None
                else data.draw(ps.message_strategy(method.input, override=world.override))
            )
            address = template[1] if template is not None else any_address
        world.protect(method.name, msg)
        body = msg.SerializeToString()
        if mode == "raw":
            bad_utf8 = ps.invalid_utf8_string_field(method.input)
            if bad_utf8 is not None and data.draw(st.integers(0, 4)) == 0:
                body = bad_utf8 + body
            else:
                body = data.draw(ps.mutated_bytes(body), label="raw")
                if not world.raw_is_safe(method.request_class(), body):
                    body = b"\n"  # a truncated message instead of one that would leave the sandbox
        code, response = call_raw(world.channel(address), method, body, stats, mode)
        if method.name == "RegisterTaskManager" and code.name == "OK" and response:
            world.session = jm_pb.RegisterTaskManagerResponse.FromString(response[0]).jobmanager_session

    try:
        one_call()
    except (FlakyStrategyDefinition, FlakyReplay):
        # The live job changed shape under a run (a rescale by the fuzzer): the calls made were
        # judged already; the next seed goes on.
        stats.interrupted_runs += 1


def _services() -> list[str]:
    return sorted(set(all_services()) - set(PRIVATE_SERVICES))


def test_every_service_of_the_protocol_is_fuzzed() -> None:
    """A new service must say which daemon serves it, or it would silently go unfuzzed."""
    services = all_services()
    assert not set(SERVED_BY) & set(PRIVATE_SERVICES)
    known = set(SERVED_BY) | set(PRIVATE_SERVICES)
    assert set(services) == known, (
        f"add the new service(s) to SERVED_BY (or PRIVATE_SERVICES, why): {set(services) ^ known}"
    )
    assert sum(len(s.methods) for s in services.values()) == len(all_methods()) >= 34


def _run(fuzz_cluster: FuzzCluster, service: str, *, examples: int, seconds: float, name: str) -> Stats:
    stats = Stats()
    methods = methods_of(service)
    deadline = time.monotonic() + seconds
    run = 0
    per_method = max(1, examples // len(methods))
    while True:
        for i, method in enumerate(methods):
            fuzz_method(fuzz_cluster.world, method, stats, per_method, run_seed=1000 + run * 100 + i)
        run += 1
        if time.monotonic() >= deadline:
            break
    print(stats.summary())
    write_report(name, stats, {"service": service, "seeds": run})
    assert not stats.findings, stats.summary()
    # Coverage: every method of the service was called, and reached its domain code at least once
    # (an answer other than the first validation's INVALID_ARGUMENT/NOT_FOUND).
    floor = per_method
    for m in methods:
        assert stats.calls[m.key] >= floor, f"{m.key} was called {stats.calls[m.key]} times (< {floor})"
        deep = {c for c in stats.codes[m.key] if c not in ("INVALID_ARGUMENT", "NOT_FOUND")}
        assert deep, f"{m.key} never got past its first validation: {dict(stats.codes[m.key])}"
    fuzz_cluster.assert_healthy()
    fuzz_cluster.assert_no_stray_files()
    return stats


@pytest.mark.parametrize("service", _services())
def test_fuzz_rpc_bounded(fuzz_cluster: FuzzCluster, service: str) -> None:
    _run(fuzz_cluster, service, examples=default_examples(), seconds=0, name=f"bounded:{service}")


@pytest.mark.fuzz_long
@pytest.mark.timeout(0)
@pytest.mark.parametrize("service", _services())
def test_fuzz_rpc_long(fuzz_cluster: FuzzCluster, service: str) -> None:
    _run(fuzz_cluster, service, examples=300, seconds=long_seconds(), name=f"long:{service}")
