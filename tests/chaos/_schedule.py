"""Fault schedules drawn reproducibly from a seed.

``FaultSchedule.from_seed(seed)`` draws, with ``random.Random(seed)`` only, the run's mode
(exactly-once epochs through a Spark driver, or direct writes), whether its daemons run on
hosts of a virtual network, a few faults from :data:`CATALOGUE` and each fault's timing: the
batch at which it strikes and the delay after that batch started, the crash point and which
pass of it, how long a pause or partition lasts, whether a killed process comes back. The same
seed always gives the same schedule; the run's real interleaving (process scheduling on a busy
machine) is not part of the schedule, so a replay repeats the faults, not every microsecond.

A schedule prints itself (:meth:`FaultSchedule.describe`) in every failure message, with the
command that replays it.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from typing import Any

TASKMANAGERS = 3
SLOTS = 2
PARALLELISM = 4
"""Three TaskManagers of two slots, the job at parallelism 4: one TaskManager can stay down."""
FILES = 6
"""Batches (Parquet files) per epoch-mode run."""
DIRECT_SECONDS = 14.0
"""How long the direct-mode writers run before the last fault; faults strike within it."""
HEARTBEAT_TIMEOUT_S = 3.0

TM_CRASH_POINTS = (
    "taskmanager.checkpoint.barrier",
    "taskmanager.checkpoint.before-ack",
    "taskmanager.epoch.before-commit",
    "taskmanager.epoch.committed",
)
JM_CRASH_POINTS = (
    "jobmanager.epoch.before-commit",
    "jobmanager.epoch.committed",
    "jobmanager.checkpoint.acknowledged",
    "jobmanager.checkpoint.metadata-written",
)
DIRECT_TM_CRASH_POINTS = TM_CRASH_POINTS[:2]
DIRECT_JM_CRASH_POINTS = JM_CRASH_POINTS[2:]
"""Direct mode commits no epochs: only the checkpoint crash points are ever passed."""

CATALOGUE: dict[str, str] = {
    "tm_kill": "kill -9 of a TaskManager at a crash point (before/after an epoch commit, at a checkpoint barrier, "
    "before its ack) or after a delay; restarted or not",
    "jm_kill": "kill -9 of the JobManager at a crash point or after a delay (filesystem HA); restarted",
    "driver_kill": "kill -9 of the Spark driver (its process group, or the Python process only) after a delay, or "
    "at the start of a batch or after foreachBatch returned; restarted on its checkpointLocation",
    "query_restart": "query.stop() in the middle of a batch, then a new query on the same checkpointLocation",
    "task_failure": "the first attempt of one task fails (before writing, after staging, or its Python worker exits)",
    "tm_pause": "SIGSTOP of a TaskManager for longer than heartbeat.timeout, then SIGCONT",
    "jm_pause": "SIGSTOP of the JobManager for longer than heartbeat.timeout, then SIGCONT",
    "rescale": "statectl job rescale while the query runs",
    "savepoint": "statectl savepoint while the query runs",
    "restore_older": "statectl job restore of an older checkpoint or savepoint: the next batch must be refused "
    "(EpochGapError); the operator then restores a checkpoint holding the batch before, or does not",
    "cancel_resubmit": "statectl job cancel; the restarted driver resubmits the job, which is refused (EpochGapError); "
    "the operator restores the cancelled job's latest checkpoint named in the refusal",
    "checkpoint_timeout": "the JobManager restarted with execution.checkpointing.timeout of a few ms for a while: "
    "every checkpoint expires, then it is restarted with the normal timeout",
    "heartbeat_only": "heartbeat.connection-loss-detection: false: losses are detected by heartbeat timeout only",
    "restart_budget": "a restart budget of one or two restarts: the job may end FAILED",
    "partition_tm_jm": "a TaskManager cut off from the JobManager only",
    "partition_tm_all": "a TaskManager cut off from every host",
    "partition_local_tm": "the driver and its executors (host local) cut off from a TaskManager",
    "loss": "random packet loss (iptables statistic) between two hosts",
}

MODIFIERS = ("heartbeat_only", "restart_budget")
"""Kinds that change the cluster's configuration for the whole run rather than strike at a moment."""
NETWORK_KINDS = ("partition_tm_jm", "partition_tm_all", "partition_local_tm", "loss")
OPERATOR_RESTORES = ("restore_older", "cancel_resubmit")

_EPOCH_WEIGHTS = {
    "tm_kill": 14,
    "jm_kill": 8,
    "driver_kill": 9,
    "query_restart": 5,
    "task_failure": 6,
    "tm_pause": 6,
    "jm_pause": 4,
    "rescale": 5,
    "savepoint": 4,
    "restore_older": 4,
    "cancel_resubmit": 4,
    "checkpoint_timeout": 4,
}
_DIRECT_WEIGHTS = {
    "tm_kill": 14,
    "jm_kill": 8,
    "tm_pause": 6,
    "jm_pause": 3,
    "rescale": 4,
    "savepoint": 3,
    "checkpoint_timeout": 3,
}
_NETWORK_WEIGHTS = {"partition_tm_jm": 6, "partition_tm_all": 5, "partition_local_tm": 5, "loss": 4}


@dataclass(frozen=True)
class Fault:
    """One fault of a schedule. Which fields matter depends on ``kind`` (see :meth:`describe`)."""

    kind: str
    target: str = ""
    """``tm0``..``tm2``, ``jm``, ``driver``, or a pair of hosts ``a-b`` for loss."""
    variant: str = ""
    """A crash point name, ``timed``, a task failure mode, a restore source, ..."""
    at_batch: int = -1
    """Epoch mode: strikes when the driver first starts this batch (-1: no batch trigger, e.g. a crash point)."""
    at_s: float = 0.0
    """Direct mode: strikes this many seconds after the writers started."""
    delay_s: float = 0.0
    """After the trigger."""
    nth: int = 0
    """Crash points: the n-th pass of the point by the process it is armed in."""
    duration_s: float = 0.0
    """Pauses, partitions, loss, checkpoint-timeout phases."""
    restart_after_s: float | None = None
    """Kills: the process is started again this long after it died (None: never)."""
    value: float = 0.0
    """Loss probability, rescale parallelism, the Spark partition of a task failure, restart attempts."""
    remedy: bool = True
    """Operator restores: whether the operator restores a checkpoint holding the missing batch afterwards."""

    @property
    def crash_point(self) -> bool:
        return self.variant in TM_CRASH_POINTS or self.variant in JM_CRASH_POINTS

    def when(self) -> str:
        if self.crash_point:
            return f"at the {_ordinal(self.nth)} pass of {self.variant}"
        if self.kind in MODIFIERS:
            return "for the whole run"
        if self.at_batch >= 0:
            return f"{self.delay_s:.2f} s after batch {self.at_batch} starts"
        return f"{self.at_s + self.delay_s:.1f} s after the writers start"

    def describe(self) -> str:
        k, w = self.kind, self.when()
        restart = (
            f"restarted {self.restart_after_s:.1f} s later" if self.restart_after_s is not None else "not restarted"
        )
        if k == "tm_kill":
            return f"kill -9 {self.target} {w}, {restart}"
        if k == "jm_kill":
            return f"kill -9 the JobManager {w}, {restart}"
        if k == "driver_kill":
            how = {
                "timed": "kill -9 the driver's process group",
                "python-only": "kill -9 the driver's Python process",
                "before-batch": "the driver kills itself (process group) as foreachBatch begins",
                "after-return": "the driver kills itself (process group) after foreachBatch returned",
            }[self.variant]
            when = w if self.variant in ("timed", "python-only") else f"in batch {self.at_batch}"
            return f"{how} {when}, {restart}"
        if k == "query_restart":
            return f"query.stop() {w}, then a new query on the same checkpointLocation"
        if k == "task_failure":
            mode = {
                "raise": "raises before writing",
                "raise-after-write": "raises after staging its writes",
                "exit": "kills its Python worker after staging its writes",
            }[self.variant]
            return f"the first attempt of batch {self.at_batch}, partition {int(self.value)} {mode}"
        if k in ("tm_pause", "jm_pause"):
            who = self.target if k == "tm_pause" else "the JobManager"
            return f"SIGSTOP {who} {w} for {self.duration_s:.1f} s, then SIGCONT"
        if k == "rescale":
            return f"statectl job rescale --parallelism {int(self.value)} {w}"
        if k == "savepoint":
            return f"statectl savepoint {w}"
        if k == "restore_older":
            then = "then restores a checkpoint holding the batch before the refused one" if self.remedy else "no remedy"
            return f"statectl job restore of an older {self.variant} {w} (the next batch must be refused; {then})"
        if k == "cancel_resubmit":
            return (
                f"statectl job cancel {w}; the restarted driver resubmits (refused), the operator restores the "
                "checkpoint the refusal names"
            )
        if k == "checkpoint_timeout":
            return f"JobManager restarted with execution.checkpointing.timeout={self.variant} {w} for {self.duration_s:.1f} s"
        if k == "heartbeat_only":
            return "heartbeat.connection-loss-detection: false (loss detected by heartbeat timeout only)"
        if k == "restart_budget":
            return f"restart-strategy.fixed-delay.attempts: {int(self.value)}"
        if k == "partition_tm_jm":
            return f"cut {self.target} from the JobManager {w} for {self.duration_s:.1f} s"
        if k == "partition_tm_all":
            return f"isolate {self.target} {w} for {self.duration_s:.1f} s"
        if k == "partition_local_tm":
            return f"cut host local (the driver and executors; the writers in direct mode) from {self.target} {w} for {self.duration_s:.1f} s"
        if k == "loss":
            a, b = self.target.split("-")
            return f"{self.value:.0%} packet loss between {a} and {b} {w} for {self.duration_s:.1f} s"
        return f"{k} {w}"


@dataclass(frozen=True)
class FaultSchedule:
    """The faults of one chaos run, drawn from ``seed`` (see the module docstring)."""

    seed: int
    mode: str
    """``epoch``: a Spark driver through foreach_batch; ``direct``: writers without epochs."""
    netns: bool
    """Each daemon on its own host of a virtual network (needed by the network faults)."""
    faults: tuple[Fault, ...]
    files: int = FILES
    parallelism: int = PARALLELISM
    extra: dict[str, Any] = field(default_factory=dict)
    batch_mode: str = "keyed"
    """Epoch mode: the foreach_batch mode, ``keyed`` or ``shuffle_free``."""

    # -- drawing -------------------------------------------------------------------------------
    @classmethod
    def from_seed(
        cls, seed: int, *, mode: str | None = None, netns: bool | None = None, max_faults: int = 3
    ) -> FaultSchedule:
        """The schedule of ``seed``: the same seed (and arguments) always gives the same schedule."""
        rnd = random.Random(seed)
        drawn_mode = "direct" if rnd.random() < 0.15 else "epoch"
        drawn_netns = rnd.random() < 0.3
        mode = mode or drawn_mode
        netns = drawn_netns if netns is None else netns
        weights = dict(_EPOCH_WEIGHTS if mode == "epoch" else _DIRECT_WEIGHTS)
        if netns:
            weights.update(_NETWORK_WEIGHTS)
        count = rnd.choices([1, 2, 3, 4], weights=[2, 4, 4, 1])[0]
        count = min(count, max_faults)
        kinds: list[str] = []
        if netns:  # a run on the virtual network has at least one network fault
            kinds.append(_weighted(rnd, _NETWORK_WEIGHTS))
        while len(kinds) < count:
            kind = _weighted(rnd, weights)
            if kind in OPERATOR_RESTORES and any(k in OPERATOR_RESTORES for k in kinds):
                continue
            if kind == "checkpoint_timeout" and kind in kinds:
                continue
            kinds.append(kind)
        faults: list[Fault] = []
        down: list[str] = []  # a TaskManager killed for good is no later fault's target
        for kind in kinds:
            fault = _draw(rnd, kind, mode, down)
            if fault.kind == "tm_kill" and fault.restart_after_s is None:
                down.append(fault.target)
            faults.append(fault)
        if rnd.random() < 0.2:
            faults.append(Fault("heartbeat_only"))
        if rnd.random() < 0.1:
            faults.append(Fault("restart_budget", value=rnd.choice([1, 2])))
        faults.sort(key=_order)
        # Drawn from its own stream, so adding it left every seed's faults as they were.
        batch_mode = "shuffle_free" if random.Random(f"{seed}:batch-mode").random() < 0.5 else "keyed"
        return cls(seed, mode, netns, tuple(faults), batch_mode=batch_mode)

    # -- reading -------------------------------------------------------------------------------
    def kinds(self) -> list[str]:
        return [f.kind for f in self.faults]

    def has(self, kind: str) -> bool:
        return kind in self.kinds()

    @property
    def heartbeat_only(self) -> bool:
        return self.has("heartbeat_only")

    @property
    def restart_attempts(self) -> int:
        budget = [f for f in self.faults if f.kind == "restart_budget"]
        return int(budget[0].value) if budget else 100

    def describe(self) -> str:
        where = "each daemon on its own network-namespace host" if self.netns else "all on 127.0.0.1"
        what = (
            f"{self.files} batches through a Spark driver (foreach_batch, exactly-once, {self.batch_mode} mode)"
            if self.mode == "epoch"
            else f"direct-mode writers for about {DIRECT_SECONDS:.0f} s"
        )
        lines = [
            f"seed {self.seed}: {what}; {where}; {TASKMANAGERS} TaskManagers x {SLOTS} slots, parallelism "
            f"{self.parallelism}"
        ]
        lines += [f"  {i + 1}. [{f.kind}] {f.describe()}" for i, f in enumerate(self.faults)]
        lines.append(f"  replay: {self.replay_command()}")
        return "\n".join(lines)

    def replay_command(self) -> str:
        return (
            f"KEYEDSTATE_CHAOS_SEEDS={self.seed} .venv/bin/python -m pytest tests/chaos -m chaos_soak "
            f"(a default or soak seed also: pytest tests/chaos -m 'chaos or chaos_soak' -k 'seed_{self.seed}]')"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "mode": self.mode,
            "batch_mode": self.batch_mode,
            "netns": self.netns,
            "files": self.files,
            "parallelism": self.parallelism,
            "faults": [asdict(f) for f in self.faults],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def _weighted(rnd: random.Random, weights: dict[str, int]) -> str:
    names = sorted(weights)
    return rnd.choices(names, weights=[weights[n] for n in names])[0]


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _order(f: Fault) -> tuple[int, float, str]:
    if f.kind in MODIFIERS:
        return (2, 0.0, f.kind)
    if f.crash_point:
        return (1, float(f.nth), f.kind)
    return (0, f.at_batch + f.delay_s + f.at_s, f.kind)


def _draw(rnd: random.Random, kind: str, mode: str, down: list[str]) -> Fault:
    """One fault of ``kind`` with its timing and parameters; ``down``: TaskManagers killed for good."""
    epoch = mode == "epoch"
    last = FILES - 2  # a batch trigger leaves at least one batch after it

    def trigger(first: int = 0, latest: int = last) -> dict[str, Any]:
        if epoch:
            return {"at_batch": rnd.randint(first, latest), "delay_s": round(rnd.uniform(0.0, 2.5), 2)}
        return {"at_s": round(rnd.uniform(2.0, DIRECT_SECONDS - 4.0), 1)}

    tm = rnd.choice([t for t in (f"tm{i}" for i in range(TASKMANAGERS)) if t not in down])
    if kind == "tm_kill":
        points = TM_CRASH_POINTS if epoch else DIRECT_TM_CRASH_POINTS
        restart = round(rnd.uniform(0.5, 4.0), 1) if (rnd.random() < 0.75 or down) else None
        if rnd.random() < 0.6:
            # Epoch points are passed once per commit, checkpoint points once per checkpoint (each
            # batch takes one); the before-ack point once per slot.
            point = rnd.choice(points)
            nth = rnd.randint(1, FILES - 1) if epoch else rnd.randint(2, 8)
            if point.endswith("before-ack"):
                nth = nth * 2 - rnd.randint(0, 1)
            return Fault(kind, tm, point, nth=nth, restart_after_s=restart)
        return Fault(kind, tm, "timed", restart_after_s=restart, **trigger())
    if kind == "jm_kill":
        restart = round(rnd.uniform(0.3, 3.0), 1)
        if rnd.random() < 0.5:
            point = rnd.choice(JM_CRASH_POINTS if epoch else DIRECT_JM_CRASH_POINTS)
            nth = rnd.randint(1, FILES - 1) if epoch else rnd.randint(2, 8)
            return Fault(kind, "jm", point, nth=nth, restart_after_s=restart)
        return Fault(kind, "jm", "timed", restart_after_s=restart, **trigger())
    if kind == "driver_kill":
        variant = rnd.choice(["timed", "timed", "python-only", "before-batch", "after-return"])
        return Fault(kind, "driver", variant, restart_after_s=round(rnd.uniform(0.2, 3.0), 1), **trigger())
    if kind == "query_restart":
        return Fault(kind, "driver", at_batch=rnd.randint(0, last), delay_s=round(rnd.uniform(0.05, 1.5), 2))
    if kind == "task_failure":
        return Fault(
            kind,
            "driver",
            rnd.choice(["raise", "raise-after-write", "exit"]),
            at_batch=rnd.randint(0, FILES - 1),
            value=rnd.randrange(PARALLELISM),
        )
    if kind in ("tm_pause", "jm_pause"):
        target = tm if kind == "tm_pause" else "jm"
        return Fault(kind, target, duration_s=round(HEARTBEAT_TIMEOUT_S + rnd.uniform(0.5, 3.0), 1), **trigger())
    if kind == "rescale":
        return Fault(kind, "jm", value=rnd.choice([2, 3, 4, 4]), **trigger())
    if kind == "savepoint":
        return Fault(kind, "jm", **trigger())
    if kind == "restore_older":
        # Batch b starts once b-1 is recorded: from batch 2 on, a checkpoint older than the last
        # recorded batch exists; up to FILES-2, a batch is left to be refused.
        return Fault(
            kind,
            "jm",
            rnd.choice(["checkpoint", "checkpoint", "savepoint"]),
            remedy=rnd.random() < 0.8,
            value=round(rnd.random(), 2),
            **trigger(first=2, latest=FILES - 2),
        )
    if kind == "cancel_resubmit":
        return Fault(kind, "jm", **trigger(first=1, latest=FILES - 2))
    if kind == "checkpoint_timeout":
        return Fault(kind, "jm", rnd.choice(["1 ms", "10 ms"]), duration_s=round(rnd.uniform(3.0, 8.0), 1), **trigger())
    if kind == "partition_tm_jm":
        long = rnd.random() < 0.7  # long enough for the JobManager to declare the TaskManager lost
        duration = HEARTBEAT_TIMEOUT_S + rnd.uniform(1.0, 5.0) if long else rnd.uniform(0.5, 2.5)
        return Fault(kind, tm, duration_s=round(duration, 1), **trigger())
    if kind == "partition_tm_all":
        return Fault(kind, tm, duration_s=round(rnd.uniform(1.0, 8.0), 1), **trigger())
    if kind == "partition_local_tm":
        return Fault(kind, tm, duration_s=round(rnd.uniform(1.0, 6.0), 1), **trigger())
    if kind == "loss":
        pair = rnd.choice([f"{tm}-jm", f"local-{tm}", "local-jm"])
        return Fault(
            kind, pair, value=round(rnd.uniform(0.05, 0.3), 2), duration_s=round(rnd.uniform(3.0, 8.0), 1), **trigger()
        )
    raise ValueError(f"no such fault kind {kind!r}; the catalogue has {sorted(CATALOGUE)}")
