"""A real Prometheus server (Debian's ``prometheus``) for tests, and PromQL queries through its HTTP API."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
MAKE_TARGET = "make metrics-deps"


def require_binary(name: str) -> str:
    """The path of ``name``; a skip naming the make target, or a failure under make or CI (a broken install)."""
    path = shutil.which(name)
    if path is not None:
        return path
    message = f"{name} is not installed: run `{MAKE_TARGET}` (Debian's prometheus package)"
    if os.environ.get("MAKELEVEL") is not None or os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


def _free_port() -> int:
    # Prometheus cannot listen on port 0: take a free port and hand it over (a small race, retried by the caller).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def scrape_config(jobs: dict[str, Sequence[int]], rule_files: Sequence[Path], interval: str = "1s") -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with its targets replaced by local ports and a short interval."""
    config: dict[str, Any] = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval}
    config["rule_files"] = [str(p) for p in rule_files]
    by_name = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(by_name) == set(jobs), f"deploy/prometheus/prometheus.yml scrapes {sorted(by_name)}"
    for name, ports in jobs.items():
        by_name[name]["static_configs"] = [{"targets": [f"127.0.0.1:{p}" for p in ports]}]
    return config


class Prometheus:
    """One Prometheus process with its TSDB in a temporary directory."""

    def __init__(self, url: str, process: subprocess.Popen[bytes], log: Path) -> None:
        self.url = url
        self.process = process
        self.log = log

    def api(self, path: str, **params: str) -> Any:
        """GET ``/api/v1/<path>``; the ``data`` of a successful answer."""
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as answer:
            body = json.load(answer)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar, as a one-element list) ``expr`` evaluates to now."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result


@contextmanager
def prometheus(tmp: Path, config: dict[str, Any]) -> Iterator[Prometheus]:
    """A running Prometheus scraping as ``config`` says; stopped (and its TSDB removed with ``tmp``) at the end."""
    binary = require_binary("prometheus")
    tmp.mkdir(parents=True, exist_ok=True)
    config_file = tmp / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    log = tmp / "prometheus.log"
    for _attempt in range(3):
        port = _free_port()
        with log.open("wb") as out:
            process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config_file}",
                    f"--storage.tsdb.path={tmp / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--web.enable-lifecycle",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        server = Prometheus(f"http://127.0.0.1:{port}", process, log)
        try:
            if _ready(server):
                break
        except BaseException:
            _stop(process)
            raise
        _stop(process)
    else:
        raise AssertionError(f"prometheus did not start; its log:\n{log.read_text()[-3000:]}")
    try:
        yield server
    finally:
        _stop(process)


def _ready(server: Prometheus, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            return False  # most likely the port was taken meanwhile
        try:
            with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as answer:
                if answer.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


_COMPARISON = re.compile(r"\s*(==|!=|>=|<=|>|<)\s*[-+]?[0-9.eE+*/ ]+$")
_AND = re.compile(r"\s+and(?:\s+on\s*\([^)]*\))?\s+")


def without_thresholds(expr: str) -> list[str]:
    """The queries of an alert expression without their threshold comparisons (``a > 0 and on (x) b < 1`` -> a, b)."""
    return [_COMPARISON.sub("", part.strip()) for part in _AND.split(" ".join(expr.split()))]


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel, rows included."""
    out: list[tuple[str, str]] = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                out.append((inner["title"], target["expr"]))
    return out


def expand_variables(expr: str) -> str:
    """A dashboard query as Grafana sends it with every job selected and a 1 minute rate interval."""
    return expr.replace("$__rate_interval", "1m").replace('"$job_id"', '".*"')
