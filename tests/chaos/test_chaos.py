"""The chaos suite: randomized fault schedules, drawn from fixed seeds, against exactly-once.

Each seed's schedule (``_schedule.py``) is run against real daemons and a real Spark driver in
its own process (``_epoch.py``), or against direct-mode writers (``_direct.py``), and ends with an
exact check: every key's count, sum and multiset of event ids against the plain-Python reference
of exactly the batches Spark's commit log records (direct mode: every append acknowledged after
the last failover, exactly once).

The two default seeds below were picked so that together they cover both modes, network
partitions, a JobManager kill at a crash point, a TaskManager kill and pause, in about 75 s
(seed 78: epoch mode on the virtual network, a TaskManager isolated and another cut from the
JobManager, the JobManager killed before an epoch commit; seed 269: direct mode, a TaskManager
paused past the heartbeat timeout, another killed, the JobManager killed after a checkpoint's
metadata was written, losses detected by heartbeat timeout only); the soak
(``test_chaos_soak.py``, ``-m chaos_soak``) runs many more. A failure prints the seed, its
schedule, what happened when, and how to replay it: ``pytest tests/chaos -k seed_<n>``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.chaos._run import RunResult
from tests.chaos._schedule import CATALOGUE, MODIFIERS, NETWORK_KINDS, FaultSchedule
from tests.chaos.conftest import seed_param

DEFAULT_SEEDS = [78, 269]
"""At most two in the default run (about 75 s together); every other seed is the soak's."""

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(420)]


@pytest.mark.parametrize("seed", [seed_param(s) for s in DEFAULT_SEEDS])
def test_chaos(seed: int, chaos_run: Callable[..., RunResult]) -> None:
    schedule = FaultSchedule.from_seed(seed)
    result = chaos_run(schedule, deadline_s=240.0)
    assert result.passed, result.report()


SLOT_PROCESS_SEED = 269
"""A direct-mode seed that pauses a TaskManager (its slot processes run on; the lease must fence
them), kills one (its slot processes must go with it), kills the JobManager, heartbeats only."""


def test_chaos_with_slot_processes(chaos_run: Callable[..., RunResult]) -> None:
    schedule = FaultSchedule.from_seed(SLOT_PROCESS_SEED)
    assert schedule.mode == "direct" and not schedule.netns
    result = chaos_run(schedule, deadline_s=240.0, config={"taskmanager.slot-processes": "2"})
    assert result.passed, result.report()


OVERLAPPED_SEED = 1122
"""An epoch-mode seed whose faults are all timed (they strike in either commit mode): the JobManager
killed in batch 1, a TaskManager killed in batch 1, another paused for 4 s in batch 3."""


def test_chaos_with_overlapped_commits(chaos_run: Callable[..., RunResult], tmp_path: Path) -> None:
    schedule = FaultSchedule.from_seed(OVERLAPPED_SEED)
    assert schedule.mode == "epoch" and not schedule.netns
    assert {"jm_kill", "tm_kill", "tm_pause"} <= set(schedule.kinds())
    result = chaos_run(schedule, deadline_s=240.0, config={"execution.checkpointing.commit-mode": "overlapped"})
    assert result.passed, result.report()
    jobmanager_logs = "".join(p.read_text(errors="replace") for p in tmp_path.rglob("jobmanager*.log"))
    assert "decided (batch" in jobmanager_logs, "the run did not commit overlapped"


def test_a_seed_always_draws_the_same_schedule() -> None:
    for seed in [*DEFAULT_SEEDS, *range(1000, 1100)]:  # the soak's seeds start at 1000
        first, again = FaultSchedule.from_seed(seed), FaultSchedule.from_seed(seed)
        assert first == again and first.to_json() == again.to_json(), seed
    assert len({FaultSchedule.from_seed(s).to_json() for s in range(1000, 1100)}) > 90


def test_the_default_seeds_cover_the_main_fault_kinds() -> None:
    schedules = [FaultSchedule.from_seed(s) for s in DEFAULT_SEEDS]
    kinds = {k for s in schedules for k in s.kinds()}
    assert any(s.netns and any(k in NETWORK_KINDS for k in s.kinds()) for s in schedules), "no network partition"
    assert {"jm_kill", "tm_kill", "tm_pause"} <= kinds, f"no JobManager or TaskManager kill, or pause: {kinds}"
    assert {s.mode for s in schedules} == {"epoch", "direct"}, "not both modes"


def test_the_soak_seeds_cover_the_whole_catalogue() -> None:
    counts = Counter(k for s in range(1000, 1060) for k in FaultSchedule.from_seed(s).kinds())
    missing = sorted(set(CATALOGUE) - set(counts))
    assert not missing, f"the soak's seeds never draw {missing}; drawn: {dict(counts)}"
    assert set(MODIFIERS) <= set(counts)
