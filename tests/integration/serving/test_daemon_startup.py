"""Start-up errors of the daemons as real processes: exit code 2 and a message naming the key to fix.

Each case runs ``python -m keyedstate.{taskmanager,jobmanager}`` to completion under a timeout, so a
daemon that starts instead of refusing fails the test rather than hanging it.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from keyedstate.common.config import Configuration
from keyedstate.common.errors import ConfigError
from keyedstate.jobmanager.daemon import JobManager
from keyedstate.taskmanager.daemon import TaskManager
from tests.integration.serving._support import free_port, run_module

TM = "keyedstate.taskmanager"
JM = "keyedstate.jobmanager"


def _tm_args(tmp_path: Path, *extra: str) -> list[str]:
    # A JobManager port nobody listens on and a short registration timeout: a TaskManager that
    # wrongly got past its config checks exits soon instead of waiting five minutes.
    base = {
        "state.backend.rocksdb.localdir": str(tmp_path / "tm"),
        "metrics.reporter.prom.port": "-1",
        "jobmanager.rpc.port": str(free_port()),
        "taskmanager.registration.timeout": "2 s",
    }
    args: list[str] = []
    for key, value in base.items():
        args += ["-D", f"{key}={value}"]
    return [*args, *extra]


def _jm_args(*extra: str) -> list[str]:
    return ["-D", "jobmanager.rpc.port=0", "-D", "metrics.reporter.prom.port=-1", "-D", "rest.port=-1", *extra]


def _assert_exit_2(result: object, *fragments: str) -> None:
    rc, stderr = result.returncode, result.stderr  # type: ignore[attr-defined]
    assert rc == 2, f"exit code {rc}; stderr:\n{stderr}"
    last = stderr.strip().splitlines()[-1]
    assert "Traceback" not in stderr, stderr
    for fragment in fragments:
        assert fragment in last, f"{fragment!r} not in {last!r}"


@pytest.mark.parametrize(
    "module,override,fragments",
    [
        (TM, "heartbeat.timeout=5parsecs", ["taskmanager:", "heartbeat.timeout", "'5parsecs'", "'30 s'"]),
        (TM, "taskmanager.numberOfTaskSlots=abc", ["taskmanager.numberOfTaskSlots", "expected an integer", "'abc'"]),
        (TM, "taskmanager.numberOfTaskSlots=0", ["taskmanager.numberOfTaskSlots", "at least 1"]),
        (TM, "state.backend.type=cassandra", ["state.backend.type", "rocksdb, hashmap"]),
        (TM, "taskmanager.memory.managed.size=lots", ["taskmanager.memory.managed.size", "256mb"]),
        (TM, "taskmanager.rpc.port=70000", ["taskmanager.rpc.port", "at most 65535"]),
        (TM, "state.limits.max-value-bytes=0", ["state.limits.max-value-bytes", "at least 1"]),
        (TM, "no-equals-sign", ["-D 'no-equals-sign'", "key=value"]),
        (JM, "heartbeat.timeout=5parsecs", ["jobmanager:", "heartbeat.timeout", "'5parsecs'"]),
        (
            JM,
            "heartbeat.interval=60 s",
            ["heartbeat.timeout (50000 ms)", "heartbeat.interval (60000 ms)", "must be larger"],
        ),
        (JM, "metrics.reporter.prom.port=9300-9200", ["metrics.reporter.prom.port", "9300-9200"]),
        (JM, "high-availability.type=zookeeper", ["high-availability.type", "none, filesystem"]),
    ],
)
def test_malformed_config_value_exits_2_naming_the_key(
    tmp_path: Path, module: str, override: str, fragments: list[str]
) -> None:
    args = _tm_args(tmp_path, "-D", override) if module == TM else _jm_args("-D", override)
    _assert_exit_2(run_module(module, *args), *fragments)


def test_localdir_under_a_regular_file_exits_2(tmp_path: Path) -> None:
    # Root ignores permission bits, so a path below a regular file is what cannot be written here.
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    for localdir in (blocker, blocker / "state"):
        result = run_module(TM, *_tm_args(tmp_path, "-D", f"state.backend.rocksdb.localdir={localdir}"))
        _assert_exit_2(result, "state.backend.rocksdb.localdir", str(localdir), "writable directory")


@pytest.mark.parametrize("module,key", [(TM, "taskmanager.rpc.port"), (JM, "jobmanager.rpc.port")])
def test_port_in_use_exits_2_naming_the_port_key(tmp_path: Path, module: str, key: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = _tm_args(tmp_path, "-D", f"{key}={port}") if module == TM else _jm_args("-D", f"{key}={port}")
        _assert_exit_2(run_module(module, *args), f"port {port}", "already in use", key)


def test_metrics_port_in_use_exits_2_naming_the_key(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_module(JM, *_jm_args("-D", f"metrics.reporter.prom.port={port}"))
    _assert_exit_2(result, "metrics.reporter.prom.port", "in use")


def test_unreachable_jobmanager_exits_2_within_the_registration_timeout(tmp_path: Path) -> None:
    started = time.monotonic()
    result = run_module(TM, *_tm_args(tmp_path), timeout_s=30)
    elapsed = time.monotonic() - started
    _assert_exit_2(
        result,
        "cannot reach the JobManager",
        "within 2 s",
        "jobmanager.rpc.address",
        "taskmanager.registration.timeout",
    )
    # Bounded by the 2 s timeout plus interpreter start-up, far from the 5 min default.
    assert elapsed < 20, elapsed


@pytest.mark.parametrize("module", [TM, JM])
@pytest.mark.parametrize(
    "content,fragments",
    [
        (None, ["cannot read config file", "No such file", "--config"]),
        ("- a\n- b\n", ["must hold a mapping", "not list"]),
        ("just a string\n", ["must hold a mapping", "not str"]),
        ("state:\n  backend: [\n", ["is not valid YAML"]),
        (b"\xff\xfe\x00binary", ["is not UTF-8"]),
    ],
)
def test_bad_config_file_exits_2(
    tmp_path: Path, module: str, content: str | bytes | None, fragments: list[str]
) -> None:
    path = tmp_path / "conf.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    args = _tm_args(tmp_path, "--config", str(path)) if module == TM else _jm_args("--config", str(path))
    _assert_exit_2(run_module(module, *args), str(path), *fragments)


def test_bad_value_in_a_nested_yaml_file_names_the_flattened_key(tmp_path: Path) -> None:
    path = tmp_path / "conf.yaml"
    path.write_text("taskmanager:\n  numberOfTaskSlots: many\n")
    _assert_exit_2(
        run_module(TM, *_tm_args(tmp_path, "--config", str(path))), "taskmanager.numberOfTaskSlots", "'many'"
    )


def test_bad_command_line_exits_2_with_usage() -> None:
    for module in (TM, JM):
        result = run_module(module, "--no-such-flag")
        assert result.returncode == 2
        assert "usage:" in result.stderr and "--no-such-flag" in result.stderr


# -- in-process: a failed start leaves nothing behind ---------------------------------------------


def test_failed_taskmanager_start_releases_its_local_dir_and_port(tmp_path: Path) -> None:
    """A failed start inside a long-lived process (tests, embedding) must not keep the directory lock."""
    conf = {
        "state.backend.rocksdb.localdir": str(tmp_path / "tm"),
        "taskmanager.resource-id": "tm-0",
        "metrics.reporter.prom.port": "-1",
        "jobmanager.rpc.port": free_port(),
        "taskmanager.registration.timeout": "0 ms",
    }
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        failed = TaskManager(Configuration({**conf, "taskmanager.rpc.port": taken.getsockname()[1]}))
        with pytest.raises(ConfigError, match="taskmanager.rpc.port"):
            failed.start()
    jm = JobManager(Configuration({"jobmanager.rpc.port": 0, "metrics.reporter.prom.port": "-1", "rest.port": -1}))
    jm.start()
    try:
        # Same local dir and resource id: the lock of the failed instance must be gone.
        tm = TaskManager(
            Configuration({**conf, "jobmanager.rpc.port": jm.port, "taskmanager.registration.timeout": "10 s"})
        )
        tm.start()
        tm.stop(grace_s=0)
    finally:
        jm.stop(grace_s=0)


def test_failed_jobmanager_start_frees_its_rpc_port() -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        metrics_port = taken.getsockname()[1]
        port = free_port()
        failed = JobManager(
            Configuration({"jobmanager.rpc.port": port, "metrics.reporter.prom.port": metrics_port, "rest.port": -1})
        )
        with pytest.raises(ConfigError, match="metrics.reporter.prom.port"):
            failed.start()
    again = JobManager(
        Configuration({"jobmanager.rpc.port": port, "metrics.reporter.prom.port": "-1", "rest.port": -1})
    )
    again.start()
    again.stop(grace_s=0)
