"""The secured deployment files in deploy/ start a working cluster.

Each file's keys are read as the daemons would read them (the systemd YAML configs, the
Kubernetes manifests' ``-D`` arguments). Only what belongs to the host is moved: paths under
/etc/keyedstate and /var/lib/keyedstate go to a temporary directory holding certificates and a
tokens file made for the test, addresses to loopback, fixed ports to free ones. Everything about
security (TLS on both planes, authentication, the cluster id, protected mode) is as shipped.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.client import ChannelSecurity, ClientSettings, StateClient, ValueState
from keyedstate.common.config import Configuration
from keyedstate.common.errors import AuthenticationError, PermissionDeniedError
from tests.fixtures.tls import Pki
from tests.integration.security._tokens import make_tokens
from tests.integration.serving._support import OPERATOR, free_port, operators, run_module

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
JOB = "deployed"
SETTINGS = ClientSettings(timeout_s=10.0, max_attempts=2, backoff_s=0.1)
# Placed by the test harness, not by the files: where the daemons listen and find each other.
HOST_KEYS = {
    "jobmanager.rpc.address",
    "jobmanager.rpc.port",
    "jobmanager.bind-host",
    "jobmanager.internal.port",
    "taskmanager.host",
    "taskmanager.bind-host",
    "taskmanager.rpc.port",
    "taskmanager.internal.port",
    "taskmanager.resource-id",
    "metrics.reporter.prom.port",
    "rest.port",
}


def _yaml_config(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((DEPLOY / "conf" / name).read_text()))


def _k8s_container(name: str, container: str) -> dict[str, Any]:
    for doc in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()):
        if doc and doc.get("kind") in ("Deployment", "StatefulSet"):
            (spec,) = [c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == container]
            return dict(spec)
    raise AssertionError(f"no workload in {name}")


def _configmap_file(mounted: str) -> dict[str, Any]:
    """A file of the ConfigMap keyedstate-config, by the path the pods mount it at (/etc/keyedstate/conf/...)."""
    [configmap] = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "config.yaml").read_text()) if d]
    assert mounted.startswith("/etc/keyedstate/conf/"), mounted
    return dict(yaml.safe_load(configmap["data"][mounted.removeprefix("/etc/keyedstate/conf/")]))


def _k8s_config(name: str, container: str) -> dict[str, Any]:
    """The container's configuration: its --config file from the ConfigMap, then its -D overrides."""
    words = _k8s_container(name, container)["command"]
    conf = _configmap_file(words[words.index("--config") + 1])
    conf.update(dict(words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "-D"))
    return conf


def _probe(name: str, container: str) -> list[str]:
    """The readiness probe's command; the liveness and startup probes run the same one."""
    spec = _k8s_container(name, container)
    command: list[str] = spec["readinessProbe"]["exec"]["command"]
    assert spec["livenessProbe"]["exec"]["command"] == command == spec["startupProbe"]["exec"]["command"]
    return command


def _localize(conf: dict[str, Any], files: dict[str, Path], tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in conf.items():
        if key in HOST_KEYS:
            continue
        if isinstance(value, str):
            if value.startswith("/etc/keyedstate/"):
                name = value.removeprefix("/etc/keyedstate/")
                assert name in files, f"{key}: {value} names a file the security docs do not describe"
                value = str(files[name])
            value = value.replace("file:///var/lib/keyedstate", (tmp / "var").as_uri())
            value = value.replace("/var/lib/keyedstate", str(tmp / "var"))
            value = re.sub(r"^s3://keyedstate", (tmp / "s3").as_uri(), value)
        out[key] = value
    return out


@pytest.mark.parametrize("source", ["systemd", "k8s"])
def test_the_shipped_deployment_runs_secured(inprocess_cluster: Any, tmp_path: Path, source: str) -> None:
    if source == "systemd":
        jm_raw, tm_raw = _yaml_config("jobmanager.yaml"), _yaml_config("taskmanager.yaml")
    else:
        jm_raw, tm_raw = _k8s_config("jobmanager.yaml", "jobmanager"), _k8s_config("taskmanager.yaml", "taskmanager")
    pki = Pki(tmp_path / "pki")
    # rest.crt names the JobManager's Service, as deploy/k8s/secrets.yaml asks (the probes check that name).
    internal = pki.leaf(pki.cluster_ca, "internal")
    rest = pki.leaf(pki.rest_ca, "rest", "keyedstate-jobmanager", "127.0.0.1", "localhost")
    tokens = make_tokens(tmp_path / "auth", {"ops": ("admin", ["*"]), "pipeline": ("writer", [JOB])})
    files = {
        "tls/internal.crt": internal.cert,
        "tls/internal.key": internal.key,
        "tls/internal-ca.crt": pki.cluster_ca_file,
        "tls/rest.crt": rest.cert,
        "tls/rest.key": rest.key,
        "tls/rest-ca.crt": pki.rest_ca_file,
        "auth/tokens.yaml": tokens.tokens_file,
    }
    jm_conf, tm_conf = _localize(jm_raw, files, tmp_path), _localize(tm_raw, files, tmp_path)
    # What the files promise, before anything runs.
    for conf in (jm_conf, tm_conf):
        loaded = Configuration(conf)
        loaded.validate()
        assert str(conf.get("security.ssl.enabled")).lower() == "true"
        assert str(conf.get("security.auth.enabled")).lower() == "true"
    assert jm_conf["high-availability.cluster-id"] == tm_conf["high-availability.cluster-id"]

    cluster = inprocess_cluster(taskmanagers=0, slots=4, jm={**jm_conf, "jobmanager.internal.port": 0})
    cluster.add_taskmanager(**tm_conf)  # no token of its own: the internal certificate is its identity
    trust = ChannelSecurity.from_pem(ca=pki.rest_ca_file.read_bytes())
    with StateClient(cluster.address, SETTINGS, trust, token=tokens.tokens["ops"]) as admin:
        admin.wait_for_taskmanagers(1, slots=4, timeout_s=20)
        admin.submit_job(JOB, operators(2))
        with StateClient(cluster.address, SETTINGS, trust, token=tokens.tokens["pipeline"]) as writer:
            state = ValueState[str, int](writer, JOB, OPERATOR, "last")
            state.put_many(["a", "b"], [1, 2])
            assert state.get_many(["a", "b"]) == [1, 2]
            with pytest.raises(PermissionDeniedError):
                writer.cancel_job(JOB)
        checkpoint = admin.trigger_checkpoint(JOB, timeout_s=60)
        assert checkpoint.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, checkpoint.failure_reason
    with StateClient(cluster.address, SETTINGS, trust) as anonymous, pytest.raises(AuthenticationError):
        anonymous.job_info(JOB)
    if source == "k8s":
        _the_probes_pass_on_the_secured_ports(cluster, files, tmp_path)


def _the_probes_pass_on_the_secured_ports(cluster: Any, files: dict[str, Path], tmp: Path) -> None:
    """Each pod's probe command, run as the kubelet would: TLS, no token, exit 0 only while the port serves."""
    for name, container in (("jobmanager.yaml", "jobmanager"), ("taskmanager.yaml", "taskmanager")):
        command = _probe(name, container)
        assert command[:2] == ["statectl", "health"]
        config = tmp / f"probe-{container}.yaml"
        config.write_text(
            yaml.safe_dump(_localize(_configmap_file(command[command.index("--config") + 1]), files, tmp))
        )
        daemon = cluster.address if container == "jobmanager" else cluster.taskmanagers[0].address
        args = ["health", "-m", daemon, "--config", str(config)]
        result = run_module("keyedstate.cli.statectl", *args)
        assert result.returncode == 0 and result.stdout.strip() == f"{daemon}: SERVING", result.stderr
        # The same probe fails when the certificate it trusts is not the port's.
        untrusted = tmp / "untrusted.yaml"
        untrusted.write_text(
            yaml.safe_dump(
                {**yaml.safe_load(config.read_text()), "security.ssl.rest.ca": str(files["tls/internal-ca.crt"])}
            )
        )
        assert run_module("keyedstate.cli.statectl", "health", "-m", daemon, "--config", str(untrusted)).returncode == 1
    result = run_module("keyedstate.cli.statectl", "health", "-m", f"127.0.0.1:{free_port()}", "--timeout", "2")
    assert result.returncode == 1 and "Traceback" not in result.stderr
