"""Changelog checkpoints end to end on an in-process cluster: segments in ``_metadata``, restores that replay them.

Every epoch goes through the epoch protocol (the only way state changes reach the changelog),
each committed with a checkpoint; the state served after a restore or a rescale is compared
exactly with the reference of epochs ``0..n`` applied once each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from keyedstate.common.config import Configuration
from keyedstate.common.storage import open_storage
from tests.integration.checkpoints.conftest import read_metadata
from tests.integration.failover._support import EpochWriter, key_names, operators

CHANGELOG = {"state.changelog.enabled": "true", "execution.checkpointing.incremental": "true"}


@pytest.mark.parametrize("backend", ["rocksdb", "hashmap"])
def test_checkpoints_reference_segments_and_a_rescale_replays_them(
    inprocess_cluster: Callable[..., Any], backend: str
) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=5, backend=backend)
    client = cluster.client()
    job = "cl-rescale"
    client.submit_job(job, operators(2), max_parallelism=16, config=CHANGELOG)
    writer = EpochWriter(client, job, key_names(60))
    writer.run(5)
    info = client.job_info(job)
    storage = open_storage(str(cluster.base / "checkpoints"), Configuration({}))
    meta = read_metadata(storage, info.latest_checkpoint_path)
    assert meta.epoch == 5
    for sub in meta.operators[0].subtasks:
        # The first checkpoint (epoch 0) materialized; every later one adds segments on top of it.
        assert sub.materialized_epoch == 0, sub
        assert sub.changelog[0].first_epoch == 1
        assert sub.changelog[-1].last_epoch == 5
    client.rescale_job(job, 3)
    assert writer.read() == writer.expected(5)
    writer.run(7)
    assert writer.read() == writer.expected(7)
