"""Speculative execution for real: a losing speculative attempt's writes never reach the state.

Spark launches a speculative copy of a straggling task only on *another host* than the
original's, so ``local[N]`` and ``local-cluster`` (one host) never do. This test runs a Spark
standalone master and two workers, each worker in its own network namespace (its own IP, so
its own host to Spark), with ``spark.speculation`` on. In the first batch partition 0's first
attempt writes its events and then stalls until the speculative copy on the other worker wrote
the same events; then the two race to finish. Both attempts staged the same writes; only the
winner's may be applied. One Spark application runs every foreach_batch mode under both commit
modes (``sync``, and ``overlapped``, where the second batch runs while the first one's apply and
checkpoint may still be going on), a job each, so the standalone cluster starts once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from keyedstate.common.client import ListState, ReducingState
from keyedstate.common.minicluster import free_port
from tests.fixtures.netns import VirtualNetwork
from tests.fixtures.waiting import wait_for
from tests.integration.spark import _speculation_driver as driver

pytestmark = [pytest.mark.spark, pytest.mark.netns, pytest.mark.timeout(420)]


def _spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def _start_standalone(netns: VirtualNetwork, base: Path) -> str:
    """A Spark master on ``local`` and two one-core workers on hosts w1 and w2; returns the master URL."""
    home = _spark_home()
    env = {**os.environ, "SPARK_HOME": str(home), "PYSPARK_PYTHON": sys.executable, "SPARK_NO_DAEMONIZE": "1"}
    port = free_port()
    master_url = f"spark://{netns.local.ip}:{port}"
    (base / "log").mkdir(parents=True)
    # The child keeps its own descriptor; ours is closed once the process has started.
    with open(base / "log" / "master.log", "wb") as master_log:
        netns.popen(
            netns.local,
            [
                str(home / "bin" / "spark-class"),
                "org.apache.spark.deploy.master.Master",
                "--host",
                netns.local.ip,
                "--port",
                str(port),
                "--webui-port",
                str(free_port()),
            ],
            env={**env, "SPARK_LOCAL_IP": netns.local.ip},
            stdout=master_log,
            stderr=subprocess.STDOUT,
        )
    for name in ("w1", "w2"):
        host = netns.add_host(name)
        work = base / name
        work.mkdir()
        with open(base / "log" / f"{name}.log", "wb") as worker_log:
            netns.popen(
                host,
                [
                    str(home / "bin" / "spark-class"),
                    "org.apache.spark.deploy.worker.Worker",
                    "--host",
                    host.ip,
                    "--cores",
                    "1",
                    "--memory",
                    "1g",
                    "--work-dir",
                    str(work),
                    "--webui-port",
                    "0",
                    master_url,
                ],
                env={**env, "SPARK_LOCAL_IP": host.ip},
                stdout=worker_log,
                stderr=subprocess.STDOUT,
            )
    wait_for(
        lambda: (
            sum(
                "Successfully registered with master" in (base / "log" / f"{w}.log").read_text(errors="replace")
                for w in ("w1", "w2")
            )
            == 2
        ),
        120,
        "two Spark workers registering with the master",
    )
    return master_url


def test_a_speculative_losers_writes_are_dropped_in_every_mode(
    netns: VirtualNetwork, inprocess_cluster: Any, tmp_path: Path
) -> None:
    # The state service listens on the bridge address, reachable from the workers' namespaces.
    ip = netns.local.ip
    # Namespaces this test made: a trusted network, so protected mode stands aside.
    cluster = inprocess_cluster(
        taskmanagers=2,
        slots=8,  # four jobs of parallelism 4: each foreach_batch mode under each commit mode
        jm={"jobmanager.rpc.address": ip, "security.protected-mode": False},
        tm={"jobmanager.rpc.address": ip, "taskmanager.host": ip, "security.protected-mode": False},
    )
    master = _start_standalone(netns, tmp_path / "spark")
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, driver.__file__, cluster.address, "speculative", str(out), master],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=360,
        env={**os.environ, "SPARK_HOME": str(_spark_home()), "SPARK_LOCAL_IP": ip},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    attempts = [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    client = cluster.client()
    assert sorted(summary) == sorted(f"{mode}-{commit}" for mode, commit in driver.jobs())
    for mode, commit in driver.jobs():
        ran = [a for a in attempts if (a["mode"], a["commit"]) == (mode, commit)]
        _check_mode(client, f"{mode}-{commit}", ran, summary[f"{mode}-{commit}"], lambda: _spark_logs(tmp_path, proc))


def _spark_logs(base: Path, proc: subprocess.CompletedProcess[str]) -> str:
    """What Spark said about lost tasks and executors: the driver's stderr and each executor's."""
    said = [f"driver stderr (tail):\n{proc.stderr[-3000:]}"]
    for log in sorted((base / "spark").glob("w*/app-*/*/stderr")):
        lines = log.read_text(errors="replace").splitlines()
        worrying = [line for line in lines if any(w in line for w in ("ERROR", "WARN", "Exception", "Error:"))]
        said.append(f"{log.relative_to(base)}:\n" + "\n".join(worrying[-40:]))
    return "\n".join(said)


def _check_mode(
    client: Any, mode: str, attempts: list[dict[str, Any]], summary: dict[str, Any], spark_logs: Callable[[], str]
) -> None:
    """One job (``<foreach_batch mode>-<commit mode>``): the straggler raced its speculative copy, and
    every event applied exactly once."""
    failed = [a for a in attempts if "failed" in a]
    attempts = [a for a in attempts if "failed" not in a]
    by_task: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for a in attempts:
        by_task[(a["batch"], a["partition"])].append(a)
    # The straggler really had a speculative copy, on the other worker, that wrote the same rows.
    raced = by_task.get((0, 0), [])
    assert len(raced) >= 2, (
        f"{mode}: Spark launched no speculative attempt of the straggler: {dict(by_task)}\n"
        f"attempts that failed: {failed}\n{spark_logs()}"
    )
    first, second = sorted(raced, key=lambda a: a["attempt"])[:2]
    assert first["rows"] == second["rows"] > 0 and first["host"] != second["host"], raced

    expected_totals: dict[str, list[int]] = {}
    expected_events: dict[str, list[str]] = defaultdict(list)
    for batch in range(driver.BATCHES):
        for user, amount, event in driver.events(batch):
            t = expected_totals.setdefault(user, [0, 0])
            t[0] += 1
            t[1] += amount
            expected_events[user].append(event)
    job = f"speculative-{mode}"
    # Overlapped, the driver returns on the last batch's decision: reads see it once it is applied, and
    # the checkpoint holding it follows the apply.
    last = driver.BATCHES - 1
    wait_for(
        lambda: (info := client.job_info(job)).applied_epoch == last and info.durable_epoch == last,
        60,
        f"{job}: the last batch applied and checkpointed",
    )
    users = sorted(expected_totals)
    totals = ReducingState[str](client, job, "agg", "totals").get_many(users)
    assert {u: list(t) for u, t in zip(users, totals)} == expected_totals, mode  # type: ignore[arg-type]  # a missing total (None) fails here
    lists = ListState[str, str](client, job, "agg", "events", value_serializer="str").get_many(users)
    doubled = {u: n for u, got in zip(users, lists) for e, n in Counter(got).items() if n > 1}
    assert not doubled, f"{mode}: events applied twice: {doubled}"
    assert {u: sorted(got) for u, got in zip(users, lists)} == {u: sorted(e) for u, e in expected_events.items()}
    # Sync: the driver returned only once a checkpoint held the batch; overlapped, once it was decided.
    assert summary["durable_epoch"] == last or (mode.endswith("-overlapped") and summary["durable_epoch"] < last)
