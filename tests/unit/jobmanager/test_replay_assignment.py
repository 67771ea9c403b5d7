"""Which decided change sets each deployed slot folds in (overlapped commits' restores)."""

from __future__ import annotations

from keyedstate.common.changesets import ChangeSetFile, change_set_name
from keyedstate.common.ids import JobId, KeyGroupRange, OperatorId, SubtaskId, TaskManagerId
from keyedstate.jobmanager.dispatcher import _replay_for
from keyedstate.jobmanager.jobs import RestorePlan
from keyedstate.jobmanager.scheduling import SlotAssignment


def _file(epoch: int, op: str, index: int) -> ChangeSetFile:
    return ChangeSetFile(epoch, op, index, change_set_name(epoch, 7, op, index), 10, "0" * 64)


def _slot(op: str, index: int) -> SlotAssignment:
    return SlotAssignment(
        SubtaskId(JobId("j"), OperatorId(op), index), KeyGroupRange(0, 7), TaskManagerId("tm"), "a:1", 0
    )


def test_a_slot_gets_only_its_operators_change_sets_and_its_own_when_the_parallelism_held() -> None:
    files = [_file(e, op, i) for e in (3, 4) for op, n in (("a", 2), ("b", 1)) for i in range(n)]
    plan = RestorePlan(epoch=4, replay=tuple(files))
    assert _replay_for(plan, _slot("a", 1), parallelism=2) == (_file(3, "a", 1), _file(4, "a", 1))
    assert _replay_for(plan, _slot("b", 0), parallelism=1) == (_file(3, "b", 0), _file(4, "b", 0))


def test_after_a_parallelism_change_a_slot_gets_every_change_set_of_its_operator() -> None:
    # Epoch 3 ran at parallelism 2, the restore deploys 3 slots: key groups moved, each slot filters.
    files = (_file(3, "a", 0), _file(3, "a", 1))
    plan = RestorePlan(epoch=3, replay=files)
    assert _replay_for(plan, _slot("a", 2), parallelism=3) == files
    assert _replay_for(RestorePlan(epoch=3), _slot("a", 0), parallelism=3) == ()
