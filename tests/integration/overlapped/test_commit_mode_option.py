"""execution.checkpointing.commit-mode: sync by default; overlapped needs checkpoint files that outlive the JobManager."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from keyedstate.common.config import Configuration
from keyedstate.common.config import options as o
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.errors import ConfigError, KeyedStateError, Reason

OPS = [OperatorSpec("counts", 1, (StateDescriptor("total", StateKind.VALUE),))]
MODE = "execution.checkpointing.commit-mode"


def test_the_commit_mode_defaults_to_sync_and_refuses_unknown_modes() -> None:
    assert Configuration().get(o.CHECKPOINT_COMMIT_MODE) == "sync"
    assert Configuration({MODE: "overlapped"}).get(o.CHECKPOINT_COMMIT_MODE) == "overlapped"
    with pytest.raises(ConfigError, match="execution.checkpointing.commit-mode"):
        Configuration({MODE: "async"}).get(o.CHECKPOINT_COMMIT_MODE)


def test_overlapped_commits_are_accepted_with_filesystem_storage_and_refused_with_jobmanager_storage(
    inprocess_cluster: Callable[..., Any],
) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=2)  # state.checkpoints.dir is set
    client = cluster.client()
    routing = client.submit_job("ov-job", OPS, max_parallelism=8, config={MODE: "overlapped"})
    assert routing.job_id == "ov-job"
    with pytest.raises(KeyedStateError) as info:
        client.submit_job(
            "ov-mem",
            OPS,
            max_parallelism=8,
            config={MODE: "overlapped", "execution.checkpointing.storage": "jobmanager"},
        )
    assert info.value.reason is Reason.CONFIG and isinstance(info.value, ConfigError)
    assert "overlapped commits keep every epoch's change sets and decision in checkpoint storage" in info.value.message
    assert "execution.checkpointing.storage: filesystem with state.checkpoints.dir" in info.value.message
    # Nothing was deployed: the same job id submits cleanly in sync mode.
    assert client.submit_job("ov-mem", OPS, max_parallelism=8, config={MODE: "sync"}).job_id == "ov-mem"


def test_overlapped_commits_are_accepted_with_changelog_checkpoints(inprocess_cluster: Callable[..., Any]) -> None:
    """Both at once: tests/integration/changelog/test_changelog_overlapped_kill.py proves restores keep every epoch."""
    client = inprocess_cluster(taskmanagers=1, slots=2).client()
    config = {MODE: "overlapped", "state.changelog.enabled": "true"}
    assert client.submit_job("ov-changelog", OPS, max_parallelism=8, config=config).job_id == "ov-changelog"
