"""The timed faults of a schedule, each on a thread of its own.

A fault waits for its trigger (``trigger(fault)``: a batch the driver starts plus a delay, or a
moment of a direct-mode run), strikes, and undoes what it did when its duration is up or the
run ends (``done``): SIGCONT after SIGSTOP, heal after a cut, restart after a kill when the
schedule says so, the normal JobManager after a checkpoint-timeout phase. Crash-point faults
need no thread: their daemon is started armed (``ChaosCluster``). Faults that only the driver
can inject, and the operator restores, are handled by the epoch run (``_epoch.py``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from tests.chaos._run import ChaosCluster, FaultRecord, Timeline

logger = logging.getLogger(__name__)

Trigger = Callable[[FaultRecord], bool]
"""Blocks until the fault's moment; False if the run ended first."""


class FaultActions:
    """Threads for the timed faults of one run (see the module docstring)."""

    def __init__(
        self,
        cluster: ChaosCluster,
        records: list[FaultRecord],
        timeline: Timeline,
        trigger: Trigger,
        where: Callable[[], str],
        done: threading.Event,
        extra: dict[str, Callable[[FaultRecord], None]] | None = None,
    ) -> None:
        self.cluster = cluster
        self.records = records
        self.timeline = timeline
        self.trigger = trigger
        self.where = where
        self.done = done
        self.handlers: dict[str, Callable[[FaultRecord], object]] = {
            "tm_kill": self.tm_kill,
            "jm_kill": self.jm_kill,
            "tm_pause": self.pause,
            "jm_pause": self.pause,
            "rescale": self.rescale,
            "savepoint": self.savepoint,
            "checkpoint_timeout": self.checkpoint_timeout,
            "partition_tm_jm": self.partition,
            "partition_tm_all": self.partition,
            "partition_local_tm": self.partition,
            "loss": self.partition,
            **(extra or {}),
        }
        self.checkpoint_phases: list[list[float | None]] = []
        """[start, end] (time.time()) of each phase with a short checkpoint timeout; end None while it lasts."""
        self.savepoints: list[tuple[str, int]] = []
        self._threads: list[threading.Thread] = []
        self.errors: list[str] = []

    def start(self) -> None:
        for record in self.records:
            f = record.fault
            if f.crash_point or f.kind in ("heartbeat_only", "restart_budget"):
                continue
            handler = self.handlers.get(f.kind)
            if handler is None:
                continue
            thread = threading.Thread(
                target=self._run, args=(handler, record), name=f"fault-{record.index}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _run(self, handler: Callable[[FaultRecord], None], record: FaultRecord) -> None:
        try:
            handler(record)
        except Exception as exc:  # the harness's own trouble: reported, never hidden
            logger.exception("fault %d (%s) failed", record.index, record.fault.kind)
            self.errors.append(f"fault {record.index + 1} ({record.fault.kind}): {type(exc).__name__}: {exc}")
            self.timeline.log(f"fault {record.index + 1} ({record.fault.kind}) raised {type(exc).__name__}: {exc}")

    def join(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.1, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            self.errors.append(f"fault threads still running at the end: {alive}")

    def fire(self, record: FaultRecord, note: str = "") -> None:
        record.fired, record.at, record.context = True, self.timeline.now(), self.where()
        if note:
            record.note = note

    def hold(self, seconds: float) -> None:
        """Keep a fault in place for ``seconds``, less if the run ends meanwhile."""
        self.done.wait(seconds)

    # -- processes -----------------------------------------------------------------------------
    def tm_kill(self, record: FaultRecord) -> None:
        f = record.fault
        if not self.trigger(record):
            return
        daemon = f"taskmanager-{f.target[2:]}"
        index = int(f.target[2:])
        if not self.cluster.kill(daemon, f"fault {record.index + 1}"):
            record.note = f"{daemon} was not running"
            return
        self.fire(record)
        if f.restart_after_s is None:
            self.cluster.permanently_down.add(index)
            return
        self.hold(f.restart_after_s)
        if not self.done.is_set():
            self.cluster.start_daemon(daemon, f"fault {record.index + 1}")

    def jm_kill(self, record: FaultRecord) -> None:
        f = record.fault
        if not self.trigger(record):
            return
        if not self.cluster.kill("jobmanager", f"fault {record.index + 1}"):
            record.note = "the JobManager was not running"
            return
        self.fire(record)
        self.hold(f.restart_after_s or 0.0)
        self.cluster.start_daemon("jobmanager", f"fault {record.index + 1}")

    def pause(self, record: FaultRecord) -> None:
        f = record.fault
        if not self.trigger(record):
            return
        daemon = "jobmanager" if f.kind == "jm_pause" else f"taskmanager-{f.target[2:]}"
        with self.cluster.locks[daemon]:
            proc = self.cluster.process(daemon)
            if proc is None or not proc.alive:
                record.note = f"{daemon} was not running"
                return
            proc.pause()
        self.fire(record)
        self.timeline.log(f"SIGSTOP {daemon} for {f.duration_s:.1f} s")
        try:
            self.hold(f.duration_s)
        finally:
            proc.resume()
            self.timeline.log(f"SIGCONT {daemon}")

    # -- operator ------------------------------------------------------------------------------
    def rescale(self, record: FaultRecord) -> None:
        f = record.fault
        if not self.trigger(record):
            return
        self.fire(record)
        done = self.cluster.statectl("job", "rescale", self.cluster.pipeline.job_id, "--parallelism", str(int(f.value)))
        ok = done is not None and done.returncode == 0
        record.note = f"rescale to {int(f.value)}: " + ("done" if ok else f"refused: {_text(done)}")
        self.timeline.log(f"operator: statectl job rescale --parallelism {int(f.value)}: {record.note}")

    def savepoint(self, record: FaultRecord) -> tuple[str, int] | None:
        if not self.trigger(record):
            return None
        self.fire(record)
        return self.take_savepoint(record)

    def take_savepoint(self, record: FaultRecord) -> tuple[str, int] | None:
        done = self.cluster.statectl("savepoint", self.cluster.pipeline.job_id, "--json", "--timeout", "120")
        if done is None or done.returncode != 0:
            record.note = f"savepoint failed: {_text(done)}"
            self.timeline.log(f"operator: statectl savepoint: {record.note}")
            return None
        info = json.loads(done.stdout)
        path, epoch = info["path"], int(info.get("epoch", 0))
        self.savepoints.append((path, epoch))
        record.note = f"savepoint {path} holds epoch {epoch}"
        self.timeline.log(f"operator: statectl savepoint: {record.note}")
        return path, epoch

    def checkpoint_timeout(self, record: FaultRecord) -> None:
        f = record.fault
        if not self.trigger(record):
            return
        self.fire(record)
        phase: list[float | None] = [time.time(), None]
        self.checkpoint_phases.append(phase)
        self.cluster.restart_jobmanager(
            f"fault {record.index + 1}: execution.checkpointing.timeout={f.variant}",
            {"execution.checkpointing.timeout": f.variant},
            arm=False,
        )
        try:
            self.hold(f.duration_s)
        finally:
            self.cluster.restart_jobmanager(f"fault {record.index + 1}: the normal checkpoint timeout again")
            phase[1] = time.time()

    # -- network -------------------------------------------------------------------------------
    def partition(self, record: FaultRecord) -> None:
        f = record.fault
        if not self.trigger(record):
            return
        net, host = self.cluster.net, self.cluster.host
        if f.kind == "partition_tm_jm":
            a, b = host(f.target), host("jm")
            net.cut(a, b)
        elif f.kind == "partition_tm_all":
            a, b = host(f.target), None
            net.isolate(a)
        elif f.kind == "partition_local_tm":
            a, b = host("local"), host(f.target)
            net.cut(a, b)
        else:
            first, second = f.target.split("-")
            a, b = host(first), host(second)
            net.loss(a, b, f.value)
        self.fire(record)
        self.timeline.log(f"network: {f.describe()}")
        try:
            self.hold(f.duration_s)
        finally:
            net.heal(a, b) if b is not None else net.heal(a)
            self.timeline.log(f"network: healed fault {record.index + 1}")


def _text(done: Any) -> str:
    if done is None:
        return "statectl did not answer"
    text: str = (done.stderr.strip() or done.stdout.strip())[-400:]
    return text
