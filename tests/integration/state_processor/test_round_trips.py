"""The State Processor API against a real cluster: what it reads is what was written, and what it
writes is what a job restores.

* A job writes random state of every kind through the client (the checkpoint tests' Workload and its
  Python reference), checkpoints, and the checkpoint read offline equals the reference exactly, for
  both backends, incremental RocksDB checkpoints (files in ``shared/``) and S3 included.
* A savepoint bootstrapped from Arrow tables and pandas frames is restored by a real job, and the
  state the cluster serves equals the tables.
* A transformed savepoint (operator renamed, a state dropped, values mapped and some removed) is
  restored, and the cluster serves exactly the transformed state.
"""

from __future__ import annotations

import io
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest

from keyedstate.cli.inspect import run
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.client import MapState, ReducingState, ValueState
from keyedstate.common.descriptors import OperatorSpec
from keyedstate.common.errors import AlreadyExistsError, InvalidArgumentError
from keyedstate.state_processor import (
    BootstrapOperator,
    BootstrapState,
    DropState,
    MapValues,
    RenameOperator,
    Savepoint,
    StateSerializers,
    bootstrap_savepoint,
    read_arrow,
    read_columns,
    summarize,
    transform_savepoint,
)
from tests.integration.checkpoints.conftest import (
    JOB,
    MAX_P,
    OPERATOR,
    STATES,
    CheckpointCluster,
    Reference,
    Workload,
    assert_state_equals,
    key_names,
    operators,
)

SERIALIZERS = {
    "last": StateSerializers(key="str", value="int"),
    "events": StateSerializers(key="str", value="str"),
    "attrs": StateSerializers(key="str", value="json", user_key="str"),
    "totals": StateSerializers(key="str"),
}


def read_reference(
    sp: Savepoint, operator_id: str = OPERATOR, states: tuple[str, ...] = tuple(SERIALIZERS)
) -> Reference:
    """The Reference a checkpoint holds, read offline through the State Processor API."""
    out = Reference()
    if "last" in states:
        cols = read_columns(sp, operator_id, "last", SERIALIZERS["last"])
        out.last = dict(zip(cols["key"], cols["value"]))
    if "events" in states:
        cols = read_columns(sp, operator_id, "events", SERIALIZERS["events"])
        for k, i, v in zip(cols["key"], cols["index"], cols["value"]):
            assert i == len(out.events.get(k, [])), "list elements come in order"
            out.events.setdefault(k, []).append(v)
    if "attrs" in states:
        cols = read_columns(sp, operator_id, "attrs", SERIALIZERS["attrs"])
        for k, uk, v in zip(cols["key"], cols["user_key"], cols["value"]):
            out.attrs.setdefault(k, {})[uk] = v
    if "totals" in states:
        cols = read_columns(sp, operator_id, "totals", SERIALIZERS["totals"])
        out.totals = {k: (n, p) for k, n, p in zip(cols["key"], cols["count"], cols["peak"])}
    return out


def _checkpoint(client: Any, job_id: str = JOB) -> Any:
    info = client.trigger_checkpoint(job_id, timeout_s=60)
    assert info.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, info.failure_reason
    return info


CASES = [
    pytest.param("file", "rocksdb", True, id="file-rocksdb-incremental"),
    pytest.param("file", "hashmap", False, id="file-hashmap"),
    pytest.param("s3", "rocksdb", True, id="s3-rocksdb-incremental", marks=pytest.mark.s3),
    pytest.param("s3", "hashmap", False, id="s3-hashmap", marks=pytest.mark.s3),
]


@pytest.mark.parametrize("storage,backend,incremental", CASES)
def test_checkpoint_read_offline_equals_the_state_written(
    checkpoint_cluster: Callable[..., CheckpointCluster], storage: str, backend: str, incremental: bool
) -> None:
    cc = checkpoint_cluster(storage, backend)
    client = cc.client()
    config = {
        "execution.checkpointing.incremental": str(incremental).lower(),
        "execution.checkpointing.num-retained": "2",
    }
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P, config=config)
    work = Workload(client, seed=random.randrange(1 << 30))
    keys = key_names(900)
    work.write(keys, "a")
    first = _checkpoint(client)
    work.write(keys[::2] + key_names(150, "b"), "b")  # a second incremental checkpoint reuses shared/ files
    at_checkpoint = work.reference.copy()
    info = _checkpoint(client)
    work.write(keys[:100], "after")  # not in the checkpoint: must not be read
    client.cancel_job(JOB)

    with Savepoint.open(info.path, cc.config) as sp:
        assert [(op.operator_id, op.parallelism) for op in sp.operators] == [(OPERATOR, 2)]
        assert sp.operator(OPERATOR).states == STATES
        if incremental:
            assert any(f.shared for _, _, f in sp.metadata.files()), "the checkpoint reads files from shared/"
        assert_state_equals(read_reference(sp), at_checkpoint)
        # Arrow: typed columns, one row per key; key groups are the client's routing.
        table = read_arrow(sp, OPERATOR, "last", SERIALIZERS["last"])
        assert table.schema.field("key").type == pa.string() and table.schema.field("value").type == pa.int64()
        assert table.num_rows == len(at_checkpoint.last)
        summary = summarize(sp, largest=5)
        by_state: dict[str, int] = {}
        for g in summary.key_groups:
            by_state[g.state] = by_state.get(g.state, 0) + g.keys
        assert by_state == {
            "last": len(at_checkpoint.last),
            "events": len(at_checkpoint.events),
            "attrs": len(at_checkpoint.attrs),
            "totals": len(at_checkpoint.totals),
        }
        assert len(summary.largest_keys) == 5
        assert summary.largest_keys[0].bytes >= summary.largest_keys[-1].bytes
    with Savepoint.open(first.path, cc.config) as sp:
        assert len(read_columns(sp, OPERATOR, "last")["key"]) < len(at_checkpoint.last), "the first checkpoint is older"


def _random_reference(n: int, seed: int) -> Reference:
    rnd = random.Random(seed)
    ref = Reference()
    for k in key_names(n, "boot"):
        if rnd.random() < 0.8:
            ref.last[k] = rnd.randrange(-(1 << 62), 1 << 62)
        if rnd.random() < 0.5:
            ref.events[k] = [f"e{rnd.randrange(10**6)}" for _ in range(rnd.randrange(1, 5))]
        if rnd.random() < 0.4:
            ref.attrs[k] = {
                f"u{j}": {"n": rnd.randrange(100), "s": "x" * rnd.randrange(5)} for j in range(rnd.randrange(1, 4))
            }
        if rnd.random() < 0.6:
            ref.totals[k] = (rnd.randrange(1000), round(rnd.uniform(-5, 5), 6))
    return ref


def _bootstrap_states(ref: Reference) -> tuple[BootstrapState, ...]:
    """The reference as tables: Arrow for two states, pandas for the others (both inputs are accepted)."""
    by_name = {d.name: d for d in STATES}
    events = [(k, v) for k, vs in ref.events.items() for v in vs]
    attrs = [(k, uk, v) for k, m in ref.attrs.items() for uk, v in m.items()]
    # The reducing state's rows are split in two per key: the rows of one key are combined (count sums, peak max).
    totals = [(k, n - n // 2, p) for k, (n, p) in ref.totals.items()] + [
        (k, n // 2, p - 1) for k, (n, p) in ref.totals.items()
    ]
    return (
        BootstrapState(
            by_name["last"], pa.table({"key": list(ref.last), "value": list(ref.last.values())}), SERIALIZERS["last"]
        ),
        BootstrapState(by_name["events"], pd.DataFrame(events, columns=["key", "value"]), SERIALIZERS["events"]),
        BootstrapState(
            by_name["attrs"],
            pa.table({"key": [a[0] for a in attrs], "user_key": [a[1] for a in attrs], "value": [a[2] for a in attrs]}),
            SERIALIZERS["attrs"],
        ),
        BootstrapState(
            by_name["totals"], pd.DataFrame(totals, columns=["key", "count", "peak"]), SERIALIZERS["totals"]
        ),
    )


@pytest.mark.parametrize(
    "storage,backend",
    [("file", "rocksdb"), ("file", "hashmap"), pytest.param("s3", "rocksdb", marks=pytest.mark.s3)],
)
def test_bootstrapped_savepoint_restores_and_reads_back(
    checkpoint_cluster: Callable[..., CheckpointCluster], storage: str, backend: str, tmp_path: Path
) -> None:
    cc = checkpoint_cluster(storage, backend)
    base = cc.checkpoints_dir.rsplit("/", 1)[0] if storage == "s3" else tmp_path.as_uri()
    target = f"{base}/backfill"
    ref = _random_reference(600, seed=7)
    operator = BootstrapOperator(OPERATOR, 3, _bootstrap_states(ref))
    meta = bootstrap_savepoint(target, [operator], max_parallelism=MAX_P, config=cc.config)
    assert meta.savepoint and [op.parallelism for op in meta.operators] == [3]
    with Savepoint.open(target, cc.config) as sp:
        assert_state_equals(read_reference(sp), ref)
    with pytest.raises(AlreadyExistsError, match="already holds a savepoint"):
        bootstrap_savepoint(target, [operator], max_parallelism=MAX_P, config=cc.config)

    client = cc.client()
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P, restore_path=target)  # rescaled 3 -> 2 on restore
    work = Workload(client)
    assert_state_equals(work.read(), ref)
    # The job goes on from the backfill: writes land, and its checkpoint holds both.
    work.reference = ref.copy()
    work.write(key_names(50, "live"), "live")
    info = _checkpoint(client)
    with Savepoint.open(info.path, cc.config) as sp:
        assert_state_equals(read_reference(sp), work.reference)


def test_transformed_savepoint_restores_and_reads_back(
    checkpoint_cluster: Callable[..., CheckpointCluster], tmp_path: Path
) -> None:
    cc = checkpoint_cluster("file", "rocksdb")
    client = cc.client()
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P)
    work = Workload(client, seed=3)
    work.write(key_names(500), "a")
    at_savepoint = work.reference.copy()
    info = client.trigger_checkpoint(JOB, savepoint=True, target_directory=(tmp_path / "sps").as_uri(), timeout_s=60)
    assert info.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, info.failure_reason
    client.cancel_job(JOB)

    def double_or_drop(key: str, value: int) -> int | None:
        return None if key.endswith("5") else value * 2

    target = (tmp_path / "transformed").as_uri()
    with Savepoint.open(info.path) as sp:
        transform_savepoint(
            sp,
            target,
            [
                RenameOperator(OPERATOR, "sessions-v2"),
                DropState(OPERATOR, "events"),
                MapValues(OPERATOR, "last", double_or_drop, SERIALIZERS["last"]),
                MapValues(OPERATOR, "totals", lambda key, v: (v[0] + 1, v[1])),
            ],
        )
        with pytest.raises(InvalidArgumentError, match="has no state 'nope'; it has: 'last', 'events'"):
            transform_savepoint(sp, (tmp_path / "never").as_uri(), [DropState(OPERATOR, "nope")])
    expected = at_savepoint.copy()
    expected.last = {k: v * 2 for k, v in expected.last.items() if not k.endswith("5")}
    expected.events = {}
    expected.totals = {k: (n + 1, p) for k, (n, p) in expected.totals.items()}

    new_states = tuple(d for d in STATES if d.name != "events")
    client.submit_job(JOB, [OperatorSpec("sessions-v2", 3, new_states)], max_parallelism=MAX_P, restore_path=target)
    got = Reference()
    last = ValueState[str, int](client, JOB, "sessions-v2", "last", value_serializer="int")
    last_keys = list(last.keys())
    got.last = {k: v for k, v in zip(last_keys, last.get_many(last_keys)) if v is not None}
    attrs = MapState[str, str, Any](
        client, JOB, "sessions-v2", "attrs", user_key_serializer="str", value_serializer="json"
    )
    got.attrs = {k: dict(attrs.items(k)) for k in list(attrs.keys())}
    totals = ReducingState[str](client, JOB, "sessions-v2", "totals")
    total_keys = list(totals.keys())
    got.totals = {k: (v[0], v[1]) for k, v in zip(total_keys, totals.get_many(total_keys)) if v is not None}
    assert_state_equals(got, expected)
    with Savepoint.open(target) as sp:
        assert sp.metadata.checkpoint_id == info.checkpoint_id
        assert_state_equals(read_reference(sp, "sessions-v2", ("last", "attrs", "totals")), expected)


def test_inspect_a_real_checkpoint_and_its_damaged_files(
    checkpoint_cluster: Callable[..., CheckpointCluster], tmp_path: Path
) -> None:
    cc = checkpoint_cluster("file", "rocksdb")
    client = cc.client()
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P, config={"execution.checkpointing.incremental": "true"})
    work = Workload(client)
    work.write(key_names(300), "a")
    info = _checkpoint(client)
    client.cancel_job(JOB)
    out, err = io.StringIO(), io.StringIO()
    assert run(info.path, out, err, as_json=True) == 0, err.getvalue()
    states = {s["name"]: s["keys"] for s in json.loads(out.getvalue())["operators"][0]["states"]}
    assert states == {
        "last": len(work.reference.last),
        "events": 300,
        "attrs": len(work.reference.attrs),
        "totals": 300,
    }

    with Savepoint.open(info.path) as sp:
        shared = [f for _, _, f in sp.metadata.files() if f.shared and f.path.endswith(".sst")]
    victim = Path((cc.checkpoints_dir + f"/{JOB}/" + shared[0].path.removeprefix("../")).removeprefix("file://"))
    victim.write_bytes(victim.read_bytes()[:-10])  # truncated
    err = io.StringIO()
    assert run(info.path, io.StringIO(), err) == 1
    assert f"checkpoint file {victim.as_uri()} has {shared[0].size - 10} bytes but" in err.getvalue()
    victim.unlink()
    err = io.StringIO()
    assert run(info.path, io.StringIO(), err) == 1
    assert f"checkpoint file {victim.as_uri()} is missing" in err.getvalue() and "Traceback" not in err.getvalue()
