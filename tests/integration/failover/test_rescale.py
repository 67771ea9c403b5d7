"""Rescaling through key groups with the real command line: ``statectl job rescale JOB
--parallelism N`` from 2 to 3 and then to 1, with every key checked after each step.

Each new slot must hold only its own key groups: the test opens every slot's RocksDB read-only
(from outside the TaskManager process) and checks the key group of every stored key, and the
TaskManagers must have clipped the rest by key-group prefix. A restore that tries to change the
max parallelism must fail, saying it is fixed for a job's life.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
import rocksdict

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common.errors import IncompatibleCheckpointError
from keyedstate.common.ids import KeyGroupRange, SubtaskId
from keyedstate.common.keygroups import key_group_range_for_subtask
from keyedstate.taskmanager.state.metadata import DEFAULT_CF, META_CF
from tests.integration.failover._support import (
    OPERATOR,
    EpochWriter,
    assert_no_orphans,
    assert_state_equals,
    key_names,
    operators,
    wait_for_job,
)
from tests.integration.failover.conftest import FailoverCluster

pytestmark = pytest.mark.s3

MAX_P = 128


def stored_key_groups(db_dir: Path) -> dict[str, set[int]]:
    """The key groups of every key stored in each state's column family of a slot's RocksDB."""
    for attempt in range(3):
        try:
            return _read_key_groups(db_dir)
        except Exception:  # a background compaction replaced a file between listing and opening it
            if attempt == 2:
                raise
            time.sleep(0.2)
    raise AssertionError("unreachable")


def _read_key_groups(db_dir: Path) -> dict[str, set[int]]:
    options = rocksdict.Options(raw_mode=True)
    names = [n for n in rocksdict.Rdict.list_cf(str(db_dir), options) if n not in (DEFAULT_CF, META_CF)]
    # Read-only: the TaskManager holds the DB open (and its lock); this sees it as of now, WAL included.
    db = rocksdict.Rdict(
        str(db_dir),
        options,
        column_families={n: rocksdict.Options(raw_mode=True) for n in names},
        access_type=rocksdict.AccessType.read_only(),
    )
    try:
        out = {}
        for name in names:
            cf = db.get_column_family(name)
            out[name] = {int.from_bytes(cast(bytes, k)[:2], "big") for k in cf.keys()}  # noqa: SIM118 - a column family is not iterable
            del cf
        return out
    finally:
        db.close()


def assert_slots_hold_only_their_key_groups(cluster: FailoverCluster, job: str, parallelism: int) -> None:
    client = cluster.client()
    try:
        placement = cluster.placement(client, job)
    finally:
        client.close()
    assert sorted(placement) == list(range(parallelism))
    covered: set[int] = set()
    for subtask, tm in placement.items():
        own = key_group_range_for_subtask(MAX_P, parallelism, subtask)
        instance = SubtaskId(job, OPERATOR, subtask).instance_dir_name()
        db_dir = cluster.local_dir(tm) / f"tm_tm-{tm}" / instance / "db"
        stored = stored_key_groups(db_dir)
        assert stored["events"], f"subtask {subtask} holds no state at all"
        for state, groups in stored.items():
            foreign = sorted(g for g in groups if not own.start <= g <= own.end)
            assert not foreign, (
                f"subtask {subtask}/{parallelism} ({own}) still stores {state!r} of key groups {foreign[:10]}"
            )
            covered |= groups
    assert len(covered) > MAX_P // 2, "the keys should spread over most key groups"


def test_rescale_from_2_to_3_to_1_with_statectl(failover_cluster: Callable[..., FailoverCluster]) -> None:
    cluster = failover_cluster(taskmanagers=2, slots=2)
    job = "rescale"
    client = cluster.client()
    client.submit_job(job, operators(2), max_parallelism=MAX_P)
    writer = EpochWriter(cluster.client(), job, key_names(3000))
    writer.run(2)
    assert_state_equals(writer.read(), writer.expected(2))
    offsets = [cluster.log_size(i) for i in range(2)]

    for parallelism, through in ((3, 4), (1, 6)):
        done = cluster.statectl("job", "rescale", job, "--parallelism", str(parallelism))
        assert done.returncode == 0, done.stderr
        assert f"job {job} rescaled to parallelism {parallelism}" in done.stdout
        info = client.job_info(job)
        assert info.status == pb.JOB_STATUS_RUNNING and [op.parallelism for op in info.operators] == [parallelism]
        # Every key after the move, then more epochs at the new parallelism.
        assert_state_equals(writer.read(), writer.expected(writer.committed))
        assert_slots_hold_only_their_key_groups(cluster, job, parallelism)
        writer.run(through)
        assert_state_equals(writer.read(), writer.expected(through))

    # Subtasks whose new range only partly overlapped an old snapshot clipped the rest by key-group prefix.
    logs = "".join(cluster.log_since(i, offsets[i]) for i in range(2))
    clipped = re.findall(r"clipped RocksDB state of \S+ from key groups \[(\d+), (\d+)\] to \[(\d+), (\d+)\]", logs)
    assert clipped, "no restore clipped foreign key groups"
    for old_start, old_end, new_start, new_end in clipped:
        assert KeyGroupRange(int(old_start), int(old_end)) != KeyGroupRange(int(new_start), int(new_end))

    latest = client.job_info(job).latest_checkpoint_path
    assert_no_orphans(cluster.storage, cluster.job_dir(job), [latest])

    # The max parallelism is fixed for the job's life: a restore that changes it is refused.
    client.cancel_job(job)
    with pytest.raises(IncompatibleCheckpointError, match="fixed for a job's life") as refused:
        client.submit_job(job, operators(1), max_parallelism=2 * MAX_P, restore_path=latest)
    assert f"pipeline.max-parallelism: {MAX_P}" in refused.value.message
    # The refused restore changed nothing in storage, and the right one still works.
    assert_no_orphans(cluster.storage, cluster.job_dir(job), [latest])
    client.submit_job(job, operators(1), max_parallelism=MAX_P, restore_path=latest)
    assert wait_for_job(client, job, {"RUNNING"}).committed_epoch == 6
    assert_state_equals(writer.read(), writer.expected(6))


def test_statectl_refuses_a_rescale_beyond_the_free_slots_and_the_job_keeps_running(
    failover_cluster: Callable[..., FailoverCluster],
) -> None:
    cluster = failover_cluster(taskmanagers=2, slots=2)
    job = "rescale-refused"
    client = cluster.client()
    client.submit_job(job, operators(2), max_parallelism=MAX_P)
    writer = EpochWriter(cluster.client(), job, key_names(500))
    writer.run(1)

    refused = cluster.statectl("job", "rescale", job, "--parallelism", "5")
    assert refused.returncode == 1, (refused.stdout, refused.stderr)
    assert "needs 5 slots but only 4 are available" in refused.stderr and "start more TaskManagers" in refused.stderr
    info = client.job_info(job)
    assert info.status == pb.JOB_STATUS_RUNNING and [op.parallelism for op in info.operators] == [2], info
    writer.run(2)
    assert_state_equals(writer.read(), writer.expected(2))

    # The JobManager itself must refuse it too (a client other than statectl asks it directly).
    from keyedstate.common.errors import CapacityError

    with pytest.raises(CapacityError, match="needs 5 slots"):
        client.rescale_job(job, 5)
    # Refused before anything was released: the job runs on at its old parallelism.
    assert client.job_info(job).status == pb.JOB_STATUS_RUNNING
    writer.run(3)
    assert_state_equals(writer.read(), writer.expected(3))
