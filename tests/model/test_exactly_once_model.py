"""Exhaustive model checking of docs/exactly-once.md.

Every test explores *all* the states an experiment can reach (tests/model/experiments.py) and
checks the document's six invariants in each, plus liveness: from every reachable state the
query can still finish (or be refused, after an operator action). With every protection of the
document on, nothing breaks; with any one of them off, the checker finds a counterexample, or
the test shows which other protection stands in for it. The summary at the end of the pytest
run lists the states explored and the time of each exploration.
"""

from __future__ import annotations

import re

import pytest

from tests.model import experiments as X
from tests.model.conftest import Check
from tests.model.protocol import (
    CONSISTENT_CUT,
    CONTIGUITY,
    DOCUMENTED,
    DURABILITY,
    LIVENESS,
    LOST_OR_DOUBLED,
    ONE_OWNER,
    READS_SEE_PREVIOUS,
    WINNERS_ONLY,
    Experiment,
)

FIXED = DOCUMENTED  # the version floor the model proposed is part of the protocol now
"""The document's protocol plus the fix this model proposes (see test_stale_deploy_*)."""


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _ids(experiments: tuple[Experiment, ...]) -> list[str]:
    return [_slug(x.name) for x in experiments]


# -- the documented protocol holds ----------------------------------------------------------


@pytest.mark.parametrize("experiment", X.DEFAULT, ids=_ids(X.DEFAULT))
def test_documented_protocol_holds(check: Check, experiment: Experiment) -> None:
    report = check(experiment)
    assert report.ok, report.counterexample()


def test_without_faults_the_query_finishes_every_batch(check: Check) -> None:
    report = check(X.BASELINE)
    assert report.ok, report.counterexample()
    assert report.goals == 1  # one end state: all three batches returned, each applied once


# -- each protection off: the real bugs of the product ----------------------------------------


def test_bug_taskmanager_killed_after_epoch_0_committed_everywhere_before_its_checkpoint(check: Check) -> None:
    """Real bug: every TaskManager committed epoch 0, one was killed before the checkpoint
    completed; the restore brought the slots back to empty state but the JobManager kept
    reporting epoch 0 committed. With the checkpoint epoch checks the product has now, the
    query can never finish (its re-run only waits for a checkpoint of epoch 0, which the
    restored slots decline for ever)."""
    report = check(X.CRASH_TASKMANAGER_ONE_BATCH, DOCUMENTED.without("rollback_committed_on_restore"))
    assert report.violation is not None and report.violation.invariant == LIVENESS, report.summary()
    applied = [i for i, t in enumerate(report.trace) if t.startswith("deliver ApplyAnswer(E=0") and t.endswith("ok)")]
    crash = next(i for i, t in enumerate(report.trace) if t.startswith("CRASH tm"))
    assert len(applied) == 2 and crash > max(applied), report.counterexample()
    assert not any("COMPLETED" in t for t in report.trace[:crash])


def test_bug_taskmanager_killed_before_checkpoint_loses_the_batch_silently(check: Check) -> None:
    """The same bug without the checkpoint epoch checks (as the product was then): a checkpoint
    claims epoch 0 over slots restored to empty state, and the driver returns from batch 0,
    which the job no longer holds: the batch is silently lost."""
    off = DOCUMENTED.without("rollback_committed_on_restore", "barrier_epoch_check")
    report = check(X.CRASH_TASKMANAGER_ONE_BATCH, off)
    assert report.violation is not None and report.violation.invariant == CONSISTENT_CUT, report.summary()
    # Set that invariant aside to see what the user sees next: batch 0 returned, and lost.
    report = check(X.CRASH_TASKMANAGER_ONE_BATCH, off, ignore=frozenset({CONSISTENT_CUT}))
    assert report.violation is not None and report.violation.invariant == LOST_OR_DOUBLED, report.summary()
    assert "lacks returned batches [('q1', 0)]" in report.violation.detail
    assert any(t.startswith("CRASH tm") for t in report.trace)


def test_bug_cut_off_taskmanager_keeps_serving_with_old_routing(check: Check) -> None:
    """Real bug: a TaskManager cut off from the JobManager kept serving clients with the old
    routing after its lease ran out, while its key group was redeployed elsewhere."""
    report = check(X.CUT_OFF, DOCUMENTED.without("lease_fencing"))
    assert report.violation is not None and report.violation.invariant == ONE_OWNER, report.counterexample()
    assert report.trace[0].startswith("CUT tm0")
    assert "lease-expired [kg0@v0.0" in report.final and "tm1 [kg0@v0.1" in report.final


def test_bug_commit_whose_checkpoint_failed_counted_as_done(check: Check) -> None:
    """Real bug: the driver returned from a batch whose checkpoint came back failed; a later
    failover would restore a checkpoint without it."""
    for experiment in (X.CHECKPOINT_FAILURES, X.CRASH_TASKMANAGER):
        report = check(experiment, DOCUMENTED.without("driver_checks_checkpoint_status"))
        assert report.violation is not None and report.violation.invariant == DURABILITY, report.summary()
        assert "CHECKPOINT_FAILED" in report.trace[-1], report.counterexample()


# -- each protection off: what else breaks ----------------------------------------------------


OFF_CASES = [
    (
        "lease_recheck_before_answer",
        X.PAUSE,
        ONE_OWNER,
        "a TaskManager paused in a write call acknowledges it after its lease ran out",
    ),
    (
        "reassign_after_fencing",
        X.CUT_OFF,
        ONE_OWNER,
        "a key group redeployed while its cut-off owner still holds a valid lease",
    ),
    (
        "routing_version_check",
        X.CRASH_TASKMANAGER,
        WINNERS_ONLY,
        "an Apply of a commit aborted by a failover lands on the restored slot: an epoch without its writes",
    ),
    (
        "epoch_gap_refusal",
        X.CANCEL_RESUBMIT,
        LOST_OR_DOUBLED,
        "the resubmitted, empty job runs batch 1 as its first epoch: batch 0 is gone for good",
    ),
    (
        "epoch_gap_refusal",
        X.RESTORE_OLDER,
        LIVENESS,
        "after an older restore the query re-runs a refused batch for ever instead of raising EpochGapError",
    ),
    (
        "lineage_epochs",
        X.NEW_QUERY,
        LOST_OR_DOUBLED,
        "a new checkpointLocation's batch 0 is taken for epoch 0 of the old query: skipped",
    ),
    (
        "barrier_epoch_check",
        X.RESCALE,
        CONSISTENT_CUT,
        "a barrier delivered after the commit lock was released snapshots a half-applied epoch",
    ),
    (
        "seq_dedup",
        X.MESSAGES,
        LOST_OR_DOUBLED,
        "a duplicated write request staged again between Prepare and Apply is applied twice",
    ),
    (
        "retry_job_state_errors",
        X.CHECKPOINT_FAILURES,
        LIVENESS,
        "the query stops on a transient RESTARTING job instead of waiting for it",
    ),
]


@pytest.mark.parametrize(
    ("protection", "experiment", "invariant", "scenario"),
    [pytest.param(*case, id=f"{case[0]}-{_slug(case[1].name)}") for case in OFF_CASES],
)
def test_protection_off_is_caught(
    check: Check, protection: str, experiment: Experiment, invariant: str, scenario: str
) -> None:
    report = check(experiment, DOCUMENTED.without(protection))
    assert report.violation is not None, f"{protection} off, expected: {scenario}\n{report.summary()}"
    assert report.violation.invariant == invariant, report.counterexample()


# -- protections that stand in for each other (defense in depth) -----------------------------


def _duplicate_restaged(trace: list[str]) -> tuple[int, int]:
    """(index of the second delivery of the duplicated write, index of its slot's Prepare)."""
    dup = next(t for t in trace if t.startswith("DUPLICATE Stage("))
    stage = dup[len("DUPLICATE ") : dup.index(" (delivered")]
    kg = re.search(r" kg(\d) ", stage).group(1)  # type: ignore[union-attr]
    second = max(i for i, t in enumerate(trace) if t == f"deliver {stage}")
    prepare = next(i for i, t in enumerate(trace) if t.startswith("deliver Prepare(") and f" kg{kg} " in t)
    return second, prepare


def test_ledger_check_is_backed_by_sequence_numbers(check: Check) -> None:
    """Alone, the ledger check protects nothing the sequence numbers do not; without sequence
    numbers it refuses a duplicate staged *before* Prepare, but not one staged between Prepare
    and Apply (Apply reads the staging again). Proposed: Apply applies each sequence number
    once (the ledger's), or a slot stops staging an epoch once it prepared it."""
    assert check(X.MESSAGES, DOCUMENTED.without("ledger_check")).ok
    both = check(X.MESSAGES, DOCUMENTED.without("ledger_check", "seq_dedup"))
    assert both.violation is not None and both.violation.invariant == LOST_OR_DOUBLED
    second, prepare = _duplicate_restaged(both.trace)
    assert second < prepare, both.counterexample()  # staged twice before Prepare: only the ledger sees it
    alone = check(X.MESSAGES, DOCUMENTED.without("seq_dedup"))
    assert alone.violation is not None and alone.violation.invariant == LOST_OR_DOUBLED
    second, prepare = _duplicate_restaged(alone.trace)
    assert second > prepare, alone.counterexample()  # the ledger check's blind window


def test_taskmanager_gap_check_is_backed_by_the_jobmanager(check: Check) -> None:
    """The slots' gap check never fires while the JobManager refuses E > C+1; without that
    refusal it turns a batch applied over the gap into a query that can never finish."""
    assert check(X.RESTORE_OLDER, DOCUMENTED.without("taskmanager_gap_check")).ok
    both = check(X.RESTORE_OLDER, DOCUMENTED.without("taskmanager_gap_check", "epoch_gap_refusal"))
    assert both.violation is not None and both.violation.invariant == CONTIGUITY, both.summary()


def test_commit_lock_does_not_make_the_cut_consistent(check: Check) -> None:
    """The document says barriers sent under the commit lock never see a half-applied epoch;
    but a barrier is a message, delivered after the lock is released. The barrier and ack
    epoch checks make the cut consistent; the lock only spares declined checkpoints."""
    assert check(X.RESCALE, DOCUMENTED.without("cut_under_commit_lock")).ok
    report = check(X.RESCALE, DOCUMENTED.without("barrier_epoch_check"))  # the lock is on
    assert report.violation is not None and report.violation.invariant == CONSISTENT_CUT
    both = check(X.RESCALE, DOCUMENTED.without("barrier_epoch_check", "cut_under_commit_lock"))
    assert both.violation is not None and both.violation.invariant == CONSISTENT_CUT


# -- a hole in the documented protocol, and its fix -------------------------------------------

_DEPLOY = re.compile(r"deliver Deploy\(kg\d v=(\d+)\.(\d+) .*-> tm(\d)\)")
_NEWER = re.compile(
    r"deliver (?:Registered\(tm(\d) .*keeps slots of v=(\d+)\.(\d+)\)|"
    r"Release\(below v=(\d+)\.(\d+) -> tm(\d)\))"
)


def _stale_deploy(trace: list[str]) -> str | None:
    """The first Deploy delivered to a TaskManager after it was told of a newer version."""
    told: dict[str, tuple[int, int]] = {}
    for t in trace:
        m = _NEWER.match(t)
        if m:
            tm, v = (m[1], (int(m[2]), int(m[3]))) if m[1] else (m[6], (int(m[4]), int(m[5])))
            told[tm] = max(told.get(tm, (0, 0)), v)
        d = _DEPLOY.match(t)
        if d and (int(d[1]), int(d[2])) < told.get(d[3], (0, 0)):
            return t
    return None


def test_stale_deploy_hole_without_the_version_floor(check: Check) -> None:
    """The hole this model found in the first version of the document: a Deploy of a superseded
    restore, still in flight, reaches a TaskManager after a newer Release or registration answer,
    and installs a deposed slot that serves (the JobManager counts that TaskManager as fenced)."""
    report = check(X.OWNERSHIP_TWO_CRASHES, DOCUMENTED.without("taskmanager_version_floor"), liveness=False)
    assert report.violation is not None and report.violation.invariant == ONE_OWNER, report.summary()
    assert _stale_deploy(report.trace), report.counterexample()


def test_stale_deploy_fixed_by_a_version_floor(check: Check) -> None:
    """The fix: a TaskManager keeps the highest routing version it was told of and ignores a
    Deploy below it."""
    assert check(X.OWNERSHIP_TWO_CRASHES, FIXED, liveness=False).ok


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_stale_deploy_with_one_crash_and_a_rescale(check: Check) -> None:
    """The same hole with a single failure: a TaskManager crash, then an operator's rescale."""
    report = check(X.RESCALE_AND_CRASH_ONE_BATCH, DOCUMENTED.without("taskmanager_version_floor"))
    assert report.violation is not None and report.violation.invariant == ONE_OWNER, report.summary()
    assert _stale_deploy(report.trace), report.counterexample()
    assert check(X.RESCALE_AND_CRASH, FIXED).ok


# -- overlapped commits (docs/exactly-once.md, "Overlapped commits") ---------------------------


_OVERLAPPED = [pytest.param(x, id=_slug(x.name)) for x in X.OVERLAPPED] + [
    pytest.param(x, id=_slug(x.name), marks=[pytest.mark.slow, pytest.mark.timeout(1800)]) for x in X.OVERLAPPED_SLOW
]


@pytest.mark.parametrize("experiment", _OVERLAPPED)
def test_overlapped_commits_hold(check: Check, experiment: Experiment) -> None:
    """The driver returns on the epoch's decision; the apply and the checkpoint overlap the next
    batch; every invariant still holds, and so does invariant 7 (reads see the previous batch)."""
    report = check(experiment)
    assert report.ok, report.counterexample()


OVERLAPPED_OFF_CASES = [
    (
        "upload_before_decision",
        X.overlapped(X.CRASH_TASKMANAGER_ONE_BATCH, batches=1),
        LOST_OR_DOUBLED,
        "a decision whose change sets live only in the slots' staging: the batch is returned, "
        "and a TaskManager death before the checkpoint would lose it",
    ),
    (
        "replay_decisions_on_restore",
        X.overlapped(X.CRASH_TASKMANAGER_ONE_BATCH, batches=1),
        LOST_OR_DOUBLED,
        "a restore that stops at the checkpoint drops decided epochs the driver returned from",
    ),
    (
        "read_fence",
        X.overlapped(X.BASELINE),
        READS_SEE_PREVIOUS,
        # (so the mode does overlap: without a fault, batch N+1 reaches a slot before N's apply)
        "a task of batch N+1 is served by a slot that has not applied batch N yet",
    ),
    (
        "seal_on_restore",
        X.OVERLAPPED_NEW_QUERY_AND_CRASH,
        DURABILITY,
        "a dead leader's decision write lands after the new leader's restore, taking the epoch "
        "the new query's batch 0 was decided and applied at: a later restore replays the old batch",
    ),
]


def _overlapped_off_param(case: tuple[str, Experiment, str, str]) -> object:
    heavy = case[1] is X.OVERLAPPED_NEW_QUERY_AND_CRASH  # about 600k states
    marks = [pytest.mark.slow, pytest.mark.timeout(1800)] if heavy else []
    return pytest.param(*case, id=f"{case[0]}-{_slug(case[1].name)}", marks=marks)


@pytest.mark.parametrize(
    ("protection", "experiment", "invariant", "scenario"),
    [_overlapped_off_param(case) for case in OVERLAPPED_OFF_CASES],
)
def test_overlapped_protection_off_is_caught(
    check: Check, protection: str, experiment: Experiment, invariant: str, scenario: str
) -> None:
    report = check(experiment, DOCUMENTED.without(protection))
    assert report.violation is not None, f"{protection} off, expected: {scenario}\n{report.summary()}"
    assert report.violation.invariant == invariant, report.counterexample()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_overlapped_seal_holds_the_race(check: Check) -> None:
    """The same race with the seal: the late write finds its name taken and is never replayed."""
    report = check(X.OVERLAPPED_NEW_QUERY_AND_CRASH)
    assert report.ok, report.counterexample()


# -- larger bounds ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("experiment", X.SLOW, ids=_ids(X.SLOW))
def test_larger_bounds(check: Check, experiment: Experiment) -> None:
    report = check(experiment, FIXED)
    assert report.ok, report.counterexample()
