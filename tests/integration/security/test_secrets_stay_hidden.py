"""Secrets never leave the daemons: a real cluster of processes, then grep everything it wrote and printed.

The S3 keys are given with -D (the daemons warn and say what to do instead) and the tokens through
files; afterwards none of those strings may appear in the daemons' logs, their Prometheus
metrics, checkpoint ``_metadata``, the high-availability records, or statectl's output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from keyedstate.common.client import ClientSettings, StateClient, ValueState
from tests.integration.security._tokens import make_tokens
from tests.integration.serving._support import OPERATOR, operators

JOB = "secret-job"
S3_ACCESS = "AKIA-ACCESS-VALUE-7f3e"
S3_SECRET = "s3-SECRET-VALUE-9c1d5a"


def _statectl(*args: str, token_file: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KEYEDSTATE_TOKEN_FILE": token_file}
    return subprocess.run(
        [sys.executable, "-m", "keyedstate.cli.statectl", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_secrets_appear_in_no_log_metric_metadata_or_statectl_output(
    process_cluster: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    tokens = make_tokens(
        tmp_path / "auth", {"ops": ("admin", ["*"]), "daemons": ("internal", ["*"]), "pipeline": ("writer", [JOB])}
    )
    ha_dir = tmp_path / "ha"
    # The test's own readiness probe (MiniCluster.wait_for_taskmanagers) finds its token as any client does.
    monkeypatch.setenv("KEYEDSTATE_TOKEN_FILE", tokens.file("ops"))
    cluster = process_cluster(
        taskmanagers=1,
        slots=2,
        config={
            "security.auth.enabled": "true",
            "security.auth.tokens-file": str(tokens.tokens_file),
            "security.auth.token-file": tokens.file("daemons"),
            "s3.access-key": S3_ACCESS,
            "s3.secret-key": S3_SECRET,
            "high-availability.type": "filesystem",
            "high-availability.storageDir": ha_dir.as_uri(),
        },
    )
    address = cluster.jobmanager_address
    settings = ClientSettings(timeout_s=30, max_attempts=3)
    with StateClient(address, settings, token=tokens.tokens["ops"]) as admin:
        admin.submit_job(JOB, operators(1))
    with StateClient(address, settings, token=tokens.tokens["pipeline"]) as pipeline:
        ValueState[str, int](pipeline, JOB, OPERATOR, "last").put_many([f"k{i}" for i in range(50)], list(range(50)))

    outputs = []
    for args in (
        ["checkpoint", "trigger", JOB],
        ["cluster"],
        ["cluster", "--json"],
        ["job", "info", JOB],
        ["job", "list", "--json"],
        ["checkpoint", "list", JOB, "--json"],
        ["config", "show", "-D", f"s3.secret-key={S3_SECRET}", "-D", f"s3.access-key={S3_ACCESS}"],
    ):
        result = _statectl(*args, "--jobmanager", address, token_file=tokens.file("ops"))
        assert result.returncode == 0, (args, result.stderr)
        outputs.append(result.stdout + result.stderr)
    shown = outputs[-1]
    assert "s3.secret-key: ******" in shown and "s3.access-key: ******" in shown
    assert "secret s3.secret-key was given with -D" in shown and "chmod 600" in shown
    assert re.search(r"checkpoint \d+ completed", outputs[0])

    logs = {p.name: p.read_text(errors="replace") for p in (cluster.base_dir / "log").glob("*.log")}
    jm_log = logs["jobmanager.log"]
    assert "secret s3.access-key was given with -D" in jm_log and "secret s3.secret-key was given with -D" in jm_log
    assert "configuration: s3.secret-key: ******" in jm_log
    assert "configuration: security.auth.token-file: " + tokens.file("daemons") in jm_log

    metrics = []
    for text in logs.values():
        for port in re.findall(r"serving Prometheus metrics on http://[\d.]+:(\d+)/metrics", text):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                metrics.append(response.read().decode())
    assert len(metrics) == 2 and "keyedstate_jobmanager_auth_refused_total" in "".join(metrics)

    stored = [
        p
        for root in (tmp_path,)
        for p in root.rglob("*")
        if p.is_file() and "log" not in p.parts and p.parent != tokens.dir
    ]
    metadata = [p for p in stored if p.name == "_metadata"]
    assert metadata and any("jobs" in str(p) or "job" in p.name for p in stored if "ha" in p.parts)

    secrets = {
        "S3 access key": S3_ACCESS,
        "S3 secret key": S3_SECRET,
        **{f"token {name}": token for name, token in tokens.tokens.items()},
    }
    haystacks = {
        **{f"log {n}": t for n, t in logs.items()},
        **{f"metrics {i}": m for i, m in enumerate(metrics)},
        **{f"statectl output {i}": o for i, o in enumerate(outputs)},
        **{f"file {p}": p.read_bytes().decode("latin-1") for p in stored},
    }
    leaks = [(what, where) for what, secret in secrets.items() for where, text in haystacks.items() if secret in text]
    assert leaks == []
