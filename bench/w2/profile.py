"""Where ours' time goes on W2: py-spy samples of the TaskManagers and of Spark's Python workers during a run.

The profiled run is a separate, untimed run of the same input (py-spy takes CPU of its own on a
2-core machine). The summary gives, per side, the share of the samples in each phase and the
functions with the most own time.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

RATE_HZ = 100

# Inclusive phases: a sample counts for the first phase whose marker appears in its stack.
TM_PHASES = (
    ("epoch commit", "SlotEpochs.commit"),
    ("checkpoint", "TaskExecutorServicer.TriggerCheckpoint"),
    ("staged ListAppend", "KeyedStateServicer.ListAppend"),
    ("ValueGet", "KeyedStateServicer.ValueGet"),
    ("staged ValuePut", "KeyedStateServicer.ValuePut"),
    ("staged Clear", "KeyedStateServicer.Clear"),
    ("gRPC serving outside handlers", "grpc/_server.py"),
)
WORKER_PHASES = (
    ("state calls (client)", "_Handle._call"),
    ("session step", "advance (bench/w2/executor.py"),
    ("sort and Arrow", "sessionize_partition (bench/w2/executor.py"),
    ("Spark worker (Arrow I/O, waiting for input)", "pyspark"),
)


def py_spy() -> str | None:
    """The py-spy next to this interpreter, or on PATH; None when it is not installed."""
    local = Path(sys.executable).with_name("py-spy")
    return str(local) if local.exists() else shutil.which("py-spy")


def spark_workers() -> list[int]:
    """The pids of the pyspark daemons below this process (the JVM's Python worker factories)."""
    found: list[int] = []
    todo = [os.getpid()]
    while todo:
        pid = todo.pop()
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                todo += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        with contextlib.suppress(OSError):
            if pid != os.getpid() and b"pyspark.daemon" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


@contextlib.contextmanager
def recording(groups: dict[str, list[int]], outdir: Path) -> Iterator[dict[str, list[Path]]]:
    """py-spy records every pid (and its subprocesses) until the block ends; yields the raw files per group."""
    exe = py_spy()
    files: dict[str, list[Path]] = {g: [] for g in groups}
    procs: list[subprocess.Popen[bytes]] = []
    if exe is not None:
        outdir.mkdir(parents=True, exist_ok=True)
        for group, pids in groups.items():
            for pid in pids:
                path = outdir / f"{group}-{pid}.txt"
                files[group].append(path)
                cmd = [exe, "record", "--pid", str(pid), "--subprocesses", "--rate", str(RATE_HZ), "--nonblocking"]
                cmd += ["--format", "raw", "-o", str(path)]
                procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        yield files
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@dataclass(frozen=True)
class Profile:
    samples: int
    phases: dict[str, int]
    own: Counter[str]

    def summary(self, top: int = 5) -> str:
        if not self.samples:
            return "no samples"
        pct = ", ".join(f"{name} {n / self.samples:.0%}" for name, n in self.phases.items() if n)
        own = ", ".join(f"{frame} {n / self.samples:.0%}" for frame, n in self.own.most_common(top))
        return f"{self.samples} samples ({self.samples / RATE_HZ:.1f} s of CPU): {pct}; most own time: {own}"


def read(paths: list[Path], phases: tuple[tuple[str, str], ...]) -> Profile:
    """Fold py-spy raw (collapsed) stacks into phase shares and own time per function."""
    total = 0
    per_phase = dict.fromkeys((name for name, _ in phases), 0)
    per_phase["other"] = 0
    own: Counter[str] = Counter()
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            total += n
            frames = stack.split(";", 1)[-1]  # the first "frame" is the process and its command line
            phase = next((name for name, marker in phases if marker in frames), "other")
            per_phase[phase] += n
            own[stack.rsplit(";", 1)[-1].split(" (")[0]] += n
    return Profile(total, per_phase, own)
