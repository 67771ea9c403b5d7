"""The live REST server against its OpenAPI document (jobmanager/rest/openapi.json).

The document is checked as OpenAPI 3.1 first; then every documented path is requested on a real
cluster (with real ids substituted) and each answer, success or error, is validated against the
schema the document gives for that status. The schemas forbid undocumented fields and require
every documented one, so a response that drifts from the document in either direction fails, as
the last test shows on mutated copies of real answers. The URL map and the document list the
same paths.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from importlib import resources
from typing import Any

import jsonschema
import pytest
from openapi_spec_validator import validate as validate_spec
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from keyedstate.jobmanager.rest.routes import API_PREFIX, rest_paths
from tests.integration.rest.conftest import JOB, RestCluster

DOCUMENT: dict[str, Any] = json.loads(
    (resources.files("keyedstate.jobmanager.rest") / "openapi.json").read_text(encoding="utf-8")
)
_BASE = "urn:keyedstate-openapi"
_REGISTRY: Registry[Any] = Registry().with_resource(
    _BASE, Resource.from_contents(DOCUMENT, default_specification=DRAFT202012)
)


def _validator(schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    # Refs inside the document ("#/components/...") resolve against the document itself.
    return jsonschema.Draft202012Validator({"$ref": f"{_BASE}#{_pointer(schema)}"}, registry=_REGISTRY)


def _pointer(schema: dict[str, Any]) -> str:
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        return ref[1:]
    raise AssertionError(f"response schemas in the document are $refs to components: {schema}")


def response_schema(path: str, status: int) -> dict[str, Any]:
    """The JSON schema the document gives for ``GET path`` answering ``status``."""
    responses = DOCUMENT["paths"][path]["get"]["responses"]
    assert str(status) in responses, f"{path} answered {status}, which the document does not list"
    return responses[str(status)]["content"]["application/json"]["schema"]  # type: ignore[no-any-return]


def check(path: str, status: int, body: Any) -> None:
    schema = response_schema(path, status)
    if "$ref" in schema:
        _validator(schema).validate(body)
    else:
        jsonschema.Draft202012Validator({**schema, "components": DOCUMENT["components"]}, registry=_REGISTRY).validate(
            body
        )


def test_the_document_is_valid_openapi_and_lists_exactly_the_served_paths() -> None:
    validate_spec(DOCUMENT)
    assert DOCUMENT["openapi"].startswith("3.1")
    documented = set(DOCUMENT["paths"])
    assert documented == set(rest_paths()), "routes.py and openapi.json disagree on the paths"
    assert {s["url"] for s in DOCUMENT["servers"]} == {"/", API_PREFIX}


def _concrete(shared_rest_cluster: RestCluster) -> dict[str, str]:
    history = shared_rest_cluster.get(f"/jobs/{JOB}/checkpoints").body["history"]
    return {
        "{jobid}": JOB,
        "{checkpointid}": str(history[0]["id"]),  # the failed savepoint: the FAILED shapes are checked too
        "{vertexid}": "sessions",
        "{taskmanagerid}": "tm-0",
    }


def _fill(path: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        path = path.replace(name, value)
    return path


def test_every_endpoint_answers_as_documented(shared_rest_cluster: RestCluster) -> None:
    values = _concrete(shared_rest_cluster)
    history = shared_rest_cluster.get(f"/jobs/{JOB}/checkpoints").body["history"]
    for path in DOCUMENT["paths"]:
        for checkpoint in {c["id"] for c in history} if "{checkpointid}" in path else {values["{checkpointid}"]}:
            url = _fill(path, {**values, "{checkpointid}": str(checkpoint)})
            answer = shared_rest_cluster.get(url)
            assert answer.status == 200, (url, answer.body)
            check(path, 200, answer.body)


def test_errors_answer_as_documented(shared_rest_cluster: RestCluster) -> None:
    values = _concrete(shared_rest_cluster)
    for path, spec in DOCUMENT["paths"].items():
        if "404" in spec["get"]["responses"]:
            wrong = {name: "no-such-" + name.strip("{}") for name in values}
            wrong["{checkpointid}"] = "424242"
            answer = shared_rest_cluster.get(_fill(path, wrong))
            assert answer.status == 404, path
            check(path, 404, answer.body)
        answer = shared_rest_cluster.get(_fill(path, values), method="POST")
        assert answer.status == 405, path
        check(path, 405, answer.body)


@pytest.mark.parametrize(
    "drift",
    [
        ("an undocumented field", lambda d: d.update({"surprise": 1})),
        ("a documented field missing", lambda d: d.pop("slots-available")),
        ("a field of another type", lambda d: d.update({"taskmanagers": "2"})),
    ],
    ids=lambda d: d[0],
)
def test_a_drifted_answer_fails_the_check(shared_rest_cluster: RestCluster, drift: Any) -> None:
    real = shared_rest_cluster.get("/overview").body
    check("/overview", 200, real)
    drifted = copy.deepcopy(real)
    drift[1](drifted)
    with pytest.raises(jsonschema.ValidationError):
        check("/overview", 200, drifted)


def test_a_drifted_checkpoint_in_the_history_fails_the_check(shared_rest_cluster: RestCluster) -> None:
    real = shared_rest_cluster.get(f"/jobs/{JOB}/checkpoints").body
    mutations: tuple[Callable[[dict[str, Any]], object], ...] = (
        lambda d: d["history"][0].pop("failure_reason"),  # a FAILED checkpoint must say why
        lambda d: d["history"][-1].update({"status": "DONE"}),  # not one of Flink's status strings
        lambda d: d["counts"].pop("in_progress"),
    )
    for mutate in mutations:
        drifted = copy.deepcopy(real)
        mutate(drifted)
        with pytest.raises(jsonschema.ValidationError):
            check("/jobs/{jobid}/checkpoints", 200, drifted)
