"""What both kinds of chaos run share: the cluster and its faults, the timeline, the result.

:class:`ChaosCluster` is the exactly-once pipeline's cluster (``ExactlyOncePipeline``: real
JobManager and TaskManager processes, filesystem HA, incremental ``file://`` checkpoints), on
127.0.0.1 or with each daemon on its own host of the netns fixture's virtual network. It arms
crash points (``KEYEDSTATE_CRASH_AT``) per process incarnation: each daemon starts with the next
crash-point fault of the schedule that targets it and has not fired yet. A watcher thread
notices every daemon that died without the harness killing it, credits the crash point it
hit, and restarts it as the schedule says; a daemon that died any other way is a finding.

:class:`FaultActions` runs every timed fault of the schedule on a thread of its own, waiting for
its trigger (a batch the driver starts, or a moment in a direct-mode run), and undoes what it
did (SIGCONT, heal, restart) when its time is up or the run ends.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common.faults import ENV as CRASH_AT
from keyedstate.common.minicluster import DaemonProcess, Placement
from tests.chaos._schedule import HEARTBEAT_TIMEOUT_S, SLOTS, TASKMANAGERS, Fault, FaultSchedule
from tests.integration.exactly_once._pipeline import FAST_RESTARTS, ExactlyOncePipeline

logger = logging.getLogger(__name__)

CHAOS_CONFIG = {
    "heartbeat.interval": "200 ms",
    "heartbeat.timeout": f"{HEARTBEAT_TIMEOUT_S:.0f} s",
    **FAST_RESTARTS,
    # A restart that cannot get its slots (a TaskManager cut off) counts as a failed restart
    # after this, instead of holding the job for the default five minutes.
    "slot.request.timeout": "20 s",
    # Older checkpoints for the operator to restore.
    "execution.checkpointing.num-retained": "4",
}
EVENTS_PER_FILE = 500
KEYS = 200


@dataclass
class FaultRecord:
    """What became of one fault of the schedule."""

    index: int
    fault: Fault
    fired: bool = False
    at: float | None = None
    """Seconds after the run started."""
    context: str = ""
    """Where the run was when it struck (the batch the driver was in, the job's routing version)."""
    note: str = ""

    def line(self) -> str:
        state = f"fired at {self.at:.1f} s ({self.context})" if self.fired else "did not fire"
        return f"{self.index + 1}. [{self.fault.kind}] {state}{'; ' + self.note if self.note else ''}"


def fault_records(schedule: FaultSchedule) -> list[FaultRecord]:
    """One record per scheduled fault; the configuration faults count as fired from the start."""
    records = [FaultRecord(i, f) for i, f in enumerate(schedule.faults)]
    for r in records:
        if r.fault.kind in ("heartbeat_only", "restart_budget"):
            r.fired, r.at, r.context = True, 0.0, "configuration"
    return records


@dataclass
class RunResult:
    """One chaos run, as the soak summary and failure messages need it."""

    seed: int
    mode: str
    netns: bool
    schedule: str
    passed: bool = False
    failure: str | None = None
    outcome: str = ""
    faults: list[dict[str, Any]] = field(default_factory=list)
    driver_starts: int = 0
    batch_runs: int = 0
    batches_rerun: int = 0
    replays: int = 0
    queries_started: int = 0
    """Structured Streaming queries started (a driver's first, and each one after a query.stop())."""
    operator_actions: int = 0
    """statectl rescales, savepoints, cancels and restores (the remedies included)."""
    events_checked: int = 0
    lost: int = 0
    doubled: int = 0
    unexpected: int = 0
    duration_s: float = 0.0
    log_dir: str = ""
    timeline: list[str] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)

    def conclude(
        self, problems: list[str], started: float, records: list[FaultRecord], timeline: Timeline
    ) -> RunResult:
        """Fill in the verdict, duration, faults and timeline at the end of a run (either mode)."""
        self.findings = problems
        if self.failure is None and problems:
            self.failure = "; ".join(problems)[:3000]
        self.passed = self.failure is None
        self.duration_s = time.monotonic() - started
        self.faults = [
            {"kind": r.fault.kind, "variant": r.fault.variant, "fired": r.fired, "at": r.at, "line": r.line()}
            for r in records
        ]
        self.operator_actions = timeline.operator_actions()
        self.timeline = timeline.lines()
        return self

    def fired_kinds(self) -> list[str]:
        return [f["kind"] for f in self.faults if f["fired"]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def report(self) -> str:
        """The failure message: seed, schedule, what happened and when, what differs, where the logs are."""
        lines = [
            f"chaos run seed {self.seed} FAILED: {self.failure}",
            "",
            "schedule:",
            self.schedule,
            "",
            f"outcome: {self.outcome}",
            f"events checked {self.events_checked}: {self.lost} lost, {self.doubled} doubled, "
            f"{self.unexpected} unexpected; {self.driver_starts} driver start(s), {self.batch_runs} batch run(s), "
            f"{self.batches_rerun} re-run(s), {self.replays} replay(s) of committed batches, "
            f"{self.queries_started} quer(ies) started, {self.operator_actions} operator action(s)",
            "",
            "faults:",
        ]
        lines += [f"  {f['line']}" for f in self.faults]
        if self.findings:
            lines += ["", "findings:"] + [f"  {x}" for x in self.findings]
        lines += ["", "timeline:"] + [f"  {t}" for t in self.timeline[-80:]]
        lines += ["", f"logs: {self.log_dir}"]
        return "\n".join(lines)


class Timeline:
    """Timestamped lines of what the harness did and saw (thread-safe)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self._lines: list[str] = []
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def log(self, text: str) -> None:
        line = f"{self.now():7.2f}s {text}"
        logger.info("chaos: %s", text)
        with self._lock:
            self._lines.append(line)

    def lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)

    def operator_actions(self) -> int:
        """How many statectl actions the harness took as the operator (each logs one ``operator:`` line)."""
        return sum(1 for line in self.lines() if " operator: " in line)


def _daemon_index(daemon: str) -> int:
    return int(daemon.rsplit("-", 1)[1])


class ChaosCluster:
    """The pipeline's cluster with crash points per process incarnation, restarts and host placement."""

    def __init__(
        self,
        schedule: FaultSchedule,
        base: Path,
        timeline: Timeline,
        records: list[FaultRecord],
        net: Any = None,
        config: dict[str, str] | None = None,
        job_id: str = "exo",
    ) -> None:
        self.schedule = schedule
        self.timeline = timeline
        self.net = net
        self.records = records
        self.locks: dict[str, threading.RLock] = {d: threading.RLock() for d in self.daemons()}
        """One per daemon: a start waits for its registration (a TaskManager's for the JobManager), so
        a start holds up nothing but other kills and starts of the same daemon."""
        self.killed: dict[int, DaemonProcess] = {}
        """The DaemonProcess objects the harness killed, by id (any other death is a crash); the values keep
        them alive, so that no later object takes a dead one's id."""
        self.armed: dict[str, FaultRecord | None] = {}
        self.permanently_down: set[int] = set()
        self.findings: list[str] = []
        conf = {
            **CHAOS_CONFIG,
            "restart-strategy.fixed-delay.attempts": str(schedule.restart_attempts),
            **(config or {}),
        }
        if schedule.heartbeat_only:
            conf["heartbeat.connection-loss-detection"] = "false"
        placement = None
        if net is not None:
            self.jm_host = net.add_host("jm")
            self.tm_hosts = [net.add_host(f"tm{i}") for i in range(TASKMANAGERS)]
            hosts = {"jobmanager": self.jm_host, **{f"taskmanager-{i}": h for i, h in enumerate(self.tm_hosts)}}

            def placement(daemon: str) -> Placement:
                placed: Placement = net.placement(hosts[daemon])
                return placed

        tm_env = {i: self._arm(f"taskmanager-{i}") for i in range(TASKMANAGERS)}
        jm_env = self._arm("jobmanager")
        self.pipeline = ExactlyOncePipeline(
            None,
            base,
            job_id=job_id,
            files=schedule.files,
            events_per_file=EVENTS_PER_FILE,
            keys=KEYS,
            parallelism=schedule.parallelism,
            taskmanagers=TASKMANAGERS,
            slots=SLOTS,
            config=conf,
            seed=schedule.seed,
            tm_env=tm_env,
            jm_env=jm_env,
            placement=placement,
        )
        self.base_config = dict(self.pipeline.cluster.config)
        """The JobManager's configuration outside checkpoint-timeout phases."""
        self._stop = threading.Event()
        self._closing = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="chaos-watcher", daemon=True)
        self._job_watcher = threading.Thread(target=self._watch_job, name="chaos-job-watcher", daemon=True)

    # -- hosts ---------------------------------------------------------------------------------
    def host(self, name: str) -> Any:
        """``jm``, ``tm<i>`` or ``local`` as a host of the virtual network."""
        assert self.net is not None, "network faults need the netns placement"
        if name == "jm":
            return self.jm_host
        if name == "local":
            return self.net.local
        return self.tm_hosts[int(name[2:])]

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self.pipeline.start()
        self._watcher.start()
        self._job_watcher.start()

    @property
    def cluster(self) -> Any:
        return self.pipeline.cluster

    def process(self, daemon: str) -> DaemonProcess:
        process: DaemonProcess
        if daemon == "jobmanager":
            process = self.cluster.jobmanager
        else:
            process = self.cluster.taskmanagers[_daemon_index(daemon)]
        return process

    def dump_threads(self) -> None:
        """Ask every live daemon for its threads' stacks (SIGUSR1: they land in its log), for a failed run's report."""
        for daemon in self.daemons():
            try:
                self.process(daemon).signal(signal.SIGUSR1)
            except (OSError, IndexError, AttributeError):
                continue
        time.sleep(0.5)  # faulthandler writes at once; let the files catch up before they are copied

    def _arm(self, daemon: str) -> dict[str, str]:
        """The environment of the next incarnation of ``daemon``: its next crash point that has not fired."""
        kind = "jm_kill" if daemon == "jobmanager" else "tm_kill"
        target = "jm" if daemon == "jobmanager" else f"tm{_daemon_index(daemon)}"
        for record in self.records:
            f = record.fault
            if f.kind == kind and f.target == target and f.crash_point and not record.fired:
                self.armed[daemon] = record
                return {CRASH_AT: f"{f.variant}@{f.nth}"}
        self.armed[daemon] = None
        return {}

    def kill(self, daemon: str, why: str) -> bool:
        """SIGKILL ``daemon``; False if it was not running."""
        with self.locks[daemon]:
            proc = self.process(daemon)
            if not proc.alive:
                return False
            self.killed[id(proc)] = proc
            proc.kill()
        self.timeline.log(f"kill -9 {daemon} ({why})")
        return True

    def start_daemon(self, daemon: str, why: str, arm: bool = True) -> None:
        """Start ``daemon`` again (same host, port for the JobManager, resource id and local directory)."""
        with self.locks[daemon]:
            proc = self.process(daemon)
            if proc is not None and proc.alive:
                return
            env = self._arm(daemon) if arm else {}
            if not arm:
                self.armed[daemon] = None
            if daemon == "jobmanager":
                self.cluster.start_jobmanager(env)
            else:
                self.pipeline.restart_taskmanager(_daemon_index(daemon), env)
        armed = f" armed with {env[CRASH_AT]}" if env else ""
        self.timeline.log(f"started {daemon} again ({why}){armed}")

    def restart_jobmanager(self, why: str, overrides: dict[str, str] | None = None, arm: bool = True) -> None:
        """kill -9 and start the JobManager, with ``overrides`` on the run's configuration (none: the normal one)."""
        with self.locks["jobmanager"]:
            self.kill("jobmanager", why)
            self.cluster.config = {**self.base_config, **(overrides or {})}
            self.start_daemon("jobmanager", why, arm=arm)

    def daemons(self) -> list[str]:
        return ["jobmanager", *[f"taskmanager-{i}" for i in range(TASKMANAGERS)]]

    def _watch(self) -> None:
        """Credit crash points, restart crashed daemons as scheduled, and report any other death."""
        handled: dict[int, DaemonProcess] = {}
        while not self._stop.wait(0.05):
            for daemon in self.daemons():
                # No lock: the harness marks a process it kills before killing it, and a start
                # replaces the process object, so a dead object not marked died by itself. A new
                # object is in place a moment before its process is spawned: not dead, not started.
                proc = self.process(daemon)
                if proc is None or proc.process is None or proc.alive or id(proc) in self.killed or id(proc) in handled:
                    continue
                handled[id(proc)] = proc
                record = self.armed.get(daemon)
                proc.kill()  # reap it and close its log
                log = proc.log_tail(400)
                # The log file is shared by a daemon's incarnations: read this one's part only (from
                # its last "serving on"), or a crash line of the one before would be credited.
                own = log[log.rfind("serving on") :] if "serving on" in log else log
                crashes = list(re.finditer(r"crash point (\S+) reached \(#(\d+)\)", own))
                crash = crashes[-1] if crashes else None
                if record is not None and crash and crash.group(1) == record.fault.variant:
                    record.fired, record.at = True, self.timeline.now()
                    record.context = self.context()
                    self.timeline.log(f"{daemon} died at crash point {crash.group(1)} (#{crash.group(2)})")
                    delay = record.fault.restart_after_s
                else:
                    code = proc.process.returncode if proc.process is not None else None
                    finding = (
                        f"{daemon} exited by itself (exit code {code}) at {self.timeline.now():.1f} s; "
                        f"log {proc.log_path}, tail:\n{proc.log_tail(15)}"
                    )
                    self.findings.append(finding)
                    self.timeline.log(f"{daemon} exited by itself (exit code {code})")
                    delay = 1.0
                if daemon != "jobmanager" and delay is None:
                    self.permanently_down.add(_daemon_index(daemon))
                    self.timeline.log(f"{daemon} stays down (schedule)")
                    continue
                threading.Thread(target=self._restart_later, args=(daemon, delay or 0.0), daemon=True).start()

    def _watch_job(self) -> None:
        """Put every change of the job's status, routing version, epochs or restarts on the timeline."""
        from keyedstate.common.client import ClientSettings, StateClient

        last: tuple[Any, ...] | None = None
        with StateClient(self.pipeline.address, ClientSettings(timeout_s=1.0, max_attempts=1)) as client:
            while not self._closing.wait(0.1):
                try:
                    info = client.job_info(self.pipeline.job_id)
                except Exception:
                    continue  # not submitted yet, or the JobManager is down: the kills are on the timeline
                now = (info.status, info.routing_version, info.committed_epoch, info.durable_epoch, info.restarts)
                if now != last:
                    cause = (
                        f" ({info.failure_cause[:160]})"
                        if info.failure_cause and info.status != pb.JOB_STATUS_RUNNING
                        else ""
                    )
                    self.timeline.log(
                        f"job {info.status} routing v{info.routing_version} epoch {info.committed_epoch} "
                        f"durable {info.durable_epoch} restarts {info.restarts}{cause}"
                    )
                    last = now

    def _restart_later(self, daemon: str, delay_s: float) -> None:
        if self._stop.wait(delay_s):
            return  # settling: settle() starts it
        try:
            self.start_daemon(daemon, "after its crash point")
        except Exception as exc:
            self.findings.append(f"{daemon} could not be started again: {exc}")

    def context(self) -> str:
        """The job as the JobManager reports it now (for fault records); '' if it does not answer."""
        try:
            from keyedstate.common.client import ClientSettings, StateClient

            with StateClient(self.pipeline.address, ClientSettings(timeout_s=1.0, max_attempts=1)) as client:
                info = client.job_info(self.pipeline.job_id)
            return f"job {info.status}, epoch {info.committed_epoch}, routing v{info.routing_version}"
        except Exception:
            return "JobManager not answering"

    # -- the end -------------------------------------------------------------------------------
    def settle(self) -> None:
        """Undo every fault: heal the network, resume paused daemons, start the dead ones (but those the
        schedule keeps down), with the normal configuration and no crash points."""
        self._stop.set()
        self._watcher.join(timeout=10)
        if self.net is not None:
            self.net.heal_all()
        for daemon in self.daemons():
            proc = self.process(daemon)
            if proc is not None and proc.alive:
                proc.resume()
        if self.cluster.config != self.base_config:
            self.restart_jobmanager("settling: the normal configuration", arm=False)
        for daemon in self.daemons():  # the JobManager first: TaskManagers register with it to start
            proc = self.process(daemon)
            if proc is not None and not proc.alive:
                if daemon != "jobmanager" and _daemon_index(daemon) in self.permanently_down:
                    continue
                self.start_daemon(daemon, "settling", arm=False)

    def close(self) -> None:
        self._stop.set()
        self._closing.set()
        if self._job_watcher.is_alive():
            self._job_watcher.join(timeout=10)
        for daemon in self.daemons():
            proc = self.process(daemon)
            if proc is not None and proc.alive:
                proc.resume()
        self.pipeline.close()

    # -- operator ------------------------------------------------------------------------------
    def statectl(self, *args: str, timeout_s: float = 120.0, attempts: int = 3) -> Any:
        """``statectl ARGS`` against the cluster; tried again while the JobManager does not answer."""
        done = None
        for _attempt in range(attempts):
            try:
                done = self.pipeline.statectl(*args, timeout_s=timeout_s)
            except Exception as exc:  # subprocess timeout
                self.timeline.log(f"statectl {' '.join(args)}: {exc}")
                continue
            if done.returncode == 0 or "is the JobManager running" not in done.stderr:
                return done
            time.sleep(1.0)
        return done

    def restore(self, path: str, why: str) -> bool:
        """The operator's ``statectl job restore JOB --from PATH``."""
        done = self.statectl("job", "restore", self.pipeline.job_id, "--from", path, attempts=5)
        ok = done is not None and done.returncode == 0
        detail = (done.stdout.strip() or done.stderr.strip())[-300:] if done is not None else "no answer"
        self.timeline.log(f"operator: statectl job restore --from {path} ({why}): {'ok' if ok else 'FAILED'} {detail}")
        return ok


def checkpoint_epoch(path: str) -> int | None:
    """The epoch a checkpoint or savepoint directory holds (its ``_metadata``), None if it has none."""
    metadata = Path(path.removeprefix("file://")) / "_metadata"
    try:
        return int(json.loads(metadata.read_text(encoding="utf-8"))["epoch"])
    except (OSError, ValueError, KeyError):
        return None


def checkpoints_on_disk(checkpoints_dir: str, job_id: str) -> list[tuple[int, int, str]]:
    """(checkpoint id, epoch, path) of every completed checkpoint of ``job_id`` in storage, oldest first."""
    base = Path(checkpoints_dir.removeprefix("file://")) / job_id
    out = []
    for d in base.glob("chk-*"):
        epoch = checkpoint_epoch(str(d))
        if epoch is not None and d.name[4:].isdigit():
            out.append((int(d.name[4:]), epoch, d.as_uri()))
    return sorted(out)


@dataclass
class Comparison:
    """The served state against a reference: counts and the pipeline's own description of the difference."""

    events: int
    lost: int
    doubled: int
    unexpected: int
    wrong_keys: int
    text: str | None

    @property
    def exact(self) -> bool:
        return self.text is None


def compare(pipeline: ExactlyOncePipeline, files: list[int]) -> Comparison:
    """Every key's count, sum and exact multiset of event ids against the reference of ``files``."""
    expected = pipeline.reference(files)
    actual = pipeline.read_state()
    want = Counter((k, i) for k, (_, ids) in expected.items() for i in ids)
    got = Counter((k, i) for k, (_, ids) in actual.items() for i in ids)
    lost, extra = want - got, got - want
    doubled = sum(n for key, n in extra.items() if key in want)
    wrong = sum(
        1
        for k in set(expected) | set(actual)
        if (actual.get(k, (None, []))[0], sorted(actual.get(k, (None, []))[1]))
        != (expected.get(k, (None, []))[0], sorted(expected.get(k, (None, []))[1]))
    )
    text = None
    if lost or extra or wrong:
        text = pipeline.diff(files) or f"{wrong} keys differ in count or sum only"
    return Comparison(sum(want.values()), sum(lost.values()), doubled, sum(extra.values()) - doubled, wrong, text)


def keep_logs(base: Path, target: Path) -> None:
    """Copy a run's logs (daemons, drivers, progress), not its state, to ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    for path in base.rglob("*"):
        if path.is_file() and (path.suffix in (".log", ".jsonl", ".json", ".txt") or path.name == "_metadata"):
            if "spark-checkpoint" in path.parts or "spark-work" in path.parts:
                continue
            if path.suffix == ".log" and path.stem.isdigit():
                continue  # a RocksDB write-ahead log, not a log to read
            dest = target / path.relative_to(base)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)


def interruptible_sleep(stop: threading.Event, seconds: float) -> bool:
    """Sleep; True if ``stop`` was set meanwhile."""
    return stop.wait(max(0.0, seconds))


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


Action = Callable[[FaultRecord], None]
