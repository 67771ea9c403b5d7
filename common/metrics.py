"""Prometheus metrics: how they are named and declared, and the HTTP(S) endpoint serving a daemon's registry.

Naming (docs/metrics.md, generated from the declarations):

- A metric Flink has keeps Flink's name, rendered as Flink's PrometheusReporter renders it: the
  scope and the name joined by ``_`` (``flink_jobmanager_job_uptime``,
  ``flink_taskmanager_job_task_operator_column_family_rocksdb_estimate_num_keys``), Flink's
  variables as labels, and Flink's unit (Flink reports durations in milliseconds).
- A metric only keyedstate has is ``keyedstate_<scope>_<snake_case_name>_<unit>``: the scope is the
  Flink scope its labels belong to (``jobmanager``, ``jobmanager_job``, ``taskmanager``,
  ``taskmanager_job_task_operator``), the unit a base unit suffix (``_seconds``, ``_bytes``) and
  counters end in ``_total``.

With TLS on the rest plane the endpoint serves HTTPS with security.ssl.rest.cert (and requires
a client certificate with security.ssl.rest.authentication-enabled). Each connection is wrapped
with the context current at accept time, so a rotated certificate applies to the next scrape.
"""

from __future__ import annotations

import errno
import logging
import re
import threading
from dataclasses import dataclass
from enum import Enum
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from keyedstate.common.errors import ConfigError
from keyedstate.common.http_server import wsgi_server_class
from keyedstate.common.security.transport import HttpTls

logger = logging.getLogger(__name__)

FLINK_PREFIX = "flink_"
OWN_PREFIX = "keyedstate_"
SCOPES = ("jobmanager_job", "jobmanager", "taskmanager_job_task_operator", "taskmanager")
"""Flink's scopes (longest first); every keyedstate-only name starts with one after its prefix."""
_OWN_NAME = re.compile(r"^keyedstate_[a-z][a-z0-9_]*[a-z0-9]$")
_FLINK_NAME = re.compile(r"^flink_[A-Za-z0-9_]+$")


class MetricKind(Enum):
    """The Prometheus type of a metric."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


class Unit(Enum):
    """What a metric's value counts; keyedstate-only metrics name their unit in a suffix."""

    SECONDS = "seconds"
    BYTES = "bytes"
    MILLISECONDS = "milliseconds"  # only Flink's own names (Flink's unit for durations)
    NANOSECONDS = "nanoseconds"  # only Flink's own names (the changelog storage's upload latencies)
    TIMESTAMP_MS = "milliseconds since the epoch"  # only Flink's own names
    BYTES_PER_SECOND = "bytes per second"
    COUNT = "count"
    BOOLEAN = "0 or 1"
    ID = "id"


_SUFFIX = {Unit.SECONDS: "_seconds", Unit.BYTES: "_bytes", Unit.BYTES_PER_SECOND: "_bytes_per_second"}


@dataclass(frozen=True)
class MetricSpec:
    """One metric's declaration: the single source of its name, type, labels, unit and meaning.

    ``name`` is the family name (a counter is exported with ``_total`` appended, a histogram as
    ``_bucket``, ``_sum`` and ``_count``). Construction checks the naming convention, so a
    metric that breaks it cannot be declared.
    """

    name: str
    kind: MetricKind
    unit: Unit
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        problem = naming_problem(self)
        if problem:
            raise ValueError(f"metric {self.name}: {problem}")

    @property
    def exported(self) -> str:
        """The name a scrape shows (``_total`` on counters)."""
        return self.name + "_total" if self.kind is MetricKind.COUNTER else self.name

    @property
    def flink(self) -> bool:
        """True for a metric Flink has (and keyedstate exports under Flink's name)."""
        return self.name.startswith(FLINK_PREFIX)

    def counter(self, registry: CollectorRegistry) -> Counter:
        """A prometheus_client Counter for this spec in ``registry``."""
        assert self.kind is MetricKind.COUNTER, self.name
        return Counter(self.name, self.help, list(self.labels), registry=registry)

    def gauge(self, registry: CollectorRegistry) -> Gauge:
        """A prometheus_client Gauge for this spec in ``registry``."""
        assert self.kind is MetricKind.GAUGE, self.name
        return Gauge(self.name, self.help, list(self.labels), registry=registry)

    def histogram(self, registry: CollectorRegistry) -> Histogram:
        """A prometheus_client Histogram for this spec in ``registry``."""
        assert self.kind is MetricKind.HISTOGRAM and self.buckets, self.name
        return Histogram(self.name, self.help, list(self.labels), registry=registry, buckets=self.buckets)


def naming_problem(spec: MetricSpec) -> str:
    """What is wrong with ``spec``'s name under the naming convention (module docstring), or ``""``."""
    name = spec.name
    if name.startswith(FLINK_PREFIX):
        if not _FLINK_NAME.match(name):
            return "a Flink name has only letters, digits and _ (as Flink's PrometheusReporter renders it)"
        return ""
    if not _OWN_NAME.match(name):
        return f"a keyedstate-only name is {OWN_PREFIX}<scope>_<snake_case>; Flink's names start with {FLINK_PREFIX}"
    rest = name[len(OWN_PREFIX) :]
    if not any(rest.startswith(scope + "_") for scope in SCOPES):
        return f"a keyedstate-only name starts with a Flink scope after the prefix: one of {', '.join(SCOPES)}"
    if spec.unit in (Unit.MILLISECONDS, Unit.NANOSECONDS, Unit.TIMESTAMP_MS) or re.search(r"_ms(_|$)", name):
        return "keyedstate-only durations are in seconds (_seconds); milliseconds only under Flink's own names"
    suffix = _SUFFIX.get(spec.unit)
    if suffix is not None and not name.endswith(suffix):
        return f"a metric in {spec.unit.value} ends in {suffix}"
    if name.endswith("_total"):
        return "the family name has no _total (a counter gets it on export)"
    return ""


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


class MetricsServer:
    """Serves ``registry`` on the first free port of ``port_range`` (``(-1, -1)`` disables it)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        port_range: tuple[int, int],
        host: str = "0.0.0.0",
        tls: HttpTls | None = None,
    ) -> None:
        self.registry = registry
        self.port: int | None = None
        self.scheme = "https" if tls is not None else "http"
        self._server: Any = None
        self._thread: Any = None
        low, high = port_range
        if low < 0:
            return
        if tls is not None:
            tls.context()  # a certificate the ssl module cannot load fails the start, not the first scrape
        app = make_wsgi_app(registry)
        last: OSError | None = None
        for port in range(low, high + 1):
            try:
                self._server = make_server(
                    host, port, app, wsgi_server_class(host, tls, "metrics"), handler_class=_QuietHandler
                )
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from exc
                last = exc
                continue
            self.port = self._server.server_port
            self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
            self._thread.start()
            logger.info("metrics: serving Prometheus metrics on %s://%s:%d/metrics", self.scheme, host, self.port)
            return
        raise ConfigError(
            f"every port of metrics.reporter.prom.port {low}-{high} is in use; widen the range or use 0"
        ) from last

    def close(self) -> None:
        """Stop serving and free the port; a no-op when already closed."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
