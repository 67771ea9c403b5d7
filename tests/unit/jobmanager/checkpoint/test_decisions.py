"""Decision records of overlapped commits against real storage: file:// and S3 (moto over HTTP).

One test body per behaviour runs on both storages through the ``log_factory`` fixture. The
races are real: two writers (threads with their own storage clients) create the same names.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from keyedstate.common.batches import Winner
from keyedstate.common.changesets import ChangeSetFile, change_set_name
from keyedstate.common.errors import CorruptCheckpointError, InvalidArgumentError
from keyedstate.common.storage import CheckpointStorage, open_storage
from keyedstate.jobmanager.checkpoint.decisions import Decision, DecisionLog, DecisionRaceError, Seal, next_generation
from tests.fixtures.s3 import s3_configuration

LogFactory = Callable[[int], DecisionLog]


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def storage_and_dir(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Callable[[], CheckpointStorage], str]:
    """A way to open a fresh storage client (each writer gets its own) and the job's checkpoint directory."""
    if request.param == "file":
        return (lambda: open_storage("file:///")), f"file://{tmp_path}/job-1"
    endpoint, bucket = request.getfixturevalue("s3_bucket")
    return (lambda: open_storage(f"s3://{bucket}", s3_configuration(endpoint))), f"s3://{bucket}/ck/job-1"


@pytest.fixture
def log_factory(storage_and_dir: tuple[Callable[[], CheckpointStorage], str]) -> LogFactory:
    make_storage, job_dir = storage_and_dir
    return lambda generation: DecisionLog(make_storage(), job_dir, generation)


def decision(epoch: int, batch: int, version: int = 3, query: str = "q1") -> Decision:
    refs = [
        ChangeSetFile(epoch, "counts", i, change_set_name(epoch, version, "counts", i), 100 + i, f"{i:064x}")
        for i in (1, 0)
    ]
    return Decision.of(epoch, query, batch, version, [Winner(1, 11), Winner(0, 10)], refs)


def test_a_decision_round_trips_at_the_first_free_name(log_factory: LogFactory) -> None:
    log = log_factory(0)
    written = log.decide(decision(4, 4))
    assert written.n == 0
    assert log.names() == {4: [0]}
    found = log.decision(4)
    assert found == decision(4, 4) and found is not None and found.n == 0
    assert found.winners == ((0, 10), (1, 11)), "winners are kept partitions ascending"
    assert [c.subtask_index for c in found.change_sets] == [0, 1]
    assert found.change_sets[0].path == "changelog/4/v3-counts-0"
    assert log.decision(5) is None


def test_a_seal_refuses_a_late_decision_of_the_same_name(log_factory: LogFactory) -> None:
    """The race the model found: the restore's seal and a dead leader's decision write want one name."""
    restorer, late_leader = log_factory(0), log_factory(0)
    assert restorer.continuation(committed_epoch=6, routing_version=9) == []
    assert restorer.names() == {7: [0]}
    # The dead leader listed epoch 7 before the seal (n = 0) and its write lands now.
    with pytest.raises(DecisionRaceError, match="sealed by a restore meanwhile; run the batch again"):
        _decide_at(late_leader, decision(7, 7, version=3), 0)
    assert restorer.decision(7) is None
    # The re-run of the batch under the restored deployment decides at the next name.
    rerun = restorer.decide(decision(7, 7, version=9))
    assert rerun.n == 1 and restorer.decision(7) == decision(7, 7, version=9)


def _decide_at(log: DecisionLog, d: Decision, n: int) -> None:
    """Decide as a writer that listed the epoch when ``n`` was its first free name (a write in flight)."""
    original = log._first_free
    log._first_free = lambda epoch: n  # type: ignore[method-assign]  # the listing happened before the seal
    try:
        log.decide(d)
    finally:
        log._first_free = original  # type: ignore[method-assign]


def test_a_decision_by_a_deposed_deployment_after_a_seal_is_not_replayed(log_factory: LogFactory) -> None:
    """A deposed leader that is alive lists the epoch after the seal and writes at the next free name."""
    log = log_factory(0)
    log.continuation(committed_epoch=2, routing_version=(1 << 32) + 1)  # a new HA session's version
    stale = log.decide(decision(3, 3, version=5))
    assert stale.n == 1
    assert log.decision(3) is None, "a decision below a seal's routing version never counts"
    assert log.continuation(committed_epoch=2, routing_version=(1 << 32) + 2) == []
    assert log.names() == {3: [0, 1, 2]}
    current = log.decide(decision(3, 3, version=(1 << 32) + 2))
    assert current.n == 3 and log.decision(3) == current


def test_the_continuation_replays_decided_epochs_in_order_and_seals_the_next(log_factory: LogFactory) -> None:
    log = log_factory(0)
    for epoch in (5, 6, 7):
        log.decide(decision(epoch, epoch))
    log.decide(decision(9, 9))  # not contiguous: never replayed
    found = log.continuation(committed_epoch=4, routing_version=3)
    assert [(d.epoch, d.batch_id) for d in found] == [(5, 5), (6, 6), (7, 7)]
    assert log.names()[8] == [0]
    assert isinstance(log.read(8, 0), Seal)
    # A restore from a newer checkpoint replays only what is above it; the seal of 8 stays.
    assert [d.epoch for d in log.continuation(committed_epoch=6, routing_version=4)] == [7]
    assert log.names()[8] == [0, 1]


def test_a_decision_landing_during_the_restore_is_taken_and_the_next_epoch_sealed(log_factory: LogFactory) -> None:
    """The restore lists no decision of 3, then loses the seal's name to a decision write in flight."""
    log, writer = log_factory(0), log_factory(0)
    original_names = log.names
    calls = {"n": 0}

    def names_then_race() -> dict[int, list[int]]:
        listed = original_names()
        calls["n"] += 1
        if calls["n"] == 1:  # the in-flight decision lands right after the restore listed the epochs
            writer.decide(decision(3, 3))
        return listed

    log.names = names_then_race  # type: ignore[method-assign]
    found = log.continuation(committed_epoch=2, routing_version=3)
    assert [d.epoch for d in found] == [3]
    log.names = original_names  # type: ignore[method-assign]
    assert isinstance(log.read(4, 0), Seal)


def _race(decider: DecisionLog, restorer: DecisionLog, epoch: int, delay_s: float) -> dict[str, Any]:
    """A decision write of ``epoch`` (listed when ``n = 0`` was free) and a restore at ``epoch - 1``, at once."""
    outcome: dict[str, Any] = {}
    barrier = threading.Barrier(2)

    def decide() -> None:
        barrier.wait()
        try:
            _decide_at(decider, decision(epoch, epoch), 0)
            outcome["decided"] = True
        except DecisionRaceError:
            outcome["decided"] = False

    def seal() -> None:
        barrier.wait()
        threading.Event().wait(delay_s)
        outcome["replayed"] = [d.epoch for d in restorer.continuation(epoch - 1, routing_version=3)]

    threads = [threading.Thread(target=decide), threading.Thread(target=seal)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return outcome


def test_concurrent_decide_and_seal_exactly_one_wins(log_factory: LogFactory) -> None:
    """Real concurrent writers on separate clients: for each epoch either the decision or the seal wins."""
    rng = random.Random(1303)
    for epoch in range(8):
        restorer = log_factory(0)
        outcome = _race(log_factory(0), restorer, epoch, rng.choice([0.0, 0.0005, 0.002]))
        assert outcome["replayed"] == ([epoch] if outcome["decided"] else []), outcome
        assert (restorer.decision(epoch) is not None) == outcome["decided"]


def test_generations_are_separate_and_garbage_collection_keeps_what_restores_need(log_factory: LogFactory) -> None:
    g0 = log_factory(0)
    for epoch in range(4):
        g0.decide(decision(epoch, epoch))
        g0.storage.write_bytes(g0.storage.join(g0.job_dir, change_set_name(epoch, 3, "counts", 0)), b"x")
    g1 = log_factory(1)
    assert g1.names() == {}, "an operator restore starts with no decisions"
    assert g1.continuation(committed_epoch=1, routing_version=7) == []
    g1.decide(decision(2, 0, version=7, query="q2"))
    assert g1.decision(2) == decision(2, 0, version=7, query="q2")
    assert g0.decision(2) == decision(2, 2), "generation 0 is untouched by generation 1"

    assert g1.collect_garbage(through_epoch=1) > 0
    root = g1.storage.list(g1.root)
    names = sorted(p.path.rsplit("/", 1)[-1] for p in root)
    assert names == ["2", "3", "g1"], "change sets above the bound stay; generation 0's records are gone"
    assert g1.names() == {2: [0, 1]}, "generation 1's records above the bound stay"
    g1.collect_garbage(through_epoch=2)
    assert g1.names() == {}
    left = sorted(p.path.rsplit("/", 1)[-1] for p in g1.storage.list(g1.root))
    assert [n for n in left if n != "g1"] == ["3"], "g1 itself stays only where directories exist (file://)"


def test_a_corrupt_record_is_refused_naming_the_file(log_factory: LogFactory) -> None:
    log = log_factory(0)
    path = log._record_path(2, 0)
    log.storage.create_exclusive(path, b'{"format_version": 1, "kind": "DECIDED"')
    with pytest.raises(CorruptCheckpointError, match=r"2\.0/_decision is not a decision record"):
        log.decision(2)
    log.storage.create_exclusive(log._record_path(3, 0), b'{"format_version": 7, "kind": "SEALED"}')
    with pytest.raises(CorruptCheckpointError, match="decision format version 7, this runtime reads version 1"):
        log.decision(3)
    moved = decision(5, 5).to_bytes()
    log.storage.create_exclusive(log._record_path(4, 0), moved)
    with pytest.raises(CorruptCheckpointError, match="holds a record of epoch 5"):
        log.decision(4)


def test_bad_arguments_are_refused(log_factory: LogFactory) -> None:
    with pytest.raises(InvalidArgumentError, match="generation is 0 or more"):
        log_factory(-1)
    with pytest.raises(InvalidArgumentError, match="needs an epoch >= 0"):
        log_factory(0).decide(decision(-1, 0))


def test_a_new_generation_is_above_every_generation_in_storage(log_factory: LogFactory) -> None:
    g0 = log_factory(0)
    assert next_generation(g0.storage, g0.job_dir) == 1, "an empty changelog starts at generation 1"
    g0.decide(decision(0, 0))
    assert next_generation(g0.storage, g0.job_dir) == 1
    log_factory(3).decide(decision(0, 0))
    assert next_generation(g0.storage, g0.job_dir) == 4, "numbers only grow, even past a gap"
    # The job's own generation may hold no record yet (a decision in flight): the next one is above it too.
    assert next_generation(g0.storage, g0.job_dir, above=6) == 7
    assert next_generation(g0.storage, g0.job_dir, above=2) == 4


def test_collect_covered_deletes_through_the_oldest_retained_checkpoint(log_factory: LogFactory) -> None:
    log = log_factory(0)
    for epoch in range(4):
        log.decide(decision(epoch, epoch))
        log.storage.write_bytes(log.storage.join(log.job_dir, change_set_name(epoch, 3, "counts", 0)), b"x")
    assert log.collect_covered([]) == 0, "no retained checkpoint covers anything"
    assert log.names() == {e: [0] for e in range(4)}
    # A restore of the checkpoint at epoch 1 replays epochs 2 and 3: they stay until it is no longer retained.
    assert log.collect_covered([3, 1]) > 0
    assert log.names() == {2: [0], 3: [0]}
    assert log.decision(2) == decision(2, 2)
    log.collect_covered([3])
    assert log.names() == {}
    assert [p.path.rsplit("/", 1)[-1] for p in log.storage.list(log.root)] == []
