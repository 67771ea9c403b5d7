"""A model test of changelog checkpoints: random epochs, checkpoints, materializations, restores and rescales.

From a seed, a schedule mixes epochs committed with or without a checkpoint, pauses that let
background materializations (every 100 ms) run between checkpoints, restores of a random
retained checkpoint (materialization plus segments, or a self-materialized first one) and
rescales to a random parallelism. After every restore or rescale, and at the end, the state the
cluster serves is compared exactly with the reference: epochs ``0..n`` applied once each, ``n``
being the restored checkpoint's epoch. Both backends; the seed is in the test id.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import pytest

from keyedstate.common.config import Configuration
from keyedstate.common.storage import open_storage
from tests.integration.checkpoints.conftest import read_metadata
from tests.integration.failover._support import RETRYABLE, EpochWriter, key_names, operators, wait_for_job

CONFIG = {
    "state.changelog.enabled": "true",
    "state.changelog.periodic-materialize.interval": "100 ms",
    "execution.checkpointing.incremental": "true",
    "execution.checkpointing.num-retained": "3",
}


@pytest.mark.parametrize("backend", ["rocksdb", "hashmap"])
@pytest.mark.parametrize("seed", [1, 2])
def test_random_schedule_matches_the_reference_after_every_restore(
    inprocess_cluster: Callable[..., Any], backend: str, seed: int
) -> None:
    rnd = random.Random(seed)
    cluster = inprocess_cluster(taskmanagers=2, slots=3, backend=backend)
    client = cluster.client()
    job = f"cl-model-{seed}"
    client.submit_job(job, operators(2), max_parallelism=16, config=CONFIG)
    writer = EpochWriter(
        client, job, key_names(80), blob_bytes=48, blob_epochs=frozenset(e for e in range(200) if rnd.random() < 0.4)
    )
    writer.run(0)
    storage = open_storage(str(cluster.base / "checkpoints"), Configuration({}))
    restores = rescales = 0
    log: list[str] = []
    for _ in range(40):
        action = rnd.random()
        if action < 0.55:
            checkpoint = rnd.random() < 0.6
            epoch = _commit(client, writer, job, checkpoint)
            log.append(f"epoch {epoch}{' +chk' if checkpoint else ''}")
        elif action < 0.7:
            time.sleep(0.15)  # a materialization of each slot runs meanwhile
            log.append("pause")
        elif action < 0.88:
            # The retained checkpoints: those whose _metadata is still in storage.
            retained = sorted((cluster.base / "checkpoints" / job).glob("chk-*/_metadata"))
            source = read_metadata(storage, rnd.choice(retained).parent.as_uri())
            path = str(cluster.base / "checkpoints" / job / f"chk-{source.checkpoint_id}")
            client.restore_job(job, path)
            writer.committed = source.epoch
            restores += 1
            log.append(f"restore chk-{source.checkpoint_id} (epoch {source.epoch}, changelog {source.has_changelog})")
            assert writer.read() == writer.expected(source.epoch), log
        else:
            parallelism = rnd.choice([1, 2, 3])
            client.rescale_job(job, parallelism)
            rescales += 1
            log.append(f"rescale to {parallelism}")
            assert writer.read() == writer.expected(writer.committed), log
    writer.run(writer.committed + 1)
    assert writer.read() == writer.expected(writer.committed), log
    assert restores and rescales, f"the schedule of seed {seed} restored {restores} and rescaled {rescales} times"
    assert any("changelog True" in step for step in log), f"no restore replayed segments: {log}"


def _commit(client: Any, writer: EpochWriter, job: str, checkpoint: bool) -> int:
    """Commit the next epoch (with a checkpoint or not), as the driver does: a try the cluster
    interrupts (a lease that ran out under load, a redeploy) runs again from the job's epoch."""
    deadline = time.monotonic() + 60
    while True:
        epoch = writer.committed + 1
        try:
            version = client.routing(job, refresh=True).version
            winners = writer.stage(epoch)
            client.commit_epoch(
                job,
                epoch,
                winners,
                checkpoint=checkpoint,
                wait_for_checkpoint=checkpoint,
                expected_routing_version=version,
                timeout_s=60,
            )
            writer.committed = epoch
            return epoch
        except RETRYABLE:
            assert time.monotonic() < deadline, f"epoch {epoch} did not commit within 60 s"
            time.sleep(0.2)
            writer.committed = wait_for_job(client, job, {"RUNNING"}).committed_epoch
