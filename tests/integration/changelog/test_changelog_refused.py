"""A job asking for changelog checkpoints is refused with a clear error, not silently checkpointed without them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.errors import ConfigError, KeyedStateError, Reason

OPS = [OperatorSpec("counts", 1, (StateDescriptor("total", StateKind.VALUE),))]


@pytest.mark.parametrize("key", ["state.changelog.enabled", "state.backend.changelog.enabled"])
def test_submitting_a_job_with_changelog_checkpoints_is_refused_naming_the_key(
    inprocess_cluster: Callable[..., Any], key: str
) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=2)
    client = cluster.client()
    with pytest.raises(KeyedStateError) as info:
        client.submit_job("cl-job", OPS, max_parallelism=8, config={key: "true"})
    assert info.value.reason is Reason.CONFIG
    assert isinstance(info.value, ConfigError)  # sent as a CONFIG reason over gRPC, raised typed again here
    assert "state.changelog.enabled: changelog checkpoints are not available" in info.value.message
    assert "execution.checkpointing.incremental: true" in info.value.message
    # Nothing was deployed: the same job id submits cleanly without the key.
    routing = client.submit_job("cl-job", OPS, max_parallelism=8, config={key: "false"})
    assert routing.job_id == "cl-job"
