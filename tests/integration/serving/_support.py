"""Helpers shared by the serving tests: job specs, key picking, gRPC error inspection, daemons as processes."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any, cast

import grpc

from keyedstate.common.client import Routing
from keyedstate.common.descriptors import OperatorSpec, ReduceField, StateDescriptor, StateKind
from keyedstate.common.keygroups import key_group
from keyedstate.common.rpc.status import REASON_KEY

JOB = "orders"
OPERATOR = "enrich"


def operators(parallelism: int = 2) -> list[OperatorSpec]:
    """One operator with a state of every kind."""
    return [
        OperatorSpec(
            OPERATOR,
            parallelism,
            (
                StateDescriptor("last", StateKind.VALUE),
                StateDescriptor("events", StateKind.LIST),
                StateDescriptor("attrs", StateKind.MAP),
                StateDescriptor("totals", StateKind.REDUCING, reduce_fields=(ReduceField("n"),)),
            ),
        )
    ]


def key_of_subtask(routing: Routing, subtask: int, *, prefix: str = "key", length: int = 0) -> bytes:
    """A serialized key (``str`` serializer: UTF-8) that ``subtask`` owns; padded to ``length`` bytes if given."""
    routes = routing.operator(OPERATOR)
    for i in range(100_000):
        key = f"{prefix}-{i}".encode()
        if length:
            key = key.ljust(length, b"x")
        if routes.subtask_of[key_group(key, routing.max_parallelism)] == subtask:
            return key
    raise AssertionError(f"no key of subtask {subtask} found")


def keys_of_subtask(routing: Routing, subtask: int, n: int, prefix: str = "key") -> list[str]:
    routes = routing.operator(OPERATOR)
    out: list[str] = []
    i = 0
    while len(out) < n:
        key = f"{prefix}-{i}"
        if routes.subtask_of[key_group(key.encode(), routing.max_parallelism)] == subtask:
            out.append(key)
        i += 1
    return out


def rpc_error(call: Callable[[], Any]) -> grpc.Call:
    """Run ``call`` and return the gRPC error it must raise."""
    try:
        result = call()
    except grpc.RpcError as exc:
        return cast(grpc.Call, exc)  # a failed call's error is also the grpc.Call (code, details, trailers)
    raise AssertionError(f"the call succeeded with {result!r}; expected a gRPC error")


def reason(err: grpc.Call) -> str | bytes | None:
    return dict(err.trailing_metadata() or ()).get(REASON_KEY)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_module(module: str, *args: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run ``python -m module args`` to completion (a daemon that does not exit fails the test)."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout_s)
