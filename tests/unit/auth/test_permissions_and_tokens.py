"""The permission table covers every RPC; tokens files parse, reload and keep only hashes; secrets are redacted."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
from grpc_health.v1 import health_pb2

from keyedstate.common._proto.v1 import jobmanager_pb2, taskmanager_pb2
from keyedstate.common.auth import (
    RULES,
    Permission,
    Role,
    TokenStore,
    hash_token,
    read_token_file,
    resolve_token,
    roles_granting,
)
from keyedstate.common.config import REDACTED, Configuration, is_secret_key, secret_overrides
from keyedstate.common.config import options as o
from keyedstate.common.errors import ConfigError, InvalidArgumentError
from keyedstate.common.ids import validate_name

SERVED = [jobmanager_pb2, taskmanager_pb2, health_pb2]


def _served_methods() -> set[str]:
    return {
        f"/{service.full_name}/{method.name}"
        for module in SERVED
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }


def test_every_served_method_has_a_rule_and_no_rule_is_stale() -> None:
    served = _served_methods()
    assert len(served) >= 37
    assert sorted(served - set(RULES)) == [], "add the new RPC to common/auth/_methods.py"
    assert sorted(set(RULES) - served) == [], "a rule names an RPC that no longer exists"


def test_every_rule_that_takes_a_job_finds_it_in_the_request() -> None:
    """A rule's job extractor must work on the real request type (a renamed field would break scope checks)."""
    from google.protobuf import symbol_database

    db = symbol_database.Default()
    for module in SERVED[:2]:
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                rule = RULES[f"/{service.full_name}/{method.name}"]
                request = db.GetSymbol(method.input_type.full_name)()
                if rule.job is not None:
                    assert rule.job(request) == "", method.full_name
                assert isinstance(rule.permission_for(request), Permission)


def test_internal_calls_need_internal_roles_and_client_roles_nest() -> None:
    assert [r.value for r in roles_granting(Permission.TASKMANAGER_REGISTER)] == ["taskmanager", "internal"]
    assert [r.value for r in roles_granting(Permission.SLOT_CONTROL)] == ["jobmanager", "internal"]
    assert [r.value for r in roles_granting(Permission.STATE_WRITE)] == ["writer", "admin"]
    assert [r.value for r in roles_granting(Permission.JOB_CANCEL)] == ["admin"]
    assert [r.value for r in roles_granting(Permission.STATE_READ)] == ["reader", "writer", "admin"]


def _write_tokens(path: Path, *entries: tuple[str, str, str, list[str]]) -> None:
    lines = ["tokens:"]
    for name, token, role, jobs in entries:
        lines += [f"  - name: {name}", f"    sha256: {hash_token(token)}", f"    role: {role}", f"    jobs: {jobs!r}"]
    path.write_text("\n".join(lines) + "\n")


def test_token_store_looks_up_by_hash_and_reloads_when_the_file_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tokens.yaml"
    _write_tokens(path, ("ops", "tok-ops", "admin", ["*"]), ("pipe", "tok-pipe", "writer", ["a", "b"]))
    store = TokenStore(path)
    assert "tok-ops" not in path.read_text() and "tok-pipe" not in path.read_text()
    ops = store.lookup("tok-ops")
    assert ops is not None and ops.role is Role.ADMIN and ops.jobs is None
    pipe = store.lookup("tok-pipe")
    assert pipe is not None and pipe.jobs == frozenset({"a", "b"}) and pipe.covers("a") and not pipe.covers("c")
    assert store.lookup("tok-unknown") is None

    _write_tokens(path, ("ops", "tok-ops", "admin", ["*"]), ("new", "tok-new", "reader", ["a"]))
    assert store.lookup("tok-new") is not None and store.lookup("tok-pipe") is None  # added and revoked
    assert store.reloads == 1

    with caplog.at_level(logging.ERROR, logger="keyedstate.common.auth._tokens"):
        path.write_text("tokens:\n  - name: broken\n    sha256: nothex\n    role: admin\n    jobs: ['*']\n")
        assert store.lookup("tok-new") is not None  # a broken file keeps the tokens in force
    assert "sha256 must be 64 hex digits" in caplog.text and "keeping the 2 token(s)" in caplog.text


@pytest.mark.parametrize(
    "entry,message",
    [
        ({"name": "x", "sha256": "ab", "role": "admin", "jobs": ["*"]}, "sha256 must be 64 hex digits"),
        (
            {"name": "x", "sha256": "a" * 64, "role": "root", "jobs": ["*"]},
            "role 'root' is not one of reader, writer, admin",
        ),
        ({"name": "x", "sha256": "a" * 64, "role": "admin"}, "jobs must list the job ids"),
        ({"name": "x", "sha256": "a" * 64, "role": "admin", "jobs": ["../etc"]}, "invalid job id '../etc'"),
        ({"name": "x", "token": "plain", "sha256": "a" * 64, "role": "admin", "jobs": ["*"]}, "never the token"),
        ({"name": "a/b", "sha256": "a" * 64, "role": "admin", "jobs": ["*"]}, "invalid token name 'a/b'"),
    ],
)
def test_bad_tokens_files_name_the_entry_and_the_rule(tmp_path: Path, entry: dict[str, Any], message: str) -> None:
    import yaml

    path = tmp_path / "tokens.yaml"
    path.write_text(yaml.safe_dump({"tokens": [entry]}))
    with pytest.raises(ConfigError, match="entry 1") as info:
        TokenStore(path)
    assert message in info.value.message


def test_missing_tokens_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        TokenStore(tmp_path / "absent.yaml")


def test_client_token_comes_from_a_file_or_the_environment(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "my.token"
    path.write_text("s3cr3t-token\n")
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING):
        assert read_token_file(path) == "s3cr3t-token"
    assert "chmod 600" in caplog.text and "s3cr3t-token" not in caplog.text
    assert resolve_token(None, {"KEYEDSTATE_TOKEN_FILE": str(path)}) == "s3cr3t-token"
    assert resolve_token(None, {"KEYEDSTATE_TOKEN": " env-token "}) == "env-token"
    assert resolve_token(str(path), {"KEYEDSTATE_TOKEN": "env-token"}) == "s3cr3t-token"  # the file wins
    assert resolve_token(None, {}) is None
    path.write_text("two words\n")
    with pytest.raises(ConfigError, match="only the token"):
        read_token_file(path)


def test_secret_keys_are_recognised_and_redacted() -> None:
    assert o.S3_SECRET_KEY.secret and o.S3_ACCESS_KEY.secret
    for key in ("s3.secret-key", "s3.access-key", "fs.s3a.secret.key", "security.auth.token", "db.password"):
        assert is_secret_key(key, {"s3.secret-key", "s3.access-key"}), key
    for key in ("security.auth.token-file", "security.auth.tokens-file", "s3.endpoint", "jobmanager.rpc.port"):
        assert not is_secret_key(key), key
    conf = Configuration({"s3.secret-key": "SK-VALUE", "s3.endpoint": "http://x"})
    assert "SK-VALUE" not in repr(conf) and conf.redacted()["s3.secret-key"] == REDACTED
    assert secret_overrides(["s3.secret-key=SK", "rest.port=1", "security.auth.token=t"]) == [
        "s3.secret-key",
        "security.auth.token",
    ]


@pytest.mark.parametrize(
    "value,problem",
    [
        ("a/b", "path separator"),
        ("a\\b", "path separator"),
        ("..", "'..'"),
        ("a..b", "'..'"),
        ("a\nb", "control character"),
        ("x" * 129, "129 characters long (at most 128)"),
        ("", "empty"),
        ("-x", "must start with a letter or digit"),
        ("a b", "contains ' '"),
    ],
)
def test_one_name_validator_names_the_broken_rule(value: str, problem: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        validate_name("job id", value)
    assert problem in info.value.message and "[A-Za-z0-9_.-]" in info.value.message
    assert validate_name("job id", "job-1.v2_x") == "job-1.v2_x"
