"""SlotTable.lookup: only the deployment of the caller's routing version serves a call."""

from __future__ import annotations

import pytest

from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.errors import Reason, StaleRoutingError
from keyedstate.common.ids import KeyGroupRange, SubtaskId
from keyedstate.taskmanager.slots import SlotTable

OPERATOR = OperatorSpec("op", 2, (StateDescriptor("v", StateKind.VALUE),))


@pytest.fixture
def table() -> SlotTable:
    t = SlotTable(2, "tm-a")
    t.reserve(SubtaskId("job", "op", 0), OPERATOR, KeyGroupRange(0, 63), 128, 0, 7, "", False)
    return t


def test_the_slots_own_version_and_no_version_at_all_find_it(table: SlotTable) -> None:
    assert table.lookup("job", "op", 0, 7).routing_version == 7
    assert table.lookup("job", "op", 0).routing_version == 7  # None: internal callers, any version


@pytest.mark.parametrize("version", [6, 8, 1 << 32, (1 << 32) + 7])
def test_another_version_is_refused_naming_the_slots_version(table: SlotTable, version: int) -> None:
    with pytest.raises(StaleRoutingError) as info:
        table.lookup("job", "op", 0, version)
    assert info.value.reason is Reason.STALE_ROUTING and info.value.current_version == 7
    assert info.value.message == (
        f"job/op/0 on TaskManager tm-a is deployed under routing version 7, the call was routed with version {version}; "
        "refresh the routing table from the JobManager"
    )


def test_a_call_without_a_version_is_refused_naming_the_slots_version(table: SlotTable) -> None:
    with pytest.raises(StaleRoutingError) as info:
        table.lookup("job", "op", 0, 0)
    assert info.value.current_version == 7
    assert "carries no routing version; every state call must carry the version of the routing table" in info.value.message


def test_a_subtask_not_hosted_here_is_stale_routing_without_a_version(table: SlotTable) -> None:
    with pytest.raises(StaleRoutingError, match="hosts no slot for job 'job' operator 'op' subtask 1") as info:
        table.lookup("job", "op", 1, 7)
    assert info.value.current_version == 0


def test_a_redeployed_subtask_serves_only_its_new_version(table: SlotTable) -> None:
    table.remove(SubtaskId("job", "op", 0))
    table.reserve(SubtaskId("job", "op", 0), OPERATOR, KeyGroupRange(0, 63), 128, 1, 9, "", False)
    assert table.lookup("job", "op", 0, 9).index == 1
    with pytest.raises(StaleRoutingError) as info:
        table.lookup("job", "op", 0, 7)
    assert info.value.current_version == 9
