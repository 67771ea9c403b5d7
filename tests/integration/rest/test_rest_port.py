"""``rest.port`` at start-up: a taken port stops the start with the key to fix, and leaves nothing behind."""

from __future__ import annotations

import socket

import pytest

from keyedstate.common.config import Configuration
from keyedstate.common.errors import ConfigError
from keyedstate.jobmanager.daemon import JobManager
from tests.integration.rest.conftest import get


def test_a_taken_rest_port_fails_the_start_naming_the_key_and_frees_the_grpc_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        rest_port = taken.getsockname()[1]
        failed = JobManager(
            Configuration({"jobmanager.rpc.port": 0, "metrics.reporter.prom.port": "-1", "rest.port": rest_port})
        )
        with pytest.raises(ConfigError, match=r"rest\.port") as info:
            failed.start()
        assert "Address already in use" in info.value.message or "in use" in info.value.message
        grpc_port = failed.port
    # The failed start released its gRPC port: a JobManager can take it, and serve REST on the freed port.
    again = JobManager(
        Configuration({"jobmanager.rpc.port": grpc_port, "metrics.reporter.prom.port": "-1", "rest.port": rest_port})
    )
    again.start()
    try:
        assert again.rest_port == rest_port
        assert get(f"http://127.0.0.1:{rest_port}/overview").body["taskmanagers"] == 0
    finally:
        again.stop(grace_s=0)
    with socket.socket() as probe:  # stop() closed the REST port too (SO_REUSEADDR: past TIME_WAIT, as a server binds)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", rest_port))
        probe.listen()


def test_rest_port_minus_one_serves_nothing() -> None:
    jm = JobManager(Configuration({"jobmanager.rpc.port": 0, "metrics.reporter.prom.port": "-1", "rest.port": -1}))
    jm.start()
    try:
        assert jm.rest_port is None
    finally:
        jm.stop(grace_s=0)
