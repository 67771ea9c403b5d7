"""What operators see of checkpoints: ``_metadata`` read with plain Python, and Prometheus metrics.

The snippet in :mod:`keyedstate.jobmanager.checkpoint.metadata`'s docstring is run as written
(only its example path replaced) in a separate interpreter, against a real checkpoint. The
JobManager's and TaskManagers' registries are read as a Prometheus scrape would read them.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest

import keyedstate.jobmanager.checkpoint.metadata as metadata_module
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from tests.integration.checkpoints.conftest import (
    JOB,
    MAX_P,
    CheckpointCluster,
    Workload,
    key_names,
    operators,
    read_metadata,
)

EXAMPLE_PATH = "/checkpoints/orders/chk-42/_metadata"


def _docstring_snippet() -> str:
    doc = metadata_module.__doc__ or ""
    block = doc[doc.index("needs nothing but ``json``::") :].split("::", 1)[1]
    lines = []
    for line in block.splitlines()[1:]:
        if line.strip() and not line.startswith("    "):
            break
        lines.append(line)
    return textwrap.dedent("\n".join(lines)).strip() + "\n"


def test_metadata_snippet_from_the_docstring_lists_every_file_of_a_real_checkpoint(
    checkpoint_cluster: Callable[..., CheckpointCluster], tmp_path: Path
) -> None:
    cc = checkpoint_cluster("file", "rocksdb")
    client = cc.client()
    client.submit_job(JOB, operators(3), max_parallelism=MAX_P, config={"execution.checkpointing.incremental": "true"})
    Workload(client).write(key_names(500), "a")
    info = client.trigger_checkpoint(JOB, timeout_s=60)
    assert info.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, info.failure_reason

    snippet = _docstring_snippet()
    assert snippet.count(EXAMPLE_PATH) == 1 and snippet.startswith("import json\n")
    real_path = info.path.removeprefix("file://") + "/_metadata"
    script = tmp_path / "list_files.py"
    script.write_text(snippet.replace(EXAMPLE_PATH, real_path))
    # -I: isolated from PYTHONPATH and the user's site; the snippet needs nothing but json.
    run = subprocess.run([sys.executable, "-I", str(script)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr

    meta = read_metadata(cc.storage, info.path)
    expected = sorted(f"sessions {sub} {f.path} {f.size}" for _, sub, f in meta.files())
    assert sorted(run.stdout.splitlines()) == expected
    # And the sizes it prints are those of the files in storage.
    base = Path(info.path.removeprefix("file://"))
    for line in run.stdout.splitlines():
        _, _, rel, size = line.split()
        assert (base / rel).resolve().stat().st_size == int(size)


def _value(registry: Any, name: str, **labels: str) -> float | None:
    value: float | None = registry.get_sample_value(name, labels)
    return value


def _sample(registry: Any, name: str, **labels: str) -> float:
    """The sample, which must exist: the tests compare it with a bound."""
    value = _value(registry, name, **labels)
    assert value is not None, f"{name} {labels} has no sample"
    return value


def test_checkpoint_metrics_on_the_jobmanager_and_taskmanagers(
    checkpoint_cluster: Callable[..., CheckpointCluster],
) -> None:
    cc = checkpoint_cluster("file", "rocksdb")
    client = cc.client()
    client.submit_job(
        JOB,
        operators(3),
        max_parallelism=MAX_P,
        config={
            "execution.checkpointing.incremental": "true",
            "execution.checkpointing.tolerable-failed-checkpoints": "5",
        },
    )
    work = Workload(client)
    jm = cc.cluster.jobmanager.metrics_registry
    assert _value(jm, "flink_jobmanager_job_numberOfCompletedCheckpoints", job_id=JOB) == 0
    assert _value(jm, "flink_jobmanager_job_lastCheckpointRestoreTimestamp", job_id=JOB) == -1

    infos = []
    for n in range(3):
        work.write(key_names(400, f"r{n}"), f"r{n}")
        info = client.trigger_checkpoint(JOB, timeout_s=60)
        assert info.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, info.failure_reason
        infos.append(info)
    last = infos[-1]
    expect = {
        "lastCompletedCheckpointId": last.checkpoint_id,
        "numberOfCompletedCheckpoints": 3,
        "numberOfFailedCheckpoints": 0,
        "numberOfInProgressCheckpoints": 0,
        "totalNumberOfCheckpoints": 3,
        "lastCheckpointSize": last.incremental_size,
        "lastCheckpointFullSize": last.full_size,
    }
    for name, value in expect.items():
        assert _value(jm, f"flink_jobmanager_job_{name}", job_id=JOB) == value, name
    assert 0 <= _sample(jm, "flink_jobmanager_job_lastCheckpointDuration", job_id=JOB) < 60_000
    assert last.incremental_size < last.full_size, "the third incremental checkpoint reused files"

    # Per slot on the TaskManagers: one sync and one async observation per checkpoint, and the
    # uploaded bytes add up to what the checkpoints report as incremental size.
    uploaded = 0.0
    slots = 0
    for tm in cc.cluster.taskmanagers:
        for slot in tm.slots.all():
            labels = {"job_id": JOB, "operator_id": "sessions", "subtask_index": str(slot.subtask.subtask_index)}
            assert (
                _value(
                    tm.registry,
                    "keyedstate_taskmanager_job_task_operator_checkpoint_sync_duration_seconds_count",
                    **labels,
                )
                == 3
            )
            assert (
                _value(
                    tm.registry,
                    "keyedstate_taskmanager_job_task_operator_checkpoint_async_duration_seconds_count",
                    **labels,
                )
                == 3
            )
            assert (
                _sample(
                    tm.registry,
                    "keyedstate_taskmanager_job_task_operator_checkpoint_sync_duration_seconds_sum",
                    **labels,
                )
                >= 0
            )
            uploaded += (
                _value(
                    tm.registry, "keyedstate_taskmanager_job_task_operator_checkpoint_uploaded_bytes_total", **labels
                )
                or 0
            )
            slots += 1
        text = generate_latest(tm.registry).decode()
        assert "keyedstate_taskmanager_job_task_operator_checkpoint_uploaded_bytes_total{" in text
    assert slots == 3
    assert uploaded == sum(i.incremental_size for i in infos)

    # A declined checkpoint is counted by reason; a restore sets the restore timestamp.
    blocker = Path(cc.job_dir().removeprefix("file://")) / "chk-4" / "sessions-0"
    blocker.parent.mkdir()
    blocker.write_bytes(b"")
    assert client.trigger_checkpoint(JOB, timeout_s=60).status == jm_pb.CHECKPOINT_STATUS_FAILED
    assert _value(jm, "flink_jobmanager_job_numberOfFailedCheckpoints", job_id=JOB) == 1
    assert (
        _value(jm, "keyedstate_jobmanager_job_checkpoint_failures_total", job_id=JOB, reason="CHECKPOINT_DECLINED") == 1
    )
    assert _value(jm, "flink_jobmanager_job_lastCompletedCheckpointId", job_id=JOB) == last.checkpoint_id
    client.cancel_job(JOB)
    client.submit_job(JOB, operators(3), max_parallelism=MAX_P, restore_path=last.path)
    assert _sample(jm, "flink_jobmanager_job_lastCheckpointRestoreTimestamp", job_id=JOB) > 0
    restore_ms = [
        _value(
            tm.registry,
            "keyedstate_taskmanager_job_task_operator_restore_duration_seconds",
            job_id=JOB,
            operator_id="sessions",
            subtask_index=str(s.subtask.subtask_index),
        )
        for tm in cc.cluster.taskmanagers
        for s in tm.slots.all()
    ]
    assert len(restore_ms) == 3 and all(v is not None and v >= 0 for v in restore_ms)
    assert "flink_jobmanager_job_lastCompletedCheckpointId{" in generate_latest(jm).decode()
