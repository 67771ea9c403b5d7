"""Calling every RPC with hostile requests and judging each answer.

Methods are enumerated from the generated descriptors (every ``*_pb2`` module of the proto
package), so an RPC added to a .proto file is fuzzed without touching this file; a new
*service* must be added to ``SERVED_BY`` (the coverage test fails until it is).

Every request goes out as bytes through a channel method with identity serializers, so the
same path carries descriptor-generated messages, mutated valid requests and raw garbage.
"""

from __future__ import annotations

import collections
import importlib
import pkgutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
from google.protobuf import descriptor as d
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from keyedstate.common._proto import v1 as proto_v1
from keyedstate.common.errors import Reason
from keyedstate.common.rpc.status import REASON_KEY

SERVED_BY = {
    "keyedstate.v1.JobManager": "jobmanager",
    "keyedstate.v1.ResourceManager": "jobmanager",
    "keyedstate.v1.CheckpointCoordinatorGateway": "jobmanager",
    "keyedstate.v1.KeyedState": "taskmanager",
    "keyedstate.v1.TaskExecutor": "taskmanager",
}
"""Which daemon serves each service (the fuzz cluster runs plaintext: one server per daemon carries both planes)."""

PRIVATE_SERVICES = {
    "keyedstate.v1.SlotProcess": (
        "a slot process serves it only on a Unix socket in its TaskManager's mkdtemp directory (mode 0700, "
        "taskmanager/slot_processes.py): no network peer can call it, and the fuzz cluster runs one slot process"
    ),
}
"""Services no network peer reaches, each with the reason; the coverage test names them so none is left out by accident."""

# What a server may answer to a hostile request. Never UNKNOWN or INTERNAL (an unhandled
# exception), never DEADLINE_EXCEEDED (a hang), never UNIMPLEMENTED (a declared RPC must exist).
EXPECTED_CODES = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)

CALL_TIMEOUT_S = 15.0
"""A call without an answer by then counts as a hang."""

MAX_STREAM_CHUNKS = 10_000


@dataclass(frozen=True)
class Method:
    service: str
    name: str
    input: d.Descriptor
    output: d.Descriptor
    server_streaming: bool

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"

    @property
    def key(self) -> str:
        return f"{self.service.rsplit('.', 1)[-1]}.{self.name}"

    def request_class(self) -> type[Message]:
        return GetMessageClass(self.input)


def all_services() -> dict[str, d.ServiceDescriptor]:
    services: dict[str, d.ServiceDescriptor] = {}
    for info in pkgutil.iter_modules(proto_v1.__path__):
        if not info.name.endswith("_pb2"):
            continue
        module = importlib.import_module(f"{proto_v1.__name__}.{info.name}")
        for service in module.DESCRIPTOR.services_by_name.values():
            services[service.full_name] = service
    return services


def all_methods() -> list[Method]:
    out = []
    for service in all_services().values():
        for m in service.methods:
            out.append(Method(service.full_name, m.name, m.input_type, m.output_type, bool(m.server_streaming)))
    return out


def methods_of(service: str) -> list[Method]:
    return [m for m in all_methods() if m.service == service]


# -- outcomes ----------------------------------------------------------------------------------


@dataclass
class Finding:
    method: str
    mode: str
    code: str
    details: str
    request: bytes

    def __str__(self) -> str:
        shown = self.request[:300]
        return f"{self.method} [{self.mode}] -> {self.code}: {self.details[:400]} (request {len(self.request)} B: {shown!r})"


@dataclass
class Stats:
    """Counts per method and status, and every answer the oracle refused."""

    calls: collections.Counter[str] = field(default_factory=collections.Counter)
    codes: dict[str, collections.Counter[str]] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )
    modes: collections.Counter[str] = field(default_factory=collections.Counter)
    findings: list[Finding] = field(default_factory=list)
    samples: dict[tuple[str, str], str] = field(default_factory=dict)
    """The first message seen per (method, status), to read what the servers answered."""
    slowest: list[tuple[float, str, str, bytes]] = field(default_factory=list)
    """The slowest calls: (seconds, method, status, request)."""
    hangs: int = 0
    interrupted_runs: int = 0
    started: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(
        self,
        method: Method,
        mode: str,
        code: grpc.StatusCode,
        details: str,
        request: bytes,
        bad: str | None,
        seconds: float = 0.0,
    ) -> None:
        with self.lock:
            self.slowest.append((seconds, method.key, code.name, request[:200]))
            self.slowest.sort(key=lambda t: -t[0])
            del self.slowest[5:]
            self.calls[method.key] += 1
            self.codes[method.key][code.name] += 1
            self.modes[mode] += 1
            self.samples.setdefault((method.key, code.name), details[:200])
            if bad is not None:
                if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                    self.hangs += 1
                self.findings.append(Finding(method.key, mode, code.name, f"{bad}: {details}", request))

    def by_code(self) -> collections.Counter[str]:
        total: collections.Counter[str] = collections.Counter()
        for counter in self.codes.values():
            total.update(counter)
        return total

    def summary(self) -> str:
        lines = [
            f"{sum(self.calls.values())} calls in {time.monotonic() - self.started:.1f} s; modes {dict(self.modes)}",
            f"statuses: {dict(sorted(self.by_code().items()))}",
        ]
        for key in sorted(self.calls):
            lines.append(f"  {key}: {self.calls[key]} calls {dict(sorted(self.codes[key].items()))}")
        lines.append(f"findings: {len(self.findings)} (hangs {self.hangs})")
        lines.extend(f"  {f}" for f in self.findings[:20])
        lines.append("slowest calls: " + "; ".join(f"{m} {c} {t:.2f} s {r[:120]!r}" for t, m, c, r in self.slowest))
        lines.append("first answer per method and status:")
        lines.extend(f"  {k[0]} {k[1]}: {v}" for k, v in sorted(self.samples.items()) if k[1] != "OK")
        return "\n".join(lines)


def judge(
    method: Method, code: grpc.StatusCode, details: str, trailing: dict[str, str], response: list[bytes]
) -> str | None:
    """Why an answer breaks the oracle, or None when it is acceptable."""
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return "hang: no answer within the deadline"
    if code not in EXPECTED_CODES:
        return f"unexpected status {code.name}"
    if code is grpc.StatusCode.OK:
        cls = GetMessageClass(method.output)
        for chunk in response:
            try:
                cls.FromString(chunk)
            except DecodeError as exc:
                return f"the answer does not parse as {method.output.full_name}: {exc}"
        return None
    reason = trailing.get(REASON_KEY)
    if reason is None:
        # Only gRPC's own message-size limit answers without a typed reason.
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
            return None
        return f"{code.name} without the {REASON_KEY} trailer: not a typed error of the servicer"
    if reason == Reason.INTERNAL.value:
        return "a typed INTERNAL error (an unexpected exception in the servicer)"
    if not details:
        return "an error without a message"
    return None


def call_raw(
    channel: grpc.Channel, method: Method, body: bytes, stats: Stats, mode: str
) -> tuple[grpc.StatusCode, list[bytes]]:
    """Send ``body`` as the request of ``method``, judge the answer, record it; return (code, response chunks)."""
    t0 = time.monotonic()
    response: list[bytes] = []
    trailing: dict[str, str] = {}
    details = ""
    try:
        if method.server_streaming:
            # No (de)serializers: the raw request and response bytes go over the wire as they are.
            streaming: grpc.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(method.path)
            stream = streaming(body, timeout=CALL_TIMEOUT_S)
            for chunk in stream:
                response.append(chunk)
                if len(response) >= MAX_STREAM_CHUNKS:
                    stream.cancel()
                    break
            code = grpc.StatusCode.OK
        else:
            unary: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(method.path)
            response.append(unary(body, timeout=CALL_TIMEOUT_S))
            code = grpc.StatusCode.OK
    except grpc.RpcError as rpc_exc:
        exc = cast(grpc.Call, rpc_exc)  # a failed call's error is also the grpc.Call (code, details, trailers)
        code = exc.code()
        details = exc.details() or ""
        trailing = {k: v for k, v in (exc.trailing_metadata() or ()) if isinstance(v, str)}
        if code is grpc.StatusCode.CANCELLED and len(response) >= MAX_STREAM_CHUNKS:
            code = grpc.StatusCode.OK
    bad = judge(method, code, details, trailing, response)
    stats.record(method, mode, code, details, body, bad, time.monotonic() - t0)
    return code, response


ChannelFor = Callable[[str], grpc.Channel]


def summary_table(stats_by_service: dict[str, Stats]) -> str:
    return "\n\n".join(f"== {service}\n{stats.summary()}" for service, stats in stats_by_service.items())


def as_dict(stats: Stats) -> dict[str, Any]:
    return {
        "calls": dict(stats.calls),
        "codes": {k: dict(v) for k, v in stats.codes.items()},
        "modes": dict(stats.modes),
        "findings": [str(f) for f in stats.findings],
        "hangs": stats.hangs,
        "interrupted_runs": stats.interrupted_runs,
        "seconds": round(time.monotonic() - stats.started, 1),
    }
