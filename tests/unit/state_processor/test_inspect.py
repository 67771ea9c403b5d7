"""``statectl inspect`` and the offline reader on savepoints bootstrapped in a temp dir (no cluster needed).

Bootstrapped savepoints are real: the same files (HashMap ``.kvs`` snapshots, ``_metadata``) a job
restores; tests/integration/state_processor restores them in a real cluster.
"""

from __future__ import annotations

import base64
import csv
import io
import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest

from keyedstate.cli import statectl
from keyedstate.cli.inspect import run
from keyedstate.common.descriptors import ReduceField, StateDescriptor, StateKind, TtlConfig
from keyedstate.common.errors import AlreadyExistsError, InvalidArgumentError
from keyedstate.common.keygroups import key_group
from keyedstate.state_processor import (
    BootstrapOperator,
    BootstrapState,
    DropOperator,
    MapValues,
    RenameOperator,
    Savepoint,
    StateSerializers,
    bootstrap_savepoint,
    read_arrow,
    read_pandas,
    summarize,
    transform_savepoint,
)

MAX_P = 16
COUNTS = StateDescriptor("total", StateKind.VALUE)
SEEN = StateDescriptor("seen", StateKind.LIST)


class FixedClock:
    def __init__(self, now_ms: int) -> None:
        self.now = now_ms

    def now_ms(self) -> int:
        return self.now

    def monotonic_ms(self) -> int:
        return self.now

    def boottime_ms(self) -> int:
        return self.now


def _savepoint(tmp_path: Path, name: str = "sp") -> str:
    keys = [f"k{i:03d}" for i in range(40)]
    target = (tmp_path / name).as_uri()
    bootstrap_savepoint(
        target,
        [
            BootstrapOperator(
                "counts",
                2,
                (
                    BootstrapState(
                        COUNTS, pa.table({"key": keys, "value": list(range(40))}), StateSerializers("str", "int")
                    ),
                    BootstrapState(
                        SEEN,
                        pd.DataFrame({"key": ["k000"] * 30 + ["k001"], "value": [f"v{i}" for i in range(31)]}),
                        StateSerializers("str", "str"),
                    ),
                ),
            )
        ],
        max_parallelism=MAX_P,
    )
    return target


def test_summary_counts_keys_bytes_and_largest_keys(tmp_path: Path) -> None:
    target = _savepoint(tmp_path)
    out, err = io.StringIO(), io.StringIO()
    assert run(target, out, err, as_json=True, largest=2) == 0, err.getvalue()
    doc = json.loads(out.getvalue())
    assert (doc["savepoint"], doc["max_parallelism"], doc["epoch"]) == (True, MAX_P, -1)
    (op,) = doc["operators"]
    assert [s["key_groups"] for s in op["subtasks"]] == [[0, 7], [8, 15]]
    states = {s["name"]: s for s in op["states"]}
    assert (states["total"]["keys"], states["total"]["entries"]) == (40, 40)
    assert (states["seen"]["keys"], states["seen"]["entries"]) == (2, 31)
    assert sum(g["keys"] for g in doc["key_groups"]) == 42
    expected_groups = {key_group(f"k{i:03d}".encode(), MAX_P) for i in range(40)}
    assert {g["key_group"] for g in doc["key_groups"]} == expected_groups
    assert len(doc["largest_keys"]) == 2 and doc["largest_keys"][0]["key"] == "k000"
    assert doc["largest_keys"][0]["entries"] == 30 and doc["largest_keys"][0]["state"] == "seen"

    out = io.StringIO()
    assert run(target, out, err) == 0
    text = out.getvalue()
    assert text.startswith(f"savepoint 1 of job bootstrap at {target}")
    assert "largest keys:" in text and "KEY GROUP" in text


def test_dumps_as_json_lines_and_csv(tmp_path: Path) -> None:
    target = _savepoint(tmp_path)
    out, err = io.StringIO(), io.StringIO()
    serializers = StateSerializers("str", "int")
    assert run(target, out, err, dump="jsonl", operator="counts", state="total", serializers=serializers) == 0
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert sorted((r["key"], r["value"]) for r in rows) == [(f"k{i:03d}", i) for i in range(40)]
    assert all(r["namespace"] == "" and r["key_group"] == key_group(r["key"].encode(), MAX_P) for r in rows)

    out = io.StringIO()
    assert run(target, out, err, dump="csv", operator="counts", state="seen") == 0  # bytes: base64
    table = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert list(table[0]) == ["key_group", "key", "namespace", "index", "value"]
    k000 = [r for r in table if base64.b64decode(r["key"]) == b"k000"]
    assert [base64.b64decode(r["value"]).decode() for r in k000] == [f"v{i}" for i in range(30)]
    assert [int(r["index"]) for r in k000] == list(range(30))


@pytest.mark.parametrize(
    "kwargs,code,fragment",
    [
        (
            {"dump": "jsonl", "operator": "nope", "state": "total"},
            2,
            "has no operator 'nope'; its operators are: 'counts'",
        ),
        ({"dump": "jsonl", "operator": "counts", "state": "nope"}, 2, "has no state 'nope'; it has: 'total', 'seen'"),
        ({"dump": "jsonl", "operator": "counts"}, 2, "--dump needs --operator and --state"),
        ({"dump": "xml", "operator": "counts", "state": "total"}, 2, "--dump 'xml': use one of jsonl, csv"),
        (
            {"dump": "jsonl", "operator": "counts", "state": "total", "serializers": StateSerializers("int")},
            2,
            "do not decode with the int serializer",
        ),
    ],
)
def test_bad_arguments_exit_2_naming_the_fix(
    tmp_path: Path, kwargs: dict[str, object], code: int, fragment: str
) -> None:
    target = _savepoint(tmp_path)
    out, err = io.StringIO(), io.StringIO()
    assert run(target, out, err, **kwargs) == code  # type: ignore[arg-type]  # the parametrized keyword arguments
    assert fragment in err.getvalue() and "Traceback" not in err.getvalue()


def test_missing_path_and_damaged_files_exit_1_naming_the_file(tmp_path: Path) -> None:
    err = io.StringIO()
    assert run((tmp_path / "nothing").as_uri(), io.StringIO(), err) == 1
    assert "nothing exists there" in err.getvalue()

    target = _savepoint(tmp_path)
    kvs = sorted((tmp_path / "sp").rglob("state-total.kvs"))[0]
    data = bytearray(kvs.read_bytes())
    data[10] ^= 0xFF  # same size, other bytes: only the sha256 sees it
    kvs.write_bytes(bytes(data))
    err = io.StringIO()
    assert run(target, io.StringIO(), err) == 1
    assert f"checkpoint file {kvs.as_uri()} is damaged" in err.getvalue()
    kvs.unlink()
    err = io.StringIO()
    assert run(target, io.StringIO(), err) == 1
    assert f"checkpoint file {kvs.as_uri()} is missing" in err.getvalue()

    (tmp_path / "sp" / "_metadata").write_text('{"format": "keyedstate-checkpoint", "version": 1}')
    err = io.StringIO()
    assert run(target, io.StringIO(), err) == 1
    assert f"{target}/_metadata is unusable: missing field 'job_id'" in err.getvalue()


def test_statectl_inspect_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = _savepoint(tmp_path)
    assert statectl.main(["inspect", target, "--json", "--quiet"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["checkpoint_id"] == 1 and out.err == ""
    dump = ["--dump", "jsonl", "--operator", "counts", "--state", "total"]
    assert statectl.main(["inspect", target, *dump, "--key-serializer", "str", "--value-serializer", "int"]) == 0
    out = capsys.readouterr()
    assert len(out.out.splitlines()) == 40 and "reading counts/total" in out.err
    assert statectl.main(["inspect", target, "-D", "nokey"]) == 2
    assert "expected key=value" in capsys.readouterr().err
    assert statectl.main(["inspect", (tmp_path / "gone").as_uri()]) == 1
    assert "nothing exists there" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        statectl.main(["inspect", target, "--largest", "-1"])
    assert exited.value.code == 2 and "negative" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        statectl.main(["inspect", "--help"])
    assert exited.value.code == 0 and "{jsonl,csv}" in capsys.readouterr().out


def test_reader_ttl_pandas_and_reducing(tmp_path: Path) -> None:
    ttl = StateDescriptor("recent", StateKind.VALUE, TtlConfig(1000))
    sums = StateDescriptor("sums", StateKind.REDUCING, reduce_fields=(ReduceField("n"),))
    target = (tmp_path / "ttl").as_uri()
    clock = FixedClock(10_000)
    bootstrap_savepoint(
        target,
        [
            BootstrapOperator(
                "op",
                1,
                (
                    BootstrapState(
                        ttl,
                        pa.table({"key": [b"old", b"new"], "value": [b"1", b"2"], "timestamp_ms": [8_000, 9_500]}),
                    ),
                    BootstrapState(sums, pa.table({"key": [b"a", b"a", b"b"], "n": [1, 2, 5]})),
                ),
            )
        ],
        max_parallelism=MAX_P,
        clock=clock,
    )
    with Savepoint.open(target) as sp:
        live = read_pandas(sp, "op", "recent", clock=clock)
        assert live["key"].tolist() == [b"new"] and live["timestamp_ms"].tolist() == [9_500]
        everything = read_arrow(sp, "op", "recent", include_expired=True)
        assert sorted(everything.column("key").to_pylist()) == [b"new", b"old"]
        reduced = read_arrow(sp, "op", "sums")
        assert dict(zip(reduced.column("key").to_pylist(), reduced.column("n").to_pylist())) == {b"a": 3, b"b": 5}
        assert summarize(sp, largest=0).largest_keys == ()


def test_bootstrap_refuses_bad_tables(tmp_path: Path) -> None:
    target = (tmp_path / "bad").as_uri()

    def write(state: BootstrapState) -> None:
        bootstrap_savepoint(target, [BootstrapOperator("op", 1, (state,))], max_parallelism=MAX_P)

    with pytest.raises(InvalidArgumentError, match=r"value state needs the column\(s\) \['value'\]"):
        write(BootstrapState(COUNTS, pa.table({"key": [b"a"]})))
    with pytest.raises(InvalidArgumentError, match="key b'a' appears twice"):
        write(BootstrapState(COUNTS, pa.table({"key": [b"a", b"a"], "value": [b"1", b"2"]})))
    with pytest.raises(InvalidArgumentError, match="does not encode with the int serializer"):
        write(BootstrapState(COUNTS, pa.table({"key": [b"a"], "value": ["x"]}), StateSerializers(value="int")))
    with pytest.raises(InvalidArgumentError, match="must be a pyarrow Table, a pandas DataFrame or a PySpark"):
        write(BootstrapState(COUNTS, [("a", 1)]))
    assert not (tmp_path / "bad").exists(), "nothing is written when the tables are refused"
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "stray").write_text("x")
    with pytest.raises(AlreadyExistsError, match="is not empty"):
        write(BootstrapState(COUNTS, pa.table({"key": [b"a"], "value": [b"1"]})))


def test_transform_refusals_leave_no_savepoint(tmp_path: Path) -> None:
    source = _savepoint(tmp_path)
    target = tmp_path / "out"
    with Savepoint.open(source) as sp:
        with pytest.raises(InvalidArgumentError, match="has no operator 'ghost'"):
            transform_savepoint(sp, target.as_uri(), [RenameOperator("ghost", "x")])
        with pytest.raises(InvalidArgumentError, match="operator id"):
            transform_savepoint(sp, target.as_uri(), [RenameOperator("counts", "a/b")])
        with pytest.raises(InvalidArgumentError, match="the function returned 'ten', which does not encode"):
            transform_savepoint(
                sp, target.as_uri(), [MapValues("counts", "total", lambda k, v: "ten", StateSerializers("str", "int"))]
            )
        assert not target.exists(), "a failed transform removes what it uploaded: no half savepoint"
        transform_savepoint(sp, target.as_uri(), [DropOperator("counts")])
    with Savepoint.open(target.as_uri()) as out:
        assert out.operators == () and out.metadata.savepoint


def test_a_savepoint_that_would_not_restore_is_not_left_behind(tmp_path: Path) -> None:
    from keyedstate.common.descriptors import OperatorSpec
    from keyedstate.common.ids import KeyGroupRange
    from keyedstate.common.storage import open_storage
    from keyedstate.state_processor.writer import OperatorContent, SavepointHeader, SubtaskContent, write_savepoint

    target = (tmp_path / "wrong").as_uri()
    wrong = OperatorContent(OperatorSpec("op", 1, (COUNTS,)), (SubtaskContent(0, KeyGroupRange(0, 3), {}),))
    with pytest.raises(InvalidArgumentError, match=r"would not restore: .*key groups 0-3|would not restore"):
        write_savepoint(open_storage(target), target, SavepointHeader("job", MAX_P), [wrong])
    assert not (tmp_path / "wrong").exists(), "files uploaded before the refusal are removed"
