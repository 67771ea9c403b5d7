"""Submitting a changelog job: accepted under either key, refused with the fix for what cannot work.

Direct (non-epoch) writes to a changelog job are refused too: the log holds only epoch commits,
so a direct write would be served and then silently lost at the next restore.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from keyedstate.common.client import ValueState
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.errors import ConfigError, KeyedStateError, Reason
from tests.integration.failover._support import EpochWriter, key_names, operators

OPS = [OperatorSpec("counts", 1, (StateDescriptor("total", StateKind.VALUE),))]


@pytest.mark.parametrize("key", ["state.changelog.enabled", "state.backend.changelog.enabled"])
def test_a_job_with_changelog_checkpoints_runs_and_checkpoints_under_either_key(
    inprocess_cluster: Callable[..., Any], key: str
) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=2)
    client = cluster.client()
    client.submit_job("cl-job", operators(2), max_parallelism=8, config={key: "true"})
    writer = EpochWriter(client, "cl-job", key_names(20))
    writer.run(3)
    assert writer.read() == writer.expected(3)
    assert client.job_info("cl-job").latest_checkpoint_id >= 4


@pytest.mark.parametrize(
    ("extra", "named", "fix"),
    [
        (
            {"execution.checkpointing.storage": "jobmanager"},
            "execution.checkpointing.storage: jobmanager",
            "execution.checkpointing.storage: filesystem",
        ),
        (
            {"state.changelog.dstl.dfs.base-path": "file:///tmp/elsewhere"},
            "state.changelog.dstl.dfs.base-path",
            "remove the key",
        ),
    ],
)
def test_combinations_that_cannot_work_are_refused_naming_the_fix(
    inprocess_cluster: Callable[..., Any], extra: dict[str, str], named: str, fix: str
) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=2)
    client = cluster.client()
    with pytest.raises(KeyedStateError) as info:
        client.submit_job("cl-job", OPS, max_parallelism=8, config={"state.changelog.enabled": "true", **extra})
    assert info.value.reason is Reason.CONFIG
    assert isinstance(info.value, ConfigError)  # sent as a CONFIG reason over gRPC, raised typed again here
    assert named in info.value.message and fix in info.value.message
    # Nothing was deployed: the same job id submits cleanly without the combination.
    routing = client.submit_job("cl-job", OPS, max_parallelism=8, config={"state.changelog.enabled": "true"})
    assert routing.job_id == "cl-job"


def test_a_direct_write_to_a_changelog_job_is_refused_and_reads_still_work(
    inprocess_cluster: Callable[..., Any],
) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=2)
    client = cluster.client()
    client.submit_job("cl-job", OPS, max_parallelism=8, config={"state.changelog.enabled": "true"})
    total: ValueState[str, int] = ValueState(
        client, "cl-job", "counts", "total", key_serializer="str", value_serializer="json"
    )
    with pytest.raises(ConfigError) as info:
        total.put_many(["a"], [1])
    assert "write within an epoch" in info.value.message and "state.changelog.enabled" in info.value.message
    assert total.get_many(["a"]) == [None]
