"""A TaskManager cut off from the JobManager only, while clients still reach it, must stop serving
once its key groups have moved: never two owners of a key group, never an acknowledged write lost.

Each daemon runs in its own network namespace (tests/fixtures/netns.py); the test process is the
host ``local`` and reaches every daemon throughout. The JobManager declares the cut-off
TaskManager lost after ``heartbeat.timeout`` and redeploys its key groups on the other one; a
client that still holds the old routing table keeps calling the deposed TaskManager, which must
refuse (fencing, routing-version checks) instead of acknowledging writes that the new owner
never sees.

* Direct mode: writers in the test process append to a ListState. The job restores its last
  checkpoint on failover, so writes acknowledged *before* the new deployment ran may be lost;
  every append acknowledged after it must survive the heal exactly once, and after it only the
  new owner may acknowledge anything.
* Epoch mode: a PySpark streaming query through ``KeyedStateRuntime.foreach_batch``; its
  executors' Python workers are reused and cache one client (and routing table) each. Every
  key's count, sum and event multiset must equal the plain-Python reference.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common.minicluster import MiniCluster
from tests.fixtures.netns import Host, VirtualNetwork
from tests.fixtures.waiting import wait_for
from tests.integration.partitions import _partitions as workload
from tests.integration.partitions._partitions import (
    PARTITION_CONFIG,
    AppendWriter,
    JobMonitor,
    StreamingRun,
    direct_mode_report,
    epoch_mode_report,
    fast_client,
    keys_by_subtask,
    make_events,
    operators,
    read_lists,
    read_state,
    reference,
    taskmanager_of,
    write_parquet_files,
)

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]


def _three_hosts(
    netns: VirtualNetwork, tmp_path: Path, slot_processes: int = 1
) -> tuple[MiniCluster, Host, list[Host]]:
    """JobManager and two TaskManagers, each on its own host; returns (cluster, jm host, tm hosts)."""
    jm, tm0, tm1 = (netns.add_host(n) for n in ("jm", "tm0", "tm1"))
    config = {**PARTITION_CONFIG, "taskmanager.slot-processes": str(slot_processes)}
    cluster = netns.minicluster(tmp_path, jm_host=jm, tm_hosts=[tm0, tm1], slots=2, config=config)
    return cluster, jm, [tm0, tm1]


# With 2 slot processes per TaskManager the deposed TaskManager's lease must fence the slot process
# serving the cut-off subtask, which clients reach on its own port.
@pytest.mark.parametrize("slot_processes", [1, 2], ids=["one-process", "slot-processes-2"])
def test_direct_writes_acknowledged_after_failover_survive_and_the_deposed_taskmanager_refuses(
    netns: VirtualNetwork, tmp_path: Path, slot_processes: int
) -> None:
    cluster, jm, tm_hosts = _three_hosts(netns, tmp_path, slot_processes)
    address = cluster.jobmanager_address
    job = "direct"
    admin = fast_client(address)
    routing = admin.submit_job(job, operators(2))
    # One subtask per TaskManager (slots are spread); tm-1's subtask is the one whose owner gets cut off.
    placement = {s: taskmanager_of(admin, job, s) for s in (0, 1)}
    assert sorted(tm for tm, _ in placement.values()) == ["tm-0", "tm-1"], placement
    victim_subtask = next(s for s, (tm, _) in placement.items() if tm == "tm-1")
    victim = placement[victim_subtask]

    keys = [f"k{i:03d}" for i in range(60)]
    by_subtask = keys_by_subtask(routing, keys)
    # One writer per subtask, as Spark partitions after repartition_by_key_group, and one that
    # writes keys of both TaskManagers; each has its own client and so its own cached routing.
    writers = [AppendWriter(f"p{s}", address, job, by_subtask[s]) for s in sorted(by_subtask)]
    writers.append(AppendWriter("mixed", address, job, keys))
    monitor = JobMonitor(address, job)
    try:
        for w in writers:
            w.start()
        wait_for(
            lambda: admin.job_info(job).latest_checkpoint_id >= 1 and all(len(w.acked) >= 20 for w in writers),
            30,
            "a first checkpoint and writes from every writer",
        )

        cut_at = time.monotonic()
        netns.cut(tm_hosts[1], jm)  # tm-1 <-> JobManager only: the test process still reaches both
        running = monitor.wait_running_after(routing.version, timeout_s=45)
        # Writes go on through and after the failover, then the partition heals.
        wait_for(lambda: time.monotonic() > running.at + 5.0, 10, "writes after the failover")
        healed_at = time.monotonic()
        netns.heal(tm_hosts[1], jm)
        wait_for(lambda: time.monotonic() > healed_at + 3.0, 10, "writes after the heal")
    finally:
        for w in writers:
            w.stop()
        monitor.stop()

    wait_for(lambda: admin.job_info(job).status == pb.JOB_STATUS_RUNNING, 30, "the job to be RUNNING after the heal")
    final = read_lists(address, job, keys)
    restarts = admin.job_info(job).restarts
    admin.close()

    # Without writes on both sides of the failover the test would prove nothing.
    for w in writers:
        assert any(a.sent > running.at for a in w.acked), (
            f"writer {w.name} had no acknowledged append after the failover; its errors: {w.failed[-3:]}"
        )
    report = direct_mode_report(writers, final, running, cut_at, healed_at, victim, restarts)
    assert not report, report


# -- epoch mode ---------------------------------------------------------------------------------


@pytest.mark.spark
def test_epochs_through_a_partition_match_the_reference_exactly(
    spark: Any,
    netns: VirtualNetwork,
    tmp_path: Path,
) -> None:
    # Executors cannot import this package: ship the workload module's functions by value.
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(workload)

    cluster, jm, tm_hosts = _three_hosts(netns, tmp_path)
    address = cluster.jobmanager_address
    job = "epochs"
    batches = make_events(files=16, per_file=400, users=120)
    source = tmp_path / "events"
    write_parquet_files(source, batches)

    run = StreamingRun(spark, address, job, source, tmp_path / "spark-checkpoint")
    run.attach()  # submits the job
    admin = fast_client(address)
    placement = {s: taskmanager_of(admin, job, s)[0] for s in (0, 1)}
    assert sorted(placement.values()) == ["tm-0", "tm-1"], placement
    routing = admin.routing(job, refresh=True)
    v0 = routing.version
    owner_before = {
        u: placement[s] for s, users in keys_by_subtask(routing, sorted(reference(batches))).items() for u in users
    }
    monitor = JobMonitor(address, job)
    done = threading.Event()
    faults: dict[str, Any] = {}

    def partition() -> None:
        # Mid-stream: cut tm-1 from the JobManager after three batches; heal once three more
        # batches have returned after the job ran again (those run through the failover).
        try:
            wait_for(lambda: len(run.records) >= 3 or done.is_set(), 90, "three batches before the cut", 0.02)
            faults["cut_at"] = time.monotonic()
            netns.cut(tm_hosts[1], jm)
            faults["running"] = monitor.wait_running_after(v0, timeout_s=60)
            seen = len(run.records)
            wait_for(
                lambda: len(run.records) >= seen + 3 or done.is_set(), 90, "three batches after the failover", 0.02
            )
        except BaseException as exc:
            faults["error"] = exc
        finally:
            faults["healed_at"] = time.monotonic()
            netns.heal_all()

    controller = threading.Thread(target=partition, name="partition", daemon=True)
    controller.start()
    try:
        run.run(timeout_s=150)
    finally:
        done.set()
        controller.join(timeout=100)
        monitor.stop()
        run.stop()
    if "error" in faults:
        raise faults["error"]

    expected = reference(batches)
    actual = read_state(address, job, sorted(expected))
    admin.close()
    assert {r.batch_id for r in run.records} == set(range(len(batches))), f"batches returned: {run.records}"
    report = epoch_mode_report(
        expected, actual, batches, run.records, faults.get("running"), faults["cut_at"], run.restarts, owner_before
    )
    assert not report, report
