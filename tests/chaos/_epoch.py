"""An epoch-mode chaos run: the exactly-once pipeline through a killable Spark driver, under a schedule.

The driver (``_driver.py``) runs in its own process group. The harness starts it, applies the
schedule's faults while it runs, and reacts to how it ends, as an operator would:

* killed (by a fault, or by itself at a driver crash point): start it again on the same
  checkpointLocation after the schedule's delay;
* finished: the stream is done;
* stopped with ``EpochGapError`` after an operator's restore of an older checkpoint: the refusal
  is checked (state = the restored checkpoint's batches), then, if the schedule says so, the
  operator restores a checkpoint holding the batch before the refused one and starts the driver
  again; otherwise the run ends there;
* stopped with ``JobStateError`` after the harness cancelled (or restored) the job: start the
  driver again (it resubmits the job; the next batch must be refused, and the operator restores
  the checkpoint the refusal names);
* stopped because the job is FAILED when the schedule gave a small restart budget, or with
  ``BatchTimeoutError`` naming ``CHECKPOINT_EXPIRED`` during a checkpoint-timeout phase: the
  state is checked against the batches Spark recorded, the operator restores the latest
  checkpoint (FAILED) or waits for the phase to end, and starts the driver again;
* anything else is a failure.

At the end every fault is undone and the state is compared with the plain-Python reference of
exactly the batches Spark's commit log holds (all of them, unless an unremedied refusal ended
the run: then exactly the restored checkpoint's).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from tests.chaos import _spark_log as spark_log
from tests.chaos._faults import FaultActions
from tests.chaos._run import (
    ChaosCluster,
    Comparison,
    FaultRecord,
    RunResult,
    Timeline,
    checkpoint_epoch,
    checkpoints_on_disk,
    compare,
    fault_records,
)
from tests.chaos._schedule import FaultSchedule
from tests.integration.exactly_once._pipeline import essence

DRIVER = Path(__file__).with_name("_driver.py")
MAX_DRIVER_STARTS = 14
BATCH_TIMEOUT_S = 120.0
MAX_BATCH_ATTEMPTS = 10
"""Generous: every failover under a batch costs a run, and a schedule may stack four of them."""
DRIVER_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
"""A driver lives for seconds on a busy 2-core machine: the C1 compiler alone and the serial collector
start it in about half the time (measured: 28 s against 49 s to the end of a 6-batch stream)."""


class ChaosFailure(AssertionError):
    """The run found exactly-once broken, or the query stopped for a reason no fault allows."""


class ProgressLog:
    """The drivers' shared progress file (``_driver.py``), re-read when it grew."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._size = -1
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            try:
                size = self.path.stat().st_size
            except FileNotFoundError:
                return []
            if size != self._size:
                lines = self.path.read_text(encoding="utf-8").splitlines()
                self._events = [json.loads(line) for line in lines if line.endswith("}")]
                self._size = size
            return list(self._events)

    def first_start(self, batch: int) -> float | None:
        return next((e["t"] for e in self.events() if e["ev"] == "start" and e["batch"] == batch), None)

    def current_batch(self) -> int | None:
        starts = [e["batch"] for e in self.events() if e["ev"] == "start"]
        return starts[-1] if starts else None


class Driver:
    """One driver process (an incarnation of the Spark application)."""

    def __init__(self, n: int, base: Path, config: dict[str, Any]) -> None:
        self.n = n
        self.out = base / f"driver-{n}"
        self.out.mkdir(parents=True, exist_ok=True)
        self.config_path = self.out / "config.json"
        self.config_path.write_text(json.dumps(config, indent=1), encoding="utf-8")
        self.log_path = self.out / "driver.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.killed_by: FaultRecord | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(DRIVER), str(self.config_path), str(self.out)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=dict(os.environ),
            )

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self, group: bool) -> None:
        """kill -9 the whole application (process group: Python, JVM, workers) or its Python process only."""
        if self.process is None:
            return
        try:
            if group:
                os.killpg(self.process.pid, signal.SIGKILL)
            else:
                self.process.kill()
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)

    def reap(self) -> None:
        """Whatever is left of the application (a JVM outliving its killed Python process) goes too."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def outcome(self) -> dict[str, Any] | None:
        try:
            outcome: dict[str, Any] = json.loads((self.out / "outcome.json").read_text(encoding="utf-8"))
            return outcome
        except FileNotFoundError:
            return None

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Ending:
    """How the stream ended: ``finished``, or ``refused`` at a state holding ``epoch`` (no remedy)."""

    kind: str
    epoch: int = -1


class EpochChaosRun:
    """One seed's run in epoch mode (see the module docstring)."""

    def __init__(
        self,
        schedule: FaultSchedule,
        base: Path,
        net: Any = None,
        deadline_s: float = 240.0,
        config: dict[str, str] | None = None,
    ) -> None:
        self.schedule = schedule
        self.base = Path(base)
        self.deadline_s = deadline_s
        self.timeline = Timeline()
        self.records = fault_records(schedule)
        self.cluster = ChaosCluster(schedule, self.base, self.timeline, self.records, net, config=config)
        self.pipeline = self.cluster.pipeline
        self.progress = ProgressLog(self.base / "progress.jsonl")
        self.task_failure_log = self.base / "task-failures.jsonl"
        self.done = threading.Event()
        self.drivers: list[Driver] = []
        self.operator_lock = threading.Lock()
        self.pending_restore: tuple[FaultRecord, int] | None = None
        """An operator restore of an older checkpoint (its fault, the restored epoch) not yet refused."""
        self.cancel_state = ""
        """``cancelled`` after the harness cancelled the job, ``resubmitted`` once a driver started after it."""
        self.actions = FaultActions(
            self.cluster,
            self.records,
            self.timeline,
            self._trigger,
            self._where,
            self.done,
            extra={
                "driver_kill": self._driver_kill,
                "restore_older": self._restore_older,
                "cancel_resubmit": self._cancel,
            },
        )
        self.result = RunResult(
            schedule.seed, schedule.mode, schedule.netns, schedule.describe(), log_dir=str(self.base)
        )

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> RunResult:
        started = time.monotonic()
        try:
            self.cluster.start()
            self.pipeline.write_files()
            self.timeline.log(f"cluster up at {self.pipeline.address}; {self.schedule.files} files written")
            self.actions.start()
            ending = self._drive()
            self._finish(ending)
        except ChaosFailure as exc:
            self.result.failure = str(exc)
            self._salvage()
        except Exception as exc:
            self.result.failure = f"the harness failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
        finally:
            self.done.set()
            for driver in self.drivers:
                driver.reap()
            try:
                self.actions.join(timeout_s=60)
            except Exception:
                pass
        self._account()
        return self.result.conclude(self.cluster.findings + self.actions.errors, started, self.records, self.timeline)

    def close(self) -> None:
        self.done.set()
        for driver in self.drivers:
            driver.reap()
        self.cluster.close()

    def _deadline_left(self) -> float:
        return self.deadline_s - self.timeline.now()

    def _drive(self) -> Ending:
        delay = 0.0
        while True:
            if len(self.drivers) >= MAX_DRIVER_STARTS:
                raise ChaosFailure(f"the driver was started {MAX_DRIVER_STARTS} times without the stream finishing")
            if delay:
                time.sleep(delay)
            driver = self._start_driver()
            while driver.alive and self._deadline_left() > 0:
                time.sleep(0.1)
            if driver.alive:
                driver.kill(group=True)
                raise ChaosFailure(
                    f"the run did not end within {self.deadline_s:.0f} s (driver {driver.n} still running; "
                    f"last batch it started: {self.progress.current_batch()})"
                )
            self._credit_driver_faults()
            outcome = driver.outcome()
            if outcome is None:
                delay = self._after_kill(driver)
                continue
            self.timeline.log(f"driver {driver.n} ended: {outcome['status']} {outcome.get('error') or ''}".rstrip())
            if outcome["status"] == "finished":
                return Ending("finished")
            delay, ending = self._after_error(driver, outcome)
            if ending is not None:
                return ending

    def _start_driver(self) -> Driver:
        n = len(self.drivers)
        if self.cancel_state == "cancelled":
            self.cancel_state = "resubmitted"
        unfired = [r for r in self.records if not r.fired]
        config = {
            "incarnation": n,
            "jobmanager": self.pipeline.address,
            "job_id": self.pipeline.job_id,
            "parallelism": self.schedule.parallelism,
            "batch_mode": self.schedule.batch_mode,
            "source": str(self.pipeline.source),
            "checkpoint_location": self.pipeline.spark_checkpoint,
            "progress": str(self.progress.path),
            "task_failure_log": str(self.task_failure_log),
            "files": self.schedule.files,
            "batch_timeout_s": BATCH_TIMEOUT_S,
            "max_batch_attempts": MAX_BATCH_ATTEMPTS,
            "java_options": DRIVER_JAVA_OPTIONS,
            "task_failures": [
                [r.fault.at_batch, int(r.fault.value), r.fault.variant]
                for r in unfired
                if r.fault.kind == "task_failure"
            ],
            "query_stops": [[r.fault.at_batch, r.fault.delay_s] for r in unfired if r.fault.kind == "query_restart"],
            "self_kills": [
                [r.fault.at_batch, r.fault.variant]
                for r in unfired
                if r.fault.kind == "driver_kill" and r.fault.variant in ("before-batch", "after-return")
            ],
        }
        driver = Driver(n, self.base, config)
        driver.start()
        self.drivers.append(driver)
        self.timeline.log(f"driver {n} started (pid {driver.process.pid if driver.process else '?'})")
        return driver

    def _credit_driver_faults(self) -> None:
        """Mark the driver-side faults that fired (self-kills, query stops, task failures)."""
        events = self.progress.events()
        failures = []
        if self.task_failure_log.exists():
            failures = [
                json.loads(line) for line in self.task_failure_log.read_text(encoding="utf-8").splitlines() if line
            ]
        for r in self.records:
            f = r.fault
            if r.fired:
                continue
            if f.kind == "driver_kill" and f.variant in ("before-batch", "after-return"):
                hit = next(
                    (
                        e
                        for e in events
                        if e["ev"] == "self-kill" and e["batch"] == f.at_batch and e["point"] == f.variant
                    ),
                    None,
                )
            elif f.kind == "query_restart":
                hit = next((e for e in events if e["ev"] == "query-stop" and e["batch"] == f.at_batch), None)
            elif f.kind == "task_failure":
                hit = next((e for e in failures if e["batch"] == f.at_batch and e["partition"] == int(f.value)), None)
            else:
                continue
            if hit is not None:
                r.fired, r.at, r.context = True, hit["t"] - (time.time() - self.timeline.now()), f"batch {f.at_batch}"

    def _after_kill(self, driver: Driver) -> float:
        """A driver that left no outcome: killed by a fault, or by itself at a driver crash point."""
        cause = driver.killed_by
        if cause is None:
            kills = [e for e in self.progress.events() if e["ev"] == "self-kill" and e["driver"] == driver.n]
            if kills:
                cause = next(
                    (
                        r
                        for r in self.records
                        if r.fault.kind == "driver_kill"
                        and r.fault.at_batch == kills[-1]["batch"]
                        and r.fault.variant == kills[-1]["point"]
                    ),
                    None,
                )
        if cause is None:
            driver.reap()
            code = driver.process.returncode if driver.process is not None else None
            raise ChaosFailure(
                f"driver {driver.n} died without an outcome and no fault killed it (exit code {code}); "
                f"its log {driver.log_path} ends:\n{driver.log_tail()}"
            )
        # A driver whose Python process alone was killed leaves its JVM behind until the JVM notices
        # (its executors may still run tasks meanwhile); the run's end reaps whatever is left.
        delay = cause.fault.restart_after_s or 0.0
        self.timeline.log(f"driver {driver.n} was killed (fault {cause.index + 1}); restarting it in {delay:.1f} s")
        return delay

    # -- how a driver stopped ------------------------------------------------------------------
    def _after_error(self, driver: Driver, outcome: dict[str, Any]) -> tuple[float, Ending | None]:
        text = outcome.get("text") or outcome.get("error") or ""
        summary = outcome.get("error") or essence(text)
        self.result.outcome = f"driver {driver.n} stopped: {summary[:300]}"
        if outcome.get("phase") == "submit" and ("Unavailable" in text or "UNAVAILABLE" in text):
            self.timeline.log("the driver could not submit the job (JobManager unavailable): a supervisor restarts it")
            return 1.0, None
        if "EpochGapError" in text:
            return 0.0, self._after_refusal(text, summary)
        job_state = re.search(r"JobStateError: job '[^']*' is (\w+)", text)
        if job_state and job_state.group(1) == "CANCELED":
            if self.cancel_state or self.pending_restore is not None:
                self.timeline.log("the query stopped on the job the operator cancelled or restored: starting it again")
                return 0.0, None
            raise ChaosFailure(
                f"the query stopped because the job was cancelled, but no operator cancelled it: {summary}"
            )
        if job_state and job_state.group(1) == "FAILED":
            if self.schedule.restart_attempts >= 100:
                raise ChaosFailure(f"the job FAILED although its restart budget (100) cannot run out here: {summary}")
            self._remedy_failed(summary)
            return 0.0, None
        if "BatchTimeoutError" in text and "CHECKPOINT_EXPIRED" in text and self.actions.checkpoint_phases:
            self._check_recorded(f"the query stopped naming the checkpoint expiry ({summary})")
            while any(p[1] is None for p in self.actions.checkpoint_phases) and self._deadline_left() > 0:
                time.sleep(0.2)
            self.timeline.log("the checkpoint-timeout phase is over: starting the driver again")
            return 0.0, None
        raise ChaosFailure(f"the query stopped for a reason no fault of the schedule allows: {summary}")

    def _after_refusal(self, text: str, summary: str) -> Ending | None:
        """An EpochGapError: expected only after an operator restore or cancel; remedied as the operator would."""
        recorded = spark_log.committed_batches(self.pipeline.spark_checkpoint)
        if self.pending_restore is not None:
            record, restored = self.pending_restore
            self._check_state(
                list(range(restored + 1)), f"the query was refused after the operator restored epoch {restored}"
            )
            if not record.fault.remedy:
                self.timeline.log(f"refused as expected ({summary}); the operator leaves it so (no remedy)")
                return Ending("refused", restored)
            match = re.search(r"Restore a checkpoint that holds epoch (\d+)", text)
            if match is None:
                raise ChaosFailure(f"the refusal does not say which epoch to restore: {summary}")
            needed = int(match.group(1))
            candidates = [
                c for c in checkpoints_on_disk(self.pipeline.checkpoints_dir, self.pipeline.job_id) if c[1] == needed
            ]
            if not candidates:
                held = [
                    (cid, e) for cid, e, _ in checkpoints_on_disk(self.pipeline.checkpoints_dir, self.pipeline.job_id)
                ]
                raise ChaosFailure(
                    f"the refusal asks for a checkpoint holding epoch {needed} (Spark recorded batches "
                    f"{recorded}), but no completed checkpoint in storage holds it: {held}"
                )
            path = candidates[-1][2]
            if not self.cluster.restore(path, f"remedy: the refusal asks for epoch {needed}"):
                raise ChaosFailure(f"the operator's remedy, statectl job restore --from {path}, failed")
            self.pending_restore = None
            return None
        if self.cancel_state:  # resubmitted by a new driver, or by a new query of the same driver
            named = re.findall(r"latest checkpoint at (\w+://\S+?),? holding epoch", text)
            if not named:
                if not recorded:
                    raise ChaosFailure(f"refused after the cancel although Spark had recorded no batch: {summary}")
                raise ChaosFailure(f"the refusal after the cancel names no checkpoint to restore: {summary}")
            path = named[-1]
            held_epoch = checkpoint_epoch(path)
            last = max(recorded) if recorded else -1
            if held_epoch is None or not last <= held_epoch <= last + 1:
                raise ChaosFailure(
                    f"the cancelled job's latest checkpoint {path} holds epoch {held_epoch}, but Spark recorded "
                    f"batches {recorded}: a recorded batch is not in it"
                )
            if not self.cluster.restore(path, "remedy: the checkpoint the refusal names"):
                raise ChaosFailure(f"the operator's remedy, statectl job restore --from {path}, failed")
            self.cancel_state = ""
            return None
        raise ChaosFailure(
            f"the query was refused though no operator restored or cancelled anything (Spark recorded "
            f"batches {recorded}): {summary}"
        )

    def _remedy_failed(self, summary: str) -> None:
        """The job FAILED (restart budget): the operator restores its latest checkpoint."""
        info = self.pipeline.job_info()
        recorded = spark_log.committed_batches(self.pipeline.spark_checkpoint)
        last = max(recorded) if recorded else -1
        path = info.latest_checkpoint_path
        held = checkpoint_epoch(path) if path else None
        self.timeline.log(f"the job FAILED ({summary}); its latest checkpoint {path or '-'} holds epoch {held}")
        if held is None:
            if recorded:
                raise ChaosFailure(
                    f"the job FAILED with no completed checkpoint while Spark recorded batches {recorded}"
                )
            return  # nothing recorded: the restarted driver submits the job afresh
        if not last <= held <= last + 1:
            raise ChaosFailure(
                f"the FAILED job's latest checkpoint holds epoch {held}, but Spark recorded batches "
                f"{recorded}: a recorded batch is not in it"
            )
        if not self.cluster.restore(path, "remedy: the FAILED job's latest checkpoint"):
            raise ChaosFailure(f"the operator's restore of the FAILED job's latest checkpoint {path} failed")
        self._check_state(list(range(held + 1)), f"after restoring the FAILED job's latest checkpoint (epoch {held})")

    # -- checks --------------------------------------------------------------------------------
    def _files(self, batches: list[int]) -> list[int]:
        return spark_log.files_of(self.pipeline.spark_checkpoint, batches) if batches else []

    def _check_state(self, batches: list[int], context: str) -> Comparison | None:
        """The served state equals the reference of exactly ``batches``; skipped if the job is not RUNNING."""
        info = self.pipeline.wait_for_job(
            lambda i: i.status in (pb.JOB_STATUS_RUNNING, pb.JOB_STATUS_CANCELED, pb.JOB_STATUS_FAILED),
            "RUNNING (or terminal) to check its state",
            60,
        )
        if info.status != pb.JOB_STATUS_RUNNING:
            self.timeline.log(f"{context}: the job is {info.status}; its state is not served")
            return None
        result = compare(self.pipeline, self._files(batches))
        self.timeline.log(f"{context}: state {'= ' if result.exact else '!= '}batches {batches}")
        if not result.exact:
            self._count(result)
            raise ChaosFailure(f"{context}: {result.text}")
        return result

    def _check_recorded(self, context: str) -> None:
        """After an allowed stop: the state holds exactly the batches Spark recorded, or those and the next one whole."""
        recorded = spark_log.committed_batches(self.pipeline.spark_checkpoint)
        info = self.pipeline.wait_for_job(
            lambda i: i.status in (pb.JOB_STATUS_RUNNING, pb.JOB_STATUS_CANCELED, pb.JOB_STATUS_FAILED),
            "RUNNING (or terminal) to check its state",
            60,
        )
        if info.status != pb.JOB_STATUS_RUNNING:
            self.timeline.log(f"{context}: the job is {info.status}; its state is not served")
            return
        options = [recorded]
        planned = spark_log.batch_files(self.pipeline.spark_checkpoint)
        nxt = (max(recorded) + 1) if recorded else 0
        if nxt in planned:
            options.append(recorded + [nxt])
        results = [compare(self.pipeline, self._files(o)) for o in options]
        if not any(r.exact for r in results):
            self._count(results[0])
            raise ChaosFailure(
                f"{context}; Spark recorded batches {recorded}, and the state matches neither them nor "
                f"them and batch {nxt} whole: " + " | ".join(str(r.text) for r in results)
            )
        self.timeline.log(
            f"{context}: the state holds exactly the recorded batches{' (and the next)' if not results[0].exact else ''}"
        )

    def _finish(self, ending: Ending) -> None:
        """Undo every fault, then compare the state with the reference of what Spark recorded."""
        self.done.set()
        self.actions.join(timeout_s=60)
        self.cluster.settle()
        info = self.pipeline.wait_for_job(
            lambda i: i.status in (pb.JOB_STATUS_RUNNING, pb.JOB_STATUS_CANCELED, pb.JOB_STATUS_FAILED),
            "RUNNING (or terminal) after the faults were undone",
            90,
        )
        recorded = spark_log.committed_batches(self.pipeline.spark_checkpoint)
        if info.status != pb.JOB_STATUS_RUNNING:
            path = info.latest_checkpoint_path
            self.timeline.log(
                f"the job is {info.status} at the end; the operator restores its latest checkpoint {path}"
            )
            if not path or not self.cluster.restore(path, "to read the final state"):
                raise ChaosFailure(
                    f"the job is {info.status} at the end ({info.failure_cause}) and its latest "
                    f"checkpoint ({path or 'none'}) cannot be restored"
                )
        lineage = [(e.query_id[:8], e.offset, e.first_epoch) for e in self.pipeline.job_info().lineage]
        self.timeline.log(f"final: Spark recorded batches {recorded}; job lineage {lineage}")
        if ending.kind == "finished":
            self.result.outcome = "finished"
            missing = sorted(set(range(self.schedule.files)) - set(recorded))
            if missing:
                raise ChaosFailure(f"the query finished, but Spark's commit log lacks batches {missing}")
            expected = list(range(self.schedule.files))
        else:
            self.result.outcome = f"refused after the operator restored epoch {ending.epoch} (no remedy)"
            expected = list(range(ending.epoch + 1))
        result = compare(self.pipeline, self._files(expected))
        self._count(result)
        if not result.exact:
            raise ChaosFailure(
                f"the stream {self.result.outcome}, but the state is not the reference of batches "
                f"{expected}: {result.text}"
            )

    def _salvage(self) -> None:
        """After a failure: undo the faults and count what the state lost or doubled against the batches
        Spark recorded (or those and the next), for the summary. The failure stands whatever this finds."""
        if self.result.events_checked:
            return  # a comparison already counted them
        try:
            for driver in self.drivers:
                driver.reap()
            self.done.set()
            self.actions.join(timeout_s=60)
            self.cluster.settle()
            info = self.pipeline.wait_for_job(
                lambda i: i.status in (pb.JOB_STATUS_RUNNING, pb.JOB_STATUS_CANCELED, pb.JOB_STATUS_FAILED),
                "RUNNING (or terminal)",
                60,
            )
            if info.status != pb.JOB_STATUS_RUNNING:
                return
            recorded = spark_log.committed_batches(self.pipeline.spark_checkpoint)
            results = [compare(self.pipeline, self._files(recorded))]
            planned = spark_log.batch_files(self.pipeline.spark_checkpoint)
            nxt = (max(recorded) + 1) if recorded else 0
            if nxt in planned:
                results.append(compare(self.pipeline, self._files(recorded + [nxt])))
            best = min(results, key=lambda c: (c.lost + c.doubled + c.unexpected, c.wrong_keys))
            self._count(best)
            self.timeline.log(
                f"after the failure: against Spark's recorded batches {recorded}: {best.lost} lost, "
                f"{best.doubled} doubled, {best.unexpected} unexpected"
            )
        except Exception as exc:  # the failure is reported either way
            self.timeline.log(f"after the failure, the state could not be compared: {type(exc).__name__}: {exc}")

    def _count(self, c: Comparison) -> None:
        self.result.events_checked = c.events
        self.result.lost, self.result.doubled, self.result.unexpected = c.lost, c.doubled, c.unexpected

    def _account(self) -> None:
        """Driver starts, Spark job runs of batches, re-runs and replays, from the progress file."""
        events = self.progress.events()
        runs = 0
        ran: set[int] = set()
        open_calls: dict[tuple[int, int], int] = {}
        for e in events:
            key = (e.get("driver", 0), e.get("batch", -1))
            if e["ev"] == "start":
                open_calls[key] = open_calls.get(key, 0) + 1
            elif e["ev"] in ("return", "raise"):
                if open_calls.get(key):
                    open_calls[key] -= 1
                runs += int(e.get("runs", 0))
                if e.get("runs", 0):
                    ran.add(e["batch"])
                if e["ev"] == "return" and e.get("skipped"):
                    self.result.replays += 1
        unfinished = sum(open_calls.values())  # calls cut short by a kill: counted as one run each
        runs += unfinished
        ran |= {b for (_, b), n in open_calls.items() if n}
        self.result.driver_starts = len(self.drivers)
        self.result.queries_started = sum(1 for e in events if e["ev"] == "query" and e.get("state") == "started")
        self.result.batch_runs = runs
        self.result.batches_rerun = max(0, runs - len(ran))

    # -- driver-side and operator faults -------------------------------------------------------
    def _trigger(self, record: FaultRecord) -> bool:
        """Wait until the driver first starts the fault's batch, then its delay; False if the run ended first."""
        f = record.fault
        while not self.done.is_set():
            started = self.progress.first_start(f.at_batch)
            if started is not None:
                return not self.done.wait(max(0.0, started + f.delay_s - time.time()))
            self.done.wait(0.05)
        return False

    def _where(self) -> str:
        batch = self.progress.current_batch()
        return f"driver {len(self.drivers) - 1} in batch {batch}; {self.cluster.context()}"

    def _driver_kill(self, record: FaultRecord) -> None:
        f = record.fault
        if f.variant not in ("timed", "python-only"):
            return  # the driver kills itself at that point (its config)
        if not self.actions.trigger(record):
            return
        driver = self.drivers[-1] if self.drivers else None
        if driver is None or not driver.alive:
            record.note = "no driver was running"
            return
        driver.killed_by = record
        driver.kill(group=f.variant == "timed")
        self.actions.fire(record)
        self.timeline.log(f"kill -9 driver {driver.n} ({'process group' if f.variant == 'timed' else 'Python only'})")

    def _restore_older(self, record: FaultRecord) -> None:
        f = record.fault
        if not self.actions.trigger(record):
            return
        last_allowed = self.schedule.files - 3  # so that a batch is left to be refused
        if f.variant == "savepoint":
            taken = self.actions.take_savepoint(record)
            if taken is None:
                return
            source, epoch = taken
            while not self.done.is_set():
                recorded = spark_log.committed_batches(self.pipeline.spark_checkpoint)
                if recorded and max(recorded) >= epoch + 1:
                    break
                time.sleep(0.05)
            else:
                return
        else:
            recorded = spark_log.committed_batches(self.pipeline.spark_checkpoint)
            last = max(recorded) if recorded else -1
            listing = self.pipeline.client.list_checkpoints(self.pipeline.job_id)
            older = sorted(
                (c.epoch, c.path)
                for c in listing.checkpoints
                if c.status == jm_pb.CHECKPOINT_STATUS_COMPLETED and not c.savepoint and c.epoch <= last - 1
            )
            if not older:
                record.note = f"no retained checkpoint older than the last recorded batch {last}"
                return
            epoch, source = older[min(len(older) - 1, int(f.value * len(older)))]
        recorded = spark_log.committed_batches(self.pipeline.spark_checkpoint)
        last = max(recorded) if recorded else -1
        if last > last_allowed:
            record.note = f"too late: Spark had recorded batch {last}, no batch would be left to refuse"
            return
        with self.operator_lock:
            self.pending_restore = (record, epoch)
            if not self.cluster.restore(source, f"fault {record.index + 1}: an older {f.variant}"):
                self.pending_restore = None
                record.note = f"the restore of {source} failed"
                return
        self.actions.fire(record, f"restored {source} (epoch {epoch}) after Spark recorded batch {last}")

    def _cancel(self, record: FaultRecord) -> None:
        if not self.actions.trigger(record):
            return
        with self.operator_lock:
            self.cancel_state = "cancelled"
            done = self.cluster.statectl("job", "cancel", self.pipeline.job_id)
            if done is None or done.returncode != 0:
                self.cancel_state = ""
                record.note = f"statectl job cancel failed: {done.stderr.strip()[-300:] if done else 'no answer'}"
                return
        recorded = spark_log.committed_batches(self.pipeline.spark_checkpoint)
        self.actions.fire(record, f"cancelled after Spark recorded batches {recorded}")
        self.timeline.log(f"operator: statectl job cancel ({record.note})")
