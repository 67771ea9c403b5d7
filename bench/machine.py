"""What the benchmark ran on: CPU, memory, OS, the versions that matter, and the git commit.

Absolute figures are only comparable on the same machine and versions, so every results file
carries this record next to the ratios.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent

# Distribution names whose versions change the figures.
PACKAGES = (
    "rocksdict",
    "grpcio",
    "protobuf",
    "pyspark",
    "pyarrow",
    "pandas",
    "redis",
    "hiredis",
    "fsspec",
    "s3fs",
    "moto",
    "matplotlib",
)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # psutil is in the bench extra; the record is still useful without it
        return None


def _command_version(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else None


def _redis_server_version() -> str | None:
    line = _command_version(["redis-server", "--version"])
    if line is None:
        return None
    # "Redis server v=7.0.15 sha=... malloc=..." -> "7.0.15"
    for part in line.split():
        if part.startswith("v="):
            return part[2:]
    return line


def _git_commit() -> str | None:
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def machine_info() -> dict[str, Any]:
    """A JSON-ready record of the machine, the interpreter, the packages and the commit."""
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    versions["redis-server"] = _redis_server_version()
    versions["java"] = _command_version(["java", "-version"])
    ram = _ram_bytes()
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "ram_gb": round(ram / (1 << 30), 1) if ram else None,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "versions": versions,
        "git_commit": _git_commit(),
    }


def describe(info: dict[str, Any]) -> str:
    """The machine record as a few human-readable lines."""
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
    missing = ", ".join(k for k, v in info["versions"].items() if not v)
    lines = [
        f"machine : {info['cpu']}, {info['cores']} cores, {info['ram_gb']} GiB RAM, {info['os']}",
        f"python  : {info['python']}; commit {info['git_commit'] or 'unknown'}",
        f"versions: {versions}",
    ]
    if missing:
        lines.append(f"missing : {missing}")
    return "\n".join(lines)
