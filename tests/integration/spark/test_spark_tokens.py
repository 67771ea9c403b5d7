"""Spark executors authenticate with a token file shipped with the application, never one in user code."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from keyedstate.common.client import StateClient, ValueState
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.errors import AuthenticationError
from keyedstate.common.spark import KeyedStateRuntime
from tests.integration.security._tokens import make_tokens

pytestmark = pytest.mark.spark

from pyspark import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

JOB = "secured-pipeline"
OPS = [OperatorSpec("agg", 2, (StateDescriptor("count", StateKind.VALUE),))]


def count_users(batches: Any, state: Any) -> None:
    users: dict[str, int] = {}
    for batch in batches:
        for user in batch.column("user").to_pylist():
            users[user] = users.get(user, 0) + 1
    if users:
        keys = sorted(users)
        count = state.value("count", value_serializer="int")
        current = count.get_many(keys)
        count.put_many(keys, [(c or 0) + users[k] for k, c in zip(keys, current)])


def test_executors_use_the_token_file_shipped_with_the_application(
    spark: Any, inprocess_cluster: Any, tmp_path: Path
) -> None:
    tokens = make_tokens(
        tmp_path / "auth",
        {
            "driver": ("admin", [JOB]),
            "executors": ("writer", [JOB]),
            "jm": ("jobmanager", ["*"]),
            "tm": ("taskmanager", ["*"]),
            "ops": ("admin", ["*"]),
        },
    )
    auth = {"security.auth.enabled": "true", "security.auth.tokens-file": str(tokens.tokens_file)}
    cluster = inprocess_cluster(
        taskmanagers=1,
        slots=2,
        jm={**auth, "security.auth.token-file": tokens.file("jm")},
        tm={**auth, "security.auth.token-file": tokens.file("tm")},
    )
    runtime = KeyedStateRuntime(
        cluster.address, JOB, OPS, token_file=tokens.file("driver"), executor_token_file=tokens.file("executors")
    )
    try:
        df = spark.createDataFrame([{"user": f"u{i % 7}"} for i in range(70)], "user string")
        runtime.foreach_batch(count_users, key_col="user", operator="agg")(df, 0)
        with StateClient(cluster.address, token=tokens.tokens["ops"]) as ops:
            assert (
                ValueState[str, int](ops, JOB, "agg", "count", value_serializer="int").get_many(
                    [f"u{i}" for i in range(7)]
                )
                == [10] * 7
            )
        # The cluster does require tokens: the executors' writes above went through on the shipped one.
        with StateClient(cluster.address) as anonymous, pytest.raises(AuthenticationError, match="carried no token"):
            anonymous.job_info(JOB)
        assert runtime.committed_epoch() == 0
    finally:
        runtime.close()
