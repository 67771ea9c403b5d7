"""A direct-mode chaos run: writers without epochs under a schedule (the partition tests' workload).

Writers in the test process append unique event ids to a ListState through their own clients,
each with its own cached routing table, like Spark executors in ``foreach_batch(...,
exactly_once=False)``; a monitor watches the job's status and routing version. Periodic
checkpoints run every second. The schedule's faults strike while they write; then every fault
is undone, the job must run again and settle, and the writers go on for a few seconds more.

Direct mode promises less than epochs: a failover restores the latest checkpoint, so appends
acknowledged before the last failover may be gone. What must hold: every append acknowledged
after the last deployment was RUNNING survives exactly once, nothing is stored twice or that
was never written, and after that deployment only its own TaskManagers acknowledge anything.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

from keyedstate.common._proto.v1 import common_pb2 as pb
from tests.chaos._faults import FaultActions
from tests.chaos._run import ChaosCluster, FaultRecord, RunResult, Timeline, fault_records
from tests.chaos._schedule import DIRECT_SECONDS, FaultSchedule
from tests.integration.partitions._partitions import (
    AppendWriter,
    JobMonitor,
    direct_mode_report,
    fast_client,
    keys_by_subtask,
    operators,
    read_lists,
)

JOB = "direct"
QUIET_S = 5.0
"""Writes after the last deployment ran, which must all survive."""


class ChaosFailure(AssertionError):
    pass


class DirectChaosRun:
    """One seed's run in direct mode (see the module docstring)."""

    def __init__(
        self,
        schedule: FaultSchedule,
        base: Path,
        net: Any = None,
        deadline_s: float = 150.0,
        config: dict[str, str] | None = None,
    ) -> None:
        self.schedule = schedule
        self.base = Path(base)
        self.deadline_s = deadline_s
        self.timeline = Timeline()
        self.records = fault_records(schedule)
        self.cluster = ChaosCluster(
            schedule,
            self.base,
            self.timeline,
            self.records,
            net,
            config={"execution.checkpointing.interval": "1 s", **(config or {})},
            job_id=JOB,
        )
        self.pipeline = self.cluster.pipeline
        self.done = threading.Event()
        self.started_at = 0.0
        self.monitor: JobMonitor | None = None
        self.actions = FaultActions(self.cluster, self.records, self.timeline, self._trigger, self._where, self.done)
        self.result = RunResult(
            schedule.seed, schedule.mode, schedule.netns, schedule.describe(), log_dir=str(self.base)
        )
        self.writers: list[AppendWriter] = []

    def run(self) -> RunResult:
        started = time.monotonic()
        try:
            self._run()
        except ChaosFailure as exc:
            self.result.failure = str(exc)
        except Exception as exc:
            self.result.failure = f"the harness failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
        finally:
            self.done.set()
            for w in self.writers:
                try:
                    w.stop()
                except AssertionError as exc:
                    self.cluster.findings.append(str(exc))
            if self.monitor is not None:
                self.monitor.stop()
            self.actions.join(timeout_s=60)
        return self.result.conclude(self.cluster.findings + self.actions.errors, started, self.records, self.timeline)

    def close(self) -> None:
        self.done.set()
        self.cluster.close()

    def _run(self) -> None:
        self.cluster.start()
        address = self.pipeline.address
        admin = fast_client(address)
        try:
            routing = admin.submit_job(JOB, operators(self.schedule.parallelism))
            keys = [f"k{i:03d}" for i in range(60)]
            by_subtask = keys_by_subtask(routing, keys)
            self.writers = [AppendWriter(f"p{s}", address, JOB, by_subtask[s]) for s in sorted(by_subtask)]
            self.writers.append(AppendWriter("mixed", address, JOB, keys))
            self.monitor = JobMonitor(address, JOB)
            for w in self.writers:
                w.start()
            self._wait(lambda: admin.job_info(JOB).latest_checkpoint_id >= 1, 30, "a first checkpoint")
            self.started_at = time.monotonic()
            self.timeline.log("writers running, first checkpoint taken: faults may strike")
            self.actions.start()
            # The faults strike within DIRECT_SECONDS; each thread ends when its fault is undone.
            self._wait(
                lambda: time.monotonic() >= self.started_at + DIRECT_SECONDS, DIRECT_SECONDS + 5, "the fault window"
            )
            self.actions.join(timeout_s=max(10.0, self.deadline_s - self.timeline.now() - 60))
            self.done.set()
            self.cluster.settle()
            healed_at = time.monotonic()
            self.timeline.log("every fault undone")
            info = self._wait_running(admin)
            running = self._stable_deployment(admin)
            self.timeline.log(
                f"last deployment: routing v{running.routing_version} RUNNING ({info.restarts} restarts in all)"
            )
            self._wait(
                lambda: time.monotonic() >= running.at + QUIET_S, QUIET_S + 5, "writes after the last deployment"
            )
            for w in self.writers:
                w.stop()
            self.monitor.stop()
            final = read_lists(address, JOB, keys)
            restarts = admin.job_info(JOB).restarts
        finally:
            admin.close()
        silent = [w.name for w in self.writers if not any(a.sent > running.at for a in w.acked)]
        if silent:
            raise ChaosFailure(
                f"writers {silent} had no append acknowledged after the last deployment ran; "
                f"their last errors: {[w.failed[-2:] for w in self.writers if w.name in silent]}"
            )
        self._count(final, running)
        faulted = sorted({r.fault.target for r in self.records if r.fired and r.fault.target.startswith("tm")})
        report = direct_mode_report(
            self.writers,
            final,
            running,
            self.started_at,
            healed_at,
            (",".join(faulted) or "none", "see the timeline"),
            restarts,
            expected_restarts=None,
        )
        self.result.outcome = "the job RUNNING again"  # one line per kind of ending in the summary
        self.timeline.log(f"final: routing v{running.routing_version}, {restarts} restarts")
        if report:
            raise ChaosFailure(report)

    def _count(self, final: dict[str, list[str]], running: Any) -> None:
        served = Counter(e for values in final.values() for e in values)
        after = [e for w in self.writers for a in w.acked if a.sent > running.at for e in a.events]
        sent = {e for w in self.writers for e in w.attempted}
        self.result.events_checked = len(after)
        self.result.lost = sum(1 for e in after if served[e] == 0)
        self.result.doubled = sum(n - 1 for n in served.values() if n > 1)
        self.result.unexpected = sum(n for e, n in served.items() if e not in sent)

    def _wait_running(self, admin: Any) -> Any:
        """RUNNING; a job that FAILED (a small restart budget) is restored by the operator from its latest checkpoint."""
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                info = admin.job_info(JOB)
            except Exception:
                time.sleep(0.2)
                continue
            if info.status == pb.JOB_STATUS_RUNNING:
                return info
            if info.status in (pb.JOB_STATUS_FAILED, pb.JOB_STATUS_CANCELED):
                if self.schedule.restart_attempts >= 100:
                    raise ChaosFailure(
                        f"the job is {info.status} although its restart budget cannot run out here: "
                        f"{info.failure_cause}"
                    )
                path = info.latest_checkpoint_path
                self.timeline.log(f"the job FAILED ({info.failure_cause}); the operator restores {path}")
                if not path or not self.cluster.restore(path, "the FAILED job's latest checkpoint"):
                    raise ChaosFailure(
                        f"the job FAILED and its latest checkpoint ({path or 'none'}) cannot be restored"
                    )
            time.sleep(0.2)
        raise ChaosFailure("the job did not run again within 90 s after every fault was undone")

    def _stable_deployment(self, admin: Any) -> Any:
        """The monitor's first sighting of the deployment the JobManager runs, once it has not changed for 3 s."""
        assert self.monitor is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                info = admin.job_info(JOB)
            except Exception:
                time.sleep(0.2)
                continue
            latest = self.monitor.latest()
            if (
                info.status == pb.JOB_STATUS_RUNNING
                and latest is not None
                and latest.status == "RUNNING"
                and latest.routing_version == info.routing_version
                and time.monotonic() - latest.at >= 3.0
            ):
                return next(
                    ob
                    for ob in self.monitor.observations
                    if ob.status == "RUNNING" and ob.routing_version == latest.routing_version
                )
            time.sleep(0.1)
        raise ChaosFailure(
            f"the job did not settle on one RUNNING deployment within 60 s; last seen {self.monitor.latest()}"
        )

    def _wait(self, predicate: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if predicate():
                    return
            except Exception:
                pass
            time.sleep(0.05)
        raise ChaosFailure(f"{what} did not happen within {timeout_s:.0f} s")

    def _trigger(self, record: FaultRecord) -> bool:
        return not self.done.wait(
            max(0.0, self.started_at + record.fault.at_s + record.fault.delay_s - time.monotonic())
        )

    def _where(self) -> str:
        latest = self.monitor.latest() if self.monitor is not None else None
        seen = f"routing v{latest.routing_version} {latest.status}" if latest is not None else "no observation"
        return f"{self.timeline.now():.1f} s; monitor: {seen}"
