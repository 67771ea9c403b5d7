"""SlotTable.lookup: only the deployment of the caller's routing version serves a call."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyedstate.common.clock import SYSTEM_CLOCK
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.errors import Reason, StaleRoutingError
from keyedstate.common.ids import JobId, KeyGroupRange, OperatorId, SubtaskId, TaskManagerId
from keyedstate.taskmanager.backends import BackendFactory
from keyedstate.taskmanager.deployment import SlotDeployer
from keyedstate.taskmanager.slots import SlotTable
from keyedstate.taskmanager.state.limits import StateLimits

JOB = JobId("job")
OP = OperatorId("op")
OPERATOR = OperatorSpec("op", 2, (StateDescriptor("v", StateKind.VALUE),))


@pytest.fixture
def table() -> SlotTable:
    t = SlotTable(2, TaskManagerId("tm-a"))
    t.reserve(SubtaskId("job", "op", 0), OPERATOR, KeyGroupRange(0, 63), 128, 0, 7, "", False)
    return t


def test_the_slots_own_version_and_no_version_at_all_find_it(table: SlotTable) -> None:
    assert table.lookup(JOB, OP, 0, 7).routing_version == 7
    assert table.lookup(JOB, OP, 0).routing_version == 7  # None: internal callers, any version


@pytest.mark.parametrize("version", [6, 8, 1 << 32, (1 << 32) + 7])
def test_another_version_is_refused_naming_the_slots_version(table: SlotTable, version: int) -> None:
    with pytest.raises(StaleRoutingError) as info:
        table.lookup(JOB, OP, 0, version)
    assert info.value.reason is Reason.STALE_ROUTING and info.value.current_version == 7
    assert info.value.message == (
        f"job/op/0 on TaskManager tm-a is deployed under routing version 7, the call was routed with version {version}; "
        "refresh the routing table from the JobManager"
    )


def test_a_call_without_a_version_is_refused_naming_the_slots_version(table: SlotTable) -> None:
    with pytest.raises(StaleRoutingError) as info:
        table.lookup(JOB, OP, 0, 0)
    assert info.value.current_version == 7
    assert (
        "carries no routing version; every state call must carry the version of the routing table" in info.value.message
    )


def test_a_subtask_not_hosted_here_is_stale_routing_without_a_version(table: SlotTable) -> None:
    with pytest.raises(StaleRoutingError, match="hosts no slot for job 'job' operator 'op' subtask 1") as info:
        table.lookup(JOB, OP, 1, 7)
    assert info.value.current_version == 0


def test_a_redeployed_subtask_serves_only_its_new_version(table: SlotTable) -> None:
    table.remove(SubtaskId("job", "op", 0))
    table.reserve(SubtaskId("job", "op", 0), OPERATOR, KeyGroupRange(0, 63), 128, 1, 9, "", False)
    assert table.lookup(JOB, OP, 0, 9).index == 1
    with pytest.raises(StaleRoutingError) as info:
        table.lookup(JOB, OP, 0, 7)
    assert info.value.current_version == 9


def test_a_late_deploy_of_an_older_version_is_refused(table: SlotTable) -> None:
    # Version 7 of the job is deployed here; a deploy of version 5 that was delayed must not land.
    with pytest.raises(StaleRoutingError, match=r"takes deployments of job 'job' only from v7 on") as info:
        table.reserve(SubtaskId("job", "op", 1), OPERATOR, KeyGroupRange(64, 127), 128, 1, 5, "", False)
    assert info.value.current_version == 7
    assert table.free_count() == 1
    # The same version and newer ones are fine; another job is not affected.
    table.reserve(SubtaskId("job", "op", 1), OPERATOR, KeyGroupRange(64, 127), 128, 1, 7, "", False)
    table.remove(SubtaskId("job", "op", 1))
    table.reserve(SubtaskId("other", "op", 1), OPERATOR, KeyGroupRange(64, 127), 128, 1, 1, "", False)


def test_the_jobmanagers_versions_at_registration_replace_the_floors(table: SlotTable) -> None:
    # A JobManager restarted without high availability numbers the job's deployments from 1 again.
    table.remove(SubtaskId("job", "op", 0))
    table.set_version_floors({JOB: 1})
    assert (
        table.reserve(SubtaskId("job", "op", 0), OPERATOR, KeyGroupRange(0, 63), 128, 0, 1, "", False).routing_version
        == 1
    )
    # And one that is ahead of what was deployed here raises the floor.
    table.remove(SubtaskId("job", "op", 0))
    table.set_version_floors({JOB: 9})
    with pytest.raises(StaleRoutingError):
        table.reserve(SubtaskId("job", "op", 0), OPERATOR, KeyGroupRange(0, 63), 128, 0, 8, "", False)


def test_a_release_makes_a_late_deploy_of_that_version_stale(table: SlotTable) -> None:
    table.raise_version_floor(JOB, 7)  # the JobManager released deployment 7
    table.remove(SubtaskId("job", "op", 0), up_to_version=7)
    with pytest.raises(StaleRoutingError, match="only from v8 on"):
        table.reserve(SubtaskId("job", "op", 0), OPERATOR, KeyGroupRange(0, 63), 128, 0, 7, "", False)


def test_a_late_release_of_an_older_version_leaves_the_newer_deployment(table: SlotTable) -> None:
    subtask = SubtaskId("job", "op", 0)
    assert table.remove(subtask, up_to_version=6) is None  # the slot is v7: a release for v6 is late
    assert table.lookup(JOB, OP, 0, 7).routing_version == 7
    assert table.remove(subtask, up_to_version=7) is not None
    assert table.get(subtask) is None


def test_a_registration_answer_keeps_a_slot_deployed_after_it_was_decided(tmp_path: Path) -> None:
    """The answer's versions are the jobs' versions when the JobManager decided it: a slot deployed
    under a newer one reached this TaskManager before the answer did, and stays."""
    table = SlotTable(4, TaskManagerId("tm-a"))
    old = SubtaskId("job", "op", 0)  # hosted before: not kept, so released
    new = SubtaskId("job", "op", 1)  # deployed under v6 while the answer (v5) travelled: kept
    kept = SubtaskId("job", "op", 2)  # kept by the answer
    unknown = SubtaskId("gone", "op", 0)  # a job the JobManager does not know: released
    for index, (subtask, version) in enumerate([(kept, 3), (old, 5), (new, 6), (unknown, 9)]):
        table.reserve(subtask, OPERATOR, KeyGroupRange(0, 63), 128, index, version, "", False)
    backends = BackendFactory("hashmap", tmp_path, StateLimits(), None, SYSTEM_CLOCK)
    deployer = SlotDeployer(table, backends, None, SYSTEM_CLOCK)

    released = deployer.retain({kept}, {JOB: 5})

    assert sorted(released, key=str) == sorted([old, unknown], key=str)
    assert sorted((s.subtask for s in table.all()), key=str) == sorted([new, kept], key=str)
