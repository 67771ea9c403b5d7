"""execution.checkpointing.commit-mode: sync is the default; overlapped is refused at submission, clearly.

The overlapped runtime's parts (change sets, decisions, the read fence, the replay) exist, but the
JobManager's commit path does not use them yet, so a job asking for overlapped commits must not be
accepted and then silently committed synchronously.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from keyedstate.common.config import Configuration
from keyedstate.common.config import options as o
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.errors import ConfigError, KeyedStateError, Reason

OPS = [OperatorSpec("counts", 1, (StateDescriptor("total", StateKind.VALUE),))]


def test_the_commit_mode_defaults_to_sync_and_refuses_unknown_modes() -> None:
    assert Configuration().get(o.CHECKPOINT_COMMIT_MODE) == "sync"
    assert Configuration({"execution.checkpointing.commit-mode": "overlapped"}).get(o.CHECKPOINT_COMMIT_MODE) == (
        "overlapped"
    )
    with pytest.raises(ConfigError, match="execution.checkpointing.commit-mode"):
        Configuration({"execution.checkpointing.commit-mode": "async"}).get(o.CHECKPOINT_COMMIT_MODE)


def test_submitting_a_job_with_overlapped_commits_is_refused_naming_the_key(
    inprocess_cluster: Callable[..., Any],
) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=2)
    client = cluster.client()
    with pytest.raises(KeyedStateError) as info:
        client.submit_job(
            "ov-job", OPS, max_parallelism=8, config={"execution.checkpointing.commit-mode": "overlapped"}
        )
    assert info.value.reason is Reason.CONFIG
    assert isinstance(info.value, ConfigError)
    assert "execution.checkpointing.commit-mode: overlapped commits are not available" in info.value.message
    assert "set it to sync" in info.value.message
    routing = client.submit_job(
        "ov-job", OPS, max_parallelism=8, config={"execution.checkpointing.commit-mode": "sync"}
    )
    assert routing.job_id == "ov-job"
