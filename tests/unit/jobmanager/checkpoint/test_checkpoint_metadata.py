"""The _metadata format: round trip, the documented snippet, and clear errors for every kind of damage."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
from typing import Any

import pytest

from keyedstate.common.descriptors import (
    NumberType,
    ReduceField,
    ReduceFunction,
    StateDescriptor,
    StateKind,
    TtlConfig,
    TtlUpdateType,
)
from keyedstate.common.errors import CorruptCheckpointError
from keyedstate.common.ids import KeyGroupRange, OperatorId
from keyedstate.jobmanager.checkpoint import metadata as metadata_module
from keyedstate.jobmanager.checkpoint.metadata import (
    CheckpointMetadata,
    FileRef,
    OperatorSnapshot,
    SubtaskSnapshot,
)

SHA = "ab" * 32


def sample(savepoint: bool = False) -> CheckpointMetadata:
    shared_path = "counts-0/000010.sst" if savepoint else "../shared/8e1f-000010.sst"
    return CheckpointMetadata(
        job_id="orders",
        checkpoint_id=42,
        savepoint=savepoint,
        timestamp_ms=1_718_000_000_000,
        epoch=17,
        max_parallelism=8,
        operators=(
            OperatorSnapshot(
                "counts",
                2,
                (
                    StateDescriptor("total", StateKind.VALUE, TtlConfig(60_000, TtlUpdateType.ON_READ_AND_WRITE)),
                    StateDescriptor(
                        "sums",
                        StateKind.REDUCING,
                        None,
                        (
                            ReduceField("n", ReduceFunction.SUM),
                            ReduceField("max", ReduceFunction.MAX, NumberType.FLOAT64),
                        ),
                    ),
                ),
                (
                    SubtaskSnapshot(
                        0,
                        KeyGroupRange(0, 3),
                        "rocksdb",
                        17,
                        300,
                        100,
                        (
                            FileRef(shared_path, 200, SHA, "000010.sst", not savepoint),
                            FileRef("counts-0/MANIFEST-000011", 100, SHA, "MANIFEST-000011", False),
                        ),
                    ),
                    SubtaskSnapshot(
                        1,
                        KeyGroupRange(4, 7),
                        "hashmap",
                        17,
                        50,
                        50,
                        (FileRef("counts-1/state.bin", 50, "", "state.bin", False),),
                    ),
                ),
            ),
            OperatorSnapshot(
                "empty",
                1,
                (StateDescriptor("m", StateKind.MAP),),
                (SubtaskSnapshot(0, KeyGroupRange(0, 7), "rocksdb", 17, 0, 0, ()),),
            ),
        ),
    )


def test_round_trip_keeps_everything() -> None:
    meta = sample()
    assert meta.problems() == []
    text = meta.to_json()
    again = CheckpointMetadata.from_json(text.encode("utf-8"))
    assert again == meta
    assert again.full_size == 350 and again.incremental_size == 150
    assert next((op, idx, f.path) for op, idx, f in again.files()) == ("counts", 0, "../shared/8e1f-000010.sst")
    raw = json.loads(text)
    assert list(raw)[:3] == ["format", "version", "job_id"]
    assert raw["operators"][0]["states"][0] == {
        "name": "total",
        "kind": "value",
        "ttl": {"ttl_ms": 60_000, "update_type": "OnReadAndWrite"},
        "reduce_fields": [],
    }
    assert raw["operators"][0]["subtasks"][0]["key_groups"] == [0, 3]


def test_the_part_at_a_time_json_is_the_json_of_the_whole() -> None:
    """to_json encodes one subtask at a time; the file is still exactly the compact JSON of to_dict."""
    for meta in (
        sample(),
        sample(savepoint=True),
        dataclasses.replace(sample(), operators=()),
        dataclasses.replace(sample(), operators=(OperatorSnapshot("none", 1, (), ()),)),
    ):
        whole = json.dumps(meta.to_dict(), separators=(",", ":"), ensure_ascii=False) + "\n"
        assert meta.to_json() == whole
        assert json.loads(meta.to_json()) == json.loads(json.dumps(meta.to_dict()))
    unicode = dataclasses.replace(sample(), job_id="jöb-ü")
    assert '"job_id":"jöb-ü"' in unicode.to_json()


def test_handles_round_trip_to_absolute_paths() -> None:
    sub = sample().operators[0].subtasks[0]
    handle = sub.to_handle(OperatorId("counts"), "s3://bucket/ckpt/orders/chk-42")
    assert [f.path for f in handle.files] == [
        "s3://bucket/ckpt/orders/shared/8e1f-000010.sst",
        "s3://bucket/ckpt/orders/chk-42/counts-0/MANIFEST-000011",
    ]
    assert (handle.key_groups.start, handle.key_groups.end, handle.committed_epoch) == (0, 3, 17)


def test_documented_snippet_lists_every_file(tmp_path: Any) -> None:
    chk = tmp_path / "chk-42"
    chk.mkdir()
    (chk / "_metadata").write_text(sample().to_json(), encoding="utf-8")
    snippet = re.search(r"needs nothing but ``json``::\n\n(.*?)\n\"\"\"", metadata_module.__doc__ + '"""', re.S)
    assert snippet is not None
    code = "\n".join(line[4:] for line in snippet.group(1).splitlines())
    assert len(code.strip().splitlines()) == 5
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code.replace("/checkpoints/orders/chk-42/_metadata", str(chk / "_metadata")), {})
    assert out.getvalue().splitlines() == [
        "counts 0 ../shared/8e1f-000010.sst 200",
        "counts 0 counts-0/MANIFEST-000011 100",
        "counts 1 counts-1/state.bin 50",
    ]


def _damaged(mutate: Any) -> str:
    raw = json.loads(sample().to_json())
    mutate(raw)
    return json.dumps(raw)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xff\xfe not utf-8", "not valid UTF-8 JSON"),
        ('{"format": "keyedstate-checkpoint", "version": 1,', "not valid UTF-8 JSON"),
        ("[]", "the top level must be an object"),
        (_damaged(lambda r: r.update(format="flink")), "format is 'flink', expected 'keyedstate-checkpoint'"),
        (_damaged(lambda r: r.update(version=3)), "format version 3 is not supported"),
        (_damaged(lambda r: r.pop("max_parallelism")), "missing field 'max_parallelism'"),
        (_damaged(lambda r: r.update(checkpoint_id="42")), "field 'checkpoint_id' must be an integer, got '42'"),
        (_damaged(lambda r: r.update(savepoint=1)), "field 'savepoint' must be true or false"),
        (
            _damaged(lambda r: r["operators"][0]["subtasks"][1]["files"][0].pop("size")),
            "missing field 'operators[0].subtasks[1].files[0].size'",
        ),
        (
            _damaged(lambda r: r["operators"][0]["states"][0].update(kind="set")),
            "field 'operators[0].states[0].kind' is 'set', expected one of value, list, map, reducing",
        ),
        (_damaged(lambda r: r["operators"][0]["states"][0]["ttl"].update(ttl_ms=0)), "TTL must be positive"),
        (_damaged(lambda r: r["operators"][0]["subtasks"][0].update(key_groups=[0])), "must be [start, end]"),
        (
            _damaged(lambda r: r["operators"][0]["subtasks"][0].update(key_groups=[0, 4])),
            "key groups [0, 4] but parallelism 2 of max parallelism 8 gives [0, 3]",
        ),
        (_damaged(lambda r: r["operators"][0]["subtasks"].pop()), "has subtasks [0] but parallelism 2 needs 0..1"),
        (
            _damaged(lambda r: r["operators"][0]["subtasks"][0]["files"][1].update(path="../../etc/passwd")),
            "must be inside the checkpoint directory",
        ),
        (
            _damaged(lambda r: r["operators"][0]["subtasks"][0]["files"][1].update(path="/abs/file")),
            "must be inside the checkpoint directory",
        ),
        (
            _damaged(lambda r: r["operators"][0]["subtasks"][0]["files"][0].update(path="shared/x.sst")),
            "shared file 'shared/x.sst' must be ../shared/<name>",
        ),
        (_damaged(lambda r: r["operators"][0]["subtasks"][0]["files"][0].update(sha256="xyz")), "sha256 is not 64"),
        (_damaged(lambda r: r["operators"].append(dict(r["operators"][1]))), "operator 'empty' appears twice"),
        (_damaged(lambda r: r.update(max_parallelism=0)), "max_parallelism 0 is outside 1..32768"),
    ],
)
def test_damage_is_reported_naming_the_file_and_the_problem(data: Any, message: str) -> None:
    source = "s3://bucket/ckpt/orders/chk-42/_metadata"
    with pytest.raises(CorruptCheckpointError) as info:
        CheckpointMetadata.from_json(data, source=source)
    assert source in str(info.value)
    assert message in str(info.value)
    assert "Restore from another checkpoint" in str(info.value)


def test_savepoint_paths_must_stay_inside() -> None:
    ok = sample(savepoint=True)
    assert ok.problems() == []
    raw = json.loads(ok.to_json())
    raw["operators"][0]["subtasks"][0]["files"][0]["path"] = "../shared/8e1f-000010.sst"
    with pytest.raises(CorruptCheckpointError, match="not inside the savepoint directory"):
        CheckpointMetadata.from_json(json.dumps(raw))


def test_taskowned_files_are_allowed_in_checkpoints_only() -> None:
    raw = json.loads(sample().to_json())
    raw["operators"][0]["subtasks"][1]["files"][0]["path"] = "../taskowned/counts-1/changelog"
    assert CheckpointMetadata.from_json(json.dumps(raw)).problems() == []
    raw["savepoint"] = True
    for f in raw["operators"][0]["subtasks"][0]["files"]:
        f["shared"] = False
        f["path"] = "x/" + f["path"].rsplit("/", 1)[-1]
    with pytest.raises(CorruptCheckpointError, match="not inside the savepoint directory"):
        CheckpointMetadata.from_json(json.dumps(raw))
