"""Scenario 1b: the client path over TLS against the same path in plaintext.

Two clusters of real processes (a JobManager and ONE TaskManager each, RocksDB) run side by
side: one plaintext, one with TLS on both planes (security.ssl.enabled, certificates made for
the run with trustme: one cluster certificate for the internal plane, a server certificate for
the client plane). The executor client writes and reads the same data set (16-byte keys,
100-byte values, batches of 2000) through both, alternating, so each pair sees the same machine
load; the ratio is TLS keys/s over plaintext keys/s.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from bench.result import BenchContext, Measurement, Ratio, ScenarioResult, Series
from bench.scenarios.client_path import (
    BATCH,
    IN_FLIGHT,
    Sizes,
    _cpu_s,
    best_rate,
    check_values,
    client_get,
    client_put,
    cluster_state,
    dataset,
    pair_ratio,
    spread,
)

logger = logging.getLogger(__name__)

NAME = "client_path_tls"
TITLE = (
    "Client path over TLS with tokens: batched put/get with security.ssl.enabled and security.auth.enabled vs plaintext"
)
TARGET = 0.9


def _certificates(base: Path) -> tuple[dict[str, Any], Any, str]:
    """Daemon config for TLS on both planes and authentication, the client's ChannelSecurity and token."""
    import trustme

    from keyedstate.common.security import ChannelSecurity

    base.mkdir(parents=True, exist_ok=True)
    cluster_ca, rest_ca = trustme.CA(), trustme.CA()
    files: dict[str, str] = {}
    for name, ca in (("internal", cluster_ca), ("rest", rest_ca)):
        leaf = ca.issue_cert("127.0.0.1", "localhost")
        for suffix, blob in (
            ("cert", b"".join(b.bytes() for b in leaf.cert_chain_pems)),
            ("key", leaf.private_key_pem.bytes()),
            ("ca", ca.cert_pem.bytes()),
        ):
            path = base / f"{name}.{suffix}.pem"
            path.write_bytes(blob)
            files[f"security.ssl.{name}.{suffix}"] = str(path)
    from keyedstate.common.auth import hash_token, new_token
    from keyedstate.common.minicluster import free_port

    # Authentication on as well: every call carries a bearer token the servers check (the
    # daemons identify each other by their internal certificates, so they need none).
    token = new_token()
    tokens_file = base / "tokens.yaml"
    tokens_file.write_text(f"tokens:\n- name: bench\n  sha256: {hash_token(token)}\n  role: admin\n  jobs: ['*']\n")
    config = {
        "security.ssl.enabled": "true",
        "jobmanager.internal.port": str(free_port()),
        **files,
        "security.auth.enabled": "true",
        "security.auth.tokens-file": str(tokens_file),
    }
    return config, ChannelSecurity.from_pem(ca=rest_ca.cert_pem.bytes()), token


def run(ctx: BenchContext) -> ScenarioResult:
    sizes = Sizes.for_ctx(ctx)
    n = sizes.keys
    keys, values = dataset(n, ctx.seed)
    tls_config, security, token = _certificates(ctx.workdir / "pki")
    rates: dict[str, list[float]] = {"plain put": [], "tls put": [], "plain get": [], "tls get": []}
    # CPU seconds (client process + the TaskManager process) per phase: unlike wall-clock rates,
    # barely moved by whatever else the machine runs.
    cpu: dict[str, float] = dict.fromkeys(rates, 0.0)

    def timed(label: str, pid: int, fn: Any) -> float:
        c0, s0 = __import__("time").process_time(), _cpu_s(pid)
        rate = best_rate(n, fn, 1)[0]
        cpu[label] += __import__("time").process_time() - c0 + _cpu_s(pid) - s0
        return rate

    # The TLS cluster first: its internal port was picked free just now, before the plaintext
    # cluster's TaskManager takes any port.
    with (
        cluster_state(ctx.workdir / "tls", BATCH, IN_FLIGHT, tls_config, security, token) as (tls, _tc, tls_pid),
        cluster_state(ctx.workdir / "plain") as (plain, _pc, plain_pid),
    ):
        for _ in range(sizes.repeats):
            for label, state, pid in (("plain", plain, plain_pid), ("tls", tls, tls_pid)):
                rates[f"{label} put"].append(
                    timed(f"{label} put", pid, functools.partial(client_put, state, keys, values))
                )
            for label, state, pid in (("plain", plain, plain_pid), ("tls", tls, tls_pid)):
                rates[f"{label} get"].append(
                    timed(
                        f"{label} get",
                        pid,
                        lambda state=state, label=label: check_values(
                            client_get(state, keys), values, f"the {label} client"
                        ),
                    )
                )
    put_ratio = pair_ratio(rates["tls put"], rates["plain put"])
    get_ratio = pair_ratio(rates["tls get"], rates["plain get"])
    measurements = [Measurement(f"client batched {k}", max(v), "keys/s", spread(v)) for k, v in rates.items()]
    ratios = [
        Ratio("TLS put / plaintext put", put_ratio, TARGET, ">=", "median of alternating pairs"),
        Ratio("TLS get / plaintext get", get_ratio, TARGET, ">=", "median of alternating pairs"),
        Ratio(
            "plaintext CPU / TLS CPU, put",
            cpu["plain put"] / cpu["tls put"],
            TARGET,
            ">=",
            "client + TaskManager CPU seconds; load-independent",
        ),
        Ratio(
            "plaintext CPU / TLS CPU, get",
            cpu["plain get"] / cpu["tls get"],
            TARGET,
            ">=",
            "client + TaskManager CPU seconds; load-independent",
        ),
    ]
    series = [
        Series(
            NAME,
            "plaintext",
            [0, 1],
            [max(rates["plain put"]), max(rates["plain get"])],
            "operation (0 = put, 1 = get)",
            "keys/s",
            "bar",
        ),
        Series(
            NAME,
            "TLS (both planes)",
            [0, 1],
            [max(rates["tls put"]), max(rates["tls get"])],
            "operation (0 = put, 1 = get)",
            "keys/s",
            "bar",
        ),
    ]
    params = {
        "keys": n,
        "batch": BATCH,
        "in_flight": IN_FLIGHT,
        "repeats": f"{sizes.repeats} alternating pairs",
        "tls": "security.ssl.enabled (TLS 1.3, ECDSA P-256 certificates from trustme), client plane without client "
        "certificates; security.auth.enabled with a bearer token on every call",
    }
    print(f"   TLS/plaintext put {put_ratio:.3f}, get {get_ratio:.3f}", flush=True)
    total = n * sizes.repeats
    notes = [
        "CPU seconds per 1M keys (client + TaskManager): "
        + ", ".join(f"{k} {v / total * 1e6:.2f}" for k, v in cpu.items())
    ]
    return ScenarioResult(NAME, TITLE, params, measurements, ratios, series, notes)
