"""Changelog segments in checkpoint storage: verified on restore, counted by retention and gc.

A segment that is missing, truncated or changed (same size, other bytes) makes a restore fail
with CorruptCheckpointError naming it, before the job is touched: never a restore that silently
lacks epochs. Segments are shared files: once retention subsumes every checkpoint that
references one, it is deleted, and one a retained checkpoint references is never deleted.
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
from keyedstate.jobmanager.checkpoint import plan_gc
from tests.integration.checkpoints.conftest import read_metadata
from tests.integration.failover._support import EpochWriter, key_names, operators, wait_until

CHANGELOG = {
    "state.changelog.enabled": "true",
    "execution.checkpointing.incremental": "true",
    "execution.checkpointing.num-retained": "2",
}


def _segments(job_dir: Path) -> set[Path]:
    return set(job_dir.glob("shared/**/*.seg"))


def _referenced_segments(cluster: Any, job: str) -> dict[Path, str]:
    """Segment file -> checkpoint, for every retained checkpoint of ``job``."""
    storage = open_storage(str(cluster.base / "checkpoints"), Configuration({}))
    out: dict[Path, str] = {}
    for meta_file in (cluster.base / "checkpoints" / job).glob("chk-*/_metadata"):
        meta = read_metadata(storage, meta_file.parent.as_uri())
        for op in meta.operators:
            for sub in op.subtasks:
                for seg in sub.changelog:
                    out[(meta_file.parent / seg.path).resolve()] = meta_file.parent.name
    return out


@pytest.mark.parametrize("damage", ["missing", "truncated", "changed"])
def test_a_damaged_segment_fails_the_restore_naming_it_and_the_job_keeps_its_state(
    inprocess_cluster: Callable[..., Any], damage: str
) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=4)
    client = cluster.client()
    job = "cl-corrupt"
    client.submit_job(job, operators(2), max_parallelism=16, config=CHANGELOG)
    writer = EpochWriter(client, job, key_names(50))
    writer.run(4)
    source = Path(client.job_info(job).latest_checkpoint_path.removeprefix("file://"))
    segment = sorted(p for p, chk in _referenced_segments(cluster, job).items() if chk == source.name)[-1]
    data = segment.read_bytes()
    if damage == "missing":
        segment.unlink()
    elif damage == "truncated":
        segment.write_bytes(data[:-3])
    else:
        segment.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    writer.run(5)
    with pytest.raises(CorruptCheckpointError) as info:
        client.restore_job(job, str(source))
    assert segment.name in info.value.message
    # The restore changed nothing: the job still serves epochs 0..5.
    assert writer.read() == writer.expected(5)


def test_retention_deletes_segments_no_checkpoint_references_and_keeps_the_others(
    inprocess_cluster: Callable[..., Any],
) -> None:
    cluster = inprocess_cluster(taskmanagers=1, slots=4)
    client = cluster.client()
    job = "cl-gc"
    config = {**CHANGELOG, "state.changelog.periodic-materialize.interval": "200 ms"}
    client.submit_job(job, operators(2), max_parallelism=16, config=config)
    job_dir = cluster.base / "checkpoints" / job
    writer = EpochWriter(client, job, key_names(50))
    writer.run(3)
    early = _segments(job_dir)
    assert early, "checkpoints after the first upload segments"
    # Materializations move the checkpoints past the early segments; retention (2) then drops
    # every checkpoint that referenced them.
    for _ in range(12):
        writer.run(writer.committed + 1)
        time.sleep(0.25)
    writer.run(writer.committed + 2)
    # Subsumed checkpoints go after their files: until then a subsumed _metadata names deleted segments.
    wait_until(
        lambda: len(list(job_dir.glob("chk-*/_metadata"))) == 2,
        "retention to leave the 2 retained checkpoints",
        timeout_s=15,
    )
    referenced = _referenced_segments(cluster, job)
    assert referenced, "the retained checkpoints reference segments"
    wait_until(
        lambda: not (early - set(referenced)) & _segments(job_dir),
        "the segments of subsumed checkpoints to be deleted",
        timeout_s=15,
    )
    on_disk = {p.resolve() for p in _segments(job_dir)}
    assert set(referenced) <= on_disk, f"a referenced segment was deleted: {set(referenced) - on_disk}"
    # An offline gc agrees: nothing referenced is garbage.
    storage = open_storage(str(cluster.base / "checkpoints"), Configuration({}))
    plan = plan_gc(storage, job_dir.as_uri(), num_retained=2)
    removed = {Path(e.path.removeprefix("file://")).resolve() for e in plan.remove}
    assert not removed & set(referenced), plan.describe()
