"""deploy/k8s, validated offline: the schemas of Kubernetes 1.30 and the newest one kubernetes-validate
knows (strict: no unknown field), then what the schemas cannot say: non-root, read-only root
filesystem, no capabilities, seccomp RuntimeDefault, gRPC health probes, resources on every
container, a PodDisruptionBudget per workload, and every ConfigMap, Secret, port and path a pod
names is there. tests/integration/security/test_deploy_configs.py runs the same configuration."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser

K8S = Path(__file__).resolve().parents[3] / "deploy" / "k8s"
DOCKERFILE = K8S.parent / "docker" / "Dockerfile"
VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
CRDS = {"ServiceMonitor"}  # no schema in kubernetes-validate: checked by hand below


def _documents() -> list[tuple[str, dict[str, Any]]]:
    return [
        (path.name, doc) for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc
    ]


def _kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in _documents() if doc["kind"] == kind]


def _one(kind: str, name: str) -> dict[str, Any]:
    [doc] = [d for d in _kind(kind) if d["metadata"]["name"] == name]
    return doc


WORKLOADS = _kind("Deployment") + _kind("StatefulSet")


def _config_of(container: dict[str, Any]) -> dict[str, Any]:
    command = container["command"]
    data = _one("ConfigMap", "keyedstate-config")["data"]
    conf = dict(yaml.safe_load(data[Path(command[command.index("--config") + 1]).name]))
    conf.update(dict(command[i + 1].split("=", 1) for i, w in enumerate(command) if w == "-D"))
    return conf


def _image_uid() -> int:
    [user] = [i["value"] for i in DockerfileParser(str(DOCKERFILE)).structure if i["instruction"] == "USER"]
    return int(user.split(":")[0])


@pytest.mark.parametrize("version", VERSIONS)
def test_every_resource_validates_strictly(version: str) -> None:
    checked = 0
    for name, doc in _documents():
        if doc["kind"] in CRDS:
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{name} {doc['kind']}/{doc['metadata']['name']}: {exc.message}") from None
        checked += 1
    kinds = {doc["kind"] for _, doc in _documents()}
    assert {"ConfigMap", "Secret", "Service", "Deployment", "StatefulSet", "PodDisruptionBudget"} <= kinds
    assert checked >= 10


def test_validation_would_catch_a_wrong_field() -> None:
    broken = yaml.safe_load(yaml.safe_dump(WORKLOADS[0]))
    broken["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w["metadata"]["name"])
def test_pods_run_unprivileged(workload: dict[str, Any]) -> None:
    pod = workload["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    context = pod["securityContext"]
    assert context["runAsNonRoot"] is True and context["runAsUser"] == context["runAsGroup"] == _image_uid()
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in pod["containers"]:
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsNonRoot"] is True
        assert "privileged" not in sc and "hostNetwork" not in pod and "hostPID" not in pod


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w["metadata"]["name"])
def test_containers_have_resources_and_grpc_health_probes(workload: dict[str, Any]) -> None:
    for container in workload["spec"]["template"]["spec"]["containers"]:
        resources = container["resources"]
        for bound in ("requests", "limits"):
            assert set(resources[bound]) == {"cpu", "memory"}, f"{container['name']}: {bound}"
        assert resources["limits"]["memory"] == resources["requests"]["memory"]  # no overcommit of state memory
        conf = _config_of(container)
        port = conf.get("jobmanager.rpc.port") if container["name"] == "jobmanager" else conf["taskmanager.rpc.port"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = container[probe]["exec"]["command"]
            # grpc.health.v1 over TLS on the daemon's own RPC port (the kubelet's grpc probe has no TLS).
            assert command[:4] == ["statectl", "health", "-m", f"127.0.0.1:{port}"], command
            assert container[probe]["timeoutSeconds"] >= 5
        assert {"name": "rpc", "containerPort": port} in container["ports"]


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w["metadata"]["name"])
def test_everything_a_pod_names_exists(workload: dict[str, Any]) -> None:
    pod = workload["spec"]["template"]["spec"]
    claims = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for volume in volumes.values():
        if "configMap" in volume:
            _one("ConfigMap", volume["configMap"]["name"])
        if "secret" in volume:
            _one("Secret", volume["secret"]["secretName"])
    for container in pod["containers"]:
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert set(mounts.values()) <= set(volumes) | claims
        for source in container.get("envFrom", []):
            secret = _one("Secret", source["secretRef"]["name"])
            assert set(secret["stringData"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
        conf = _config_of(container)
        probe = container["readinessProbe"]["exec"]["command"]
        files = {**conf, **_probe_config(probe)}
        for key, value in files.items():
            if isinstance(value, str) and value.startswith("/etc/keyedstate/"):
                directory, file = value.rsplit("/", 1)
                volume = volumes[mounts[directory]]
                assert file in _one("Secret", volume["secret"]["secretName"])["stringData"], f"{key}: {value}"
        # A read-only root filesystem: every place the daemon writes is a volume.
        written = [v for k, v in conf.items() if k == "state.backend.rocksdb.localdir"] + [
            "/tmp",
            "/var/lib/keyedstate",
        ]
        for path in written:
            assert path in mounts, f"{container['name']} writes {path}, which is read-only"
        if any(
            str(conf.get(k, "")).startswith("s3://") for k in ("state.checkpoints.dir", "high-availability.storageDir")
        ):
            assert container.get("envFrom"), "S3 paths without the S3 credentials"


def _probe_config(command: list[str]) -> dict[str, Any]:
    data = _one("ConfigMap", "keyedstate-config")["data"]
    return dict(yaml.safe_load(data[Path(command[command.index("--config") + 1]).name]))


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w["metadata"]["name"])
def test_each_workload_has_a_disruption_budget_and_a_service(workload: dict[str, Any]) -> None:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    budgets = [
        p for p in _kind("PodDisruptionBudget") if p["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ]
    assert len(budgets) == 1 and budgets[0]["spec"]["maxUnavailable"] == 1
    [service] = [s for s in _kind("Service") if s["spec"]["selector"].items() <= labels.items()]
    container_ports = {p["name"] for c in workload["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= container_ports


def test_the_service_monitor_scrapes_every_metrics_port_over_tls() -> None:
    [monitor] = _kind("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [s for s in _kind("Service") if selector.items() <= s["metadata"]["labels"].items()]
    assert {s["metadata"]["name"] for s in services} == {"keyedstate-jobmanager", "keyedstate-taskmanager"}
    [endpoint] = monitor["spec"]["endpoints"]
    assert re.fullmatch(r"\d+s", endpoint["interval"])
    for service in services:
        [port] = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
        [workload] = [
            w
            for w in WORKLOADS
            if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        for container in workload["spec"]["template"]["spec"]["containers"]:
            conf = _config_of(container)
            assert [p["containerPort"] for p in container["ports"] if p["name"] == port["targetPort"]] == [
                conf["metrics.reporter.prom.port"]
            ]
            # The metrics endpoint speaks TLS with rest.crt when security.ssl.enabled is on.
            assert (endpoint["scheme"] == "https") == bool(conf["security.ssl.enabled"])
    ca = endpoint["tlsConfig"]["ca"]["secret"]
    assert ca["key"] in _one("Secret", ca["name"])["stringData"]
