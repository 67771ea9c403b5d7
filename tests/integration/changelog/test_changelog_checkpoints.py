"""Changelog checkpoints end to end on an in-process cluster: segments in ``_metadata``, restores that replay them.

Every epoch goes through the epoch protocol (the only way state changes reach the changelog),
each committed with a checkpoint; the state served after a restore or a rescale is compared
exactly with the reference of epochs ``0..n`` applied once each.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from keyedstate.common.config import Configuration
from keyedstate.common.errors import CorruptCheckpointError
from keyedstate.common.storage import open_storage
from keyedstate.state_processor import Savepoint, read_columns
from keyedstate.taskmanager.state.metadata import COMMITTED_EPOCH
from tests.integration.checkpoints.conftest import read_metadata
from tests.integration.failover._support import OPERATOR, EpochWriter, key_names, operators

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


@pytest.mark.parametrize("backend", ["rocksdb", "hashmap"])
def test_background_materialization_moves_checkpoints_onto_it_and_drops_covered_segments(
    inprocess_cluster: Callable[..., Any], backend: str
) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=4, backend=backend)
    client = cluster.client()
    job = "cl-mat"
    config = {**CHANGELOG, "state.changelog.periodic-materialize.interval": "300 ms"}
    client.submit_job(job, operators(2), max_parallelism=16, config=config)
    writer = EpochWriter(client, job, key_names(60))
    storage = open_storage(str(cluster.base / "checkpoints"), Configuration({}))
    writer.run(3)
    deadline = time.monotonic() + 30
    meta = read_metadata(storage, client.job_info(job).latest_checkpoint_path)
    while min(s.snapshot_epoch for s in meta.operators[0].subtasks) < 3:
        # A checkpoint takes the newest materialization once it is durable.
        assert time.monotonic() < deadline, f"no checkpoint referenced a materialization after epoch 0: {meta}"
        time.sleep(0.4)
        writer.run(writer.committed + 1)
        meta = read_metadata(storage, client.job_info(job).latest_checkpoint_path)
    for sub in meta.operators[0].subtasks:
        # Uploaded by the materialization, but for the SST files the confirmed one already holds (reused).
        own = [f for f in sub.files if f.path.startswith("../shared/mat-")]
        assert own and all(f in own or f.local_name.endswith(".sst") for f in sub.files), sub.files
        assert all(s.last_epoch > sub.snapshot_epoch for s in sub.changelog)
    # Once a checkpoint referencing the materialization completed, the local segments it covers are gone.
    writer.run(writer.committed + 1)
    latest = read_metadata(storage, client.job_info(job).latest_checkpoint_path)
    for sub in latest.operators[0].subtasks:
        local = sorted((cluster.base / "tm-0").glob(f"**/counts-{sub.subtask_index}*/changelog/*.seg"))
        assert len(local) <= len(sub.changelog) + 1, (local, sub.changelog)
    through = writer.committed
    client.rescale_job(job, 3)
    assert writer.read() == writer.expected(through)


def _every_entry(sp: Savepoint) -> dict[str, list[tuple[int, bytes, bytes, bytes, bytes]]]:
    """Every stored entry of every state, as raw bytes: what a comparison must match exactly."""
    return {
        d.name: sorted(
            (e.key_group, e.key, e.namespace, e.suffix, e.stored_value) for e in sp.entries(OPERATOR, d.name)
        )
        for d in sp.operator(OPERATOR).states
    }


@pytest.mark.parametrize("backend", ["rocksdb", "hashmap"])
def test_the_state_processor_reads_a_changelog_checkpoint_exactly_as_a_savepoint_of_the_same_epoch(
    inprocess_cluster: Callable[..., Any], tmp_path: Path, backend: str
) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=4, backend=backend)
    client = cluster.client()
    job = "cl-sp"
    config = {**CHANGELOG, "state.changelog.periodic-materialize.interval": "300 ms"}
    client.submit_job(job, operators(2), max_parallelism=16, config=config)
    writer = EpochWriter(client, job, key_names(80), blob_bytes=64, blob_epochs=frozenset({0, 3, 7}))
    storage = open_storage(str(cluster.base / "checkpoints"), Configuration({}))
    writer.run(2)
    # A background materialization, then more epochs: the checkpoint is a materialization of a
    # later epoch than the first plus segments on top of it, some overwriting what it holds.
    deadline = time.monotonic() + 30
    while True:
        time.sleep(0.4)
        writer.run(writer.committed + 1)
        meta = read_metadata(storage, client.job_info(job).latest_checkpoint_path)
        if min(s.snapshot_epoch for s in meta.operators[0].subtasks) > 0:
            break
        assert time.monotonic() < deadline, f"no checkpoint referenced a background materialization: {meta}"
    writer.run(writer.committed + 3)
    epoch = writer.committed
    checkpoint = client.job_info(job).latest_checkpoint_path
    meta = read_metadata(storage, checkpoint)
    assert meta.has_changelog and meta.epoch == epoch
    assert all(s.changelog and s.snapshot_epoch < epoch for s in meta.operators[0].subtasks), meta

    savepoint = client.trigger_checkpoint(
        job, savepoint=True, target_directory=(tmp_path / "sps").as_uri(), timeout_s=60
    )
    with Savepoint.open(savepoint.path) as sp:
        assert not sp.metadata.has_changelog and sp.metadata.epoch == epoch
        assert sp.metadata.to_dict()["version"] == 1  # no segments: still the format older releases read
        expected = _every_entry(sp)
        expected_totals = read_columns(sp, OPERATOR, "totals")
    with Savepoint.open(checkpoint) as cp:
        assert _every_entry(cp) == expected
        assert read_columns(cp, OPERATOR, "totals") == expected_totals
        for sub in cp.metadata.operators[0].subtasks:
            assert int(cp.meta(OPERATOR, sub.subtask_index)[COMMITTED_EPOCH]) == epoch
    # And both equal the reference of epochs 0..epoch, applied once each.
    ref = writer.expected(epoch)
    assert len(expected["events"]) == sum(len(v) for v in ref.events.values())
    assert (len(expected["totals"]), len(expected["blob"])) == (len(ref.totals), len(ref.blob))


def test_a_damaged_segment_fails_the_state_processor_naming_it(inprocess_cluster: Callable[..., Any]) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=4)
    client = cluster.client()
    job = "cl-sp-damaged"
    client.submit_job(job, operators(2), max_parallelism=16, config=CHANGELOG)
    writer = EpochWriter(client, job, key_names(40))
    writer.run(3)
    checkpoint = client.job_info(job).latest_checkpoint_path
    storage = open_storage(str(cluster.base / "checkpoints"), Configuration({}))
    segment = read_metadata(storage, checkpoint).operators[0].subtasks[0].changelog[-1]
    path = Path(checkpoint.removeprefix("file://")) / segment.path
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with Savepoint.open(checkpoint) as cp, pytest.raises(CorruptCheckpointError) as info:
        list(cp.entries(OPERATOR, "totals"))
    assert path.name in info.value.message
