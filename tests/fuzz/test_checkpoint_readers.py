"""Fuzz every reader of checkpoint files with mutations of a real checkpoint.

A module fixture runs a real cluster (a RocksDB and a HashMap TaskManager), writes state and
takes an incremental checkpoint, then stops the cluster. Each case copies that checkpoint,
damages one thing and runs a reader:

* ``_metadata`` (jobmanager.checkpoint.restore.load_checkpoint, then the restore planning and
  the file check): truncation, bit flips, random bytes, and JSON mutations (wrong types, missing
  keys, huge numbers, ``..`` paths and names, deep nesting).
* the per-subtask files, as a TaskManager restores them (taskmanager.state.restore_backend into
  either backend): ``_snapshot.json``, the HashMap ``.kvs`` files, RocksDB's CURRENT, MANIFEST,
  OPTIONS and SST files: truncated, bit-flipped, replaced, deleted.
* the download check (taskmanager.snapshot.transfer.download_files): a stored file that differs
  from what ``_metadata`` recorded must never be accepted.

Oracle: the reader succeeds or raises a typed KeyedStateError (never reason INTERNAL, never
another exception), within a time bound, and writes nothing outside its working directory.
"""

from __future__ import annotations

import copy
import json
import os
import posixpath
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.clock import SystemClock
from keyedstate.common.config import Configuration
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.errors import KeyedStateError, Reason
from keyedstate.common.ids import JobId, KeyGroupRange, SubtaskId
from keyedstate.common.storage import is_plain_file_name, open_storage
from keyedstate.jobmanager.checkpoint import _paths
from keyedstate.jobmanager.checkpoint.metadata import CheckpointMetadata
from keyedstate.jobmanager.checkpoint.restore import load_checkpoint, plan_restore, verify_checksums, verify_files_exist
from keyedstate.jobmanager.daemon import JobManager
from keyedstate.taskmanager.snapshot.transfer import download_files
from keyedstate.taskmanager.state import restore_backend
from keyedstate.taskmanager.state.limits import StateLimits
from tests.fixtures.cluster import FAST_HEARTBEATS, InProcessCluster
from tests.fuzz import proto_strategies as ps
from tests.fuzz.conftest import default_examples, long_seconds

JOB, OPERATOR = JobId("ckjob"), "ckop"
STATES = (
    StateDescriptor("v", StateKind.VALUE),
    StateDescriptor("l", StateKind.LIST),
    StateDescriptor("m", StateKind.MAP),
)
CASE_SECONDS = 20.0
"""A reader that takes longer than this on a small checkpoint counts as a hang."""


@dataclass
class RealCheckpoint:
    job_dir: Path
    chk_dir: Path
    metadata: CheckpointMetadata
    snapshots: dict[int, tuple[str, Path]]
    """Per subtask: the backend that wrote it and its files laid out under their local names."""


@pytest.fixture(scope="module")
def real_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCheckpoint]:
    base = tmp_path_factory.mktemp("real-checkpoint")
    jm = JobManager(
        Configuration(
            {
                "jobmanager.rpc.port": 0,
                "metrics.reporter.prom.port": "-1",
                "rest.port": -1,
                "state.checkpoints.dir": (base / "checkpoints").as_uri(),
                **FAST_HEARTBEATS,
            }
        )
    )
    jm.start()
    cluster = InProcessCluster(base, jm, tm_config={"taskmanager.numberOfTaskSlots": 1})
    try:
        cluster.add_taskmanager(**{"state.backend.type": "rocksdb"})
        cluster.add_taskmanager(**{"state.backend.type": "hashmap"})
        client = cluster.client()
        client.submit_job(
            JOB,
            [OperatorSpec(OPERATOR, 2, STATES)],
            max_parallelism=32,
            config={"execution.checkpointing.incremental": "true"},
        )
        from keyedstate.common.client import ListState, MapState, ValueState

        keys = [f"k{i}" for i in range(300)]
        values: ValueState[str, str] = ValueState(
            client, JOB, OPERATOR, "v", key_serializer="str", value_serializer="str"
        )
        values.put_many(keys, keys)
        lists: ListState[str, str] = ListState(client, JOB, OPERATOR, "l", key_serializer="str", value_serializer="str")
        lists.append_many(keys, keys)
        maps: MapState[str, str, str] = MapState(
            client, JOB, OPERATOR, "m", key_serializer="str", user_key_serializer="str", value_serializer="str"
        )
        maps.put_many(keys, keys, keys)
        info = client.trigger_checkpoint(JOB, timeout_s=60)
        assert info.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, info.failure_reason
    finally:
        cluster.stop()
    chk_dir = Path(info.path.removeprefix("file://"))
    metadata = CheckpointMetadata.from_json((chk_dir / "_metadata").read_bytes())
    snapshots = {}
    for sub in metadata.operators[0].subtasks:
        local = base / f"snapshot-{sub.subtask_index}"
        local.mkdir()
        for f in sub.files:
            shutil.copyfile(chk_dir / f.path, local / f.local_name)
        snapshots[sub.subtask_index] = (sub.backend, local)
    assert {b for b, _ in snapshots.values()} == {"rocksdb", "hashmap"}
    yield RealCheckpoint(chk_dir.parent, chk_dir, metadata, snapshots)


def _typed(exc: BaseException) -> bool:
    return isinstance(exc, KeyedStateError) and exc.reason is not Reason.INTERNAL


@dataclass
class Counts:
    cases: int = 0
    accepted: int = 0
    refused: dict[str, int] | None = None
    samples: dict[str, str] | None = None
    """The first message per refusal type."""

    def record(self, outcome: BaseException | None) -> None:
        self.cases += 1
        if outcome is None:
            self.accepted += 1
        else:
            self.refused = self.refused or {}
            name = type(outcome).__name__
            self.refused[name] = self.refused.get(name, 0) + 1
            self.samples = self.samples or {}
            self.samples.setdefault(name, str(outcome)[:300])


def _run_case(fn: Callable[[], None], counts: Counts, describe: str) -> None:
    t0 = time.monotonic()
    try:
        fn()
        outcome: BaseException | None = None
    except Exception as exc:  # the oracle: only typed, non-INTERNAL errors
        if not _typed(exc):
            raise AssertionError(f"{describe}: untyped {type(exc).__name__}: {exc!r}") from exc
        outcome = exc
    took = time.monotonic() - t0
    assert took < CASE_SECONDS, f"{describe}: took {took:.1f} s (hang)"
    counts.record(outcome)


def _listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# -- _metadata --------------------------------------------------------------------------------


def _json_paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(node, dict):
        for k, v in node.items():
            out.extend(_json_paths(v, (*path, k)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.extend(_json_paths(v, (*path, i)))
    return out


JSON_VALUES = st.one_of(
    st.sampled_from(
        [
            None,
            True,
            False,
            0,
            -1,
            1,
            2**31,
            2**63,
            -(2**63) - 1,
            10**400,
            1.5,
            float("nan"),
            "",
            "..",
            "../..",
            "../../../../../../tmp/escape",
            "/abs/path",
            "../shared/../../x",
            "a/../../b",
            "\x00",
            "x" * 10_000,
            [],
            {},
            [0],
            [0, 2**40],
            {"a": 1},
        ]
    ),
    st.integers(),
    st.text(max_size=20),
)


@st.composite
def mutated_metadata(draw: st.DrawFn, original: bytes) -> bytes:
    kind = draw(st.sampled_from(["bytes", "json", "json", "json", "nesting", "number"]))
    if kind == "bytes":
        return draw(ps.mutated_bytes(original))
    if kind == "nesting":
        depth = draw(st.sampled_from([100, 10_000, 200_000]))
        return ("[" * depth + "]" * depth).encode()
    if kind == "number":
        return (
            b'{"format":"keyedstate-checkpoint","version":1,"checkpoint_id":'
            + b"9" * draw(st.sampled_from([5000, 100_000]))
            + b"}"
        )
    doc = json.loads(original)
    paths = _json_paths(doc)
    target = draw(st.sampled_from(paths[1:]))
    parent = doc
    for step in target[:-1]:
        parent = parent[step]
    action = draw(st.sampled_from(["replace", "delete", "duplicate"]))
    if action == "delete":
        if isinstance(parent, dict):
            del parent[target[-1]]
        else:
            parent.pop(target[-1])
    elif action == "duplicate" and isinstance(parent, list):
        parent.append(copy.deepcopy(parent[target[-1]]))
    else:
        parent[target[-1]] = draw(JSON_VALUES)
    return json.dumps(doc, allow_nan=True).encode()


def read_metadata_everywhere(storage: Any, chk: Path, job_dir: Path) -> None:
    """Every JobManager-side reader of ``_metadata``: load, check the files and checksums, plan a restore (same and rescaled)."""
    meta = load_checkpoint(storage, chk.as_uri())
    base = _paths.normalize(chk.as_uri())
    root = _paths.normalize(job_dir.as_uri())
    for _, _, f in meta.files():
        # A loaded checkpoint's files all lie under the job directory, and land under a plain name.
        assert _paths.join(base, f.path).startswith(root + "/"), f"{f.path!r} escapes {root}"
        name = f.local_name or posixpath.basename(f.path)
        assert is_plain_file_name(name), f"file {f.path!r} restores under {name!r}"
    verify_files_exist(storage, meta, base)
    verify_checksums(storage, meta, base, threads=2)
    for parallelism in (2, 1, 3):
        plan_restore(
            meta, [OperatorSpec(OPERATOR, parallelism, STATES)], meta.max_parallelism, checkpoint_dir=base, job_id=JOB
        )


def _metadata_run(real: RealCheckpoint, tmp: Path, counts: Counts, examples: int, run_seed: int) -> None:
    original = (real.chk_dir / "_metadata").read_bytes()
    storage = open_storage(real.job_dir.as_uri())
    work = tmp / "meta"

    @seed(run_seed)
    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def case(data: st.DataObject) -> None:
        data_bytes = data.draw(mutated_metadata(original), label="_metadata")
        shutil.rmtree(work, ignore_errors=True)
        job_dir = work / JOB
        shutil.copytree(real.job_dir, job_dir)
        chk = job_dir / real.chk_dir.name
        (chk / "_metadata").write_bytes(data_bytes)
        before = _listing(tmp)
        _run_case(lambda: read_metadata_everywhere(storage, chk, job_dir), counts, f"_metadata {data_bytes[:200]!r}")
        assert _listing(tmp) == before, "a metadata reader wrote files"

    case()


# -- per-subtask files ------------------------------------------------------------------------


@st.composite
def damaged_snapshot(draw: st.DrawFn, files: list[Path]) -> tuple[Path, str, bytes | None]:
    """One file of a snapshot and its damaged content (None: deleted)."""
    target = draw(st.sampled_from(files))
    content = target.read_bytes()
    action = draw(
        st.sampled_from(
            ["bytes", "bytes", "delete", "json"] if target.suffix == ".json" else ["bytes", "bytes", "delete"]
        )
    )
    if action == "delete":
        return target, action, None
    if action == "json":
        doc = json.loads(content)
        paths = _json_paths(doc)[1:]
        where = draw(st.sampled_from(paths))
        parent = doc
        for step in where[:-1]:
            parent = parent[step]
        parent[where[-1]] = draw(JSON_VALUES)
        return target, action, json.dumps(doc).encode()
    return target, action, draw(ps.mutated_bytes(content))


def _subtask_run(real: RealCheckpoint, tmp: Path, counts: Counts, examples: int, run_seed: int) -> None:
    subtasks = sorted(real.snapshots)
    meta_subs = {s.subtask_index: s for s in real.metadata.operators[0].subtasks}

    @seed(run_seed)
    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def case(data: st.DataObject) -> None:
        index = data.draw(st.sampled_from(subtasks), label="subtask")
        _, source = real.snapshots[index]
        work = tmp / "sub"
        shutil.rmtree(work, ignore_errors=True)
        snapshot = work / "snapshot"
        shutil.copytree(source, snapshot)
        target, action, content = data.draw(damaged_snapshot(sorted(snapshot.iterdir())), label="damage")
        if content is None:
            target.unlink()
        else:
            target.write_bytes(content)
        as_kind = data.draw(st.sampled_from(["rocksdb", "hashmap"]), label="restore into")
        key_groups = data.draw(
            st.sampled_from([meta_subs[index].key_groups, KeyGroupRange(0, 31), KeyGroupRange(3, 5)])
        )
        before = _listing(tmp)

        def restore() -> None:
            backend = restore_backend(
                as_kind,
                SubtaskId(JOB, OPERATOR, index),
                key_groups,
                real.metadata.max_parallelism,
                STATES,
                snapshot_dirs=[snapshot],
                local_dir=work / "restored",
                limits=StateLimits(),
                clock=SystemClock(),
            )
            try:
                for state in STATES:
                    list(backend.scan_keys(state.name))
            finally:
                backend.close()

        _run_case(restore, counts, f"{target.name} {action} restored into {as_kind}")
        # The restore writes its own directory; opening a RocksDB snapshot may also write into the
        # snapshot itself (rocksdict recreates a missing rocksdict-config.json even read-only).
        new = {p for p in _listing(tmp) - before if not p.startswith(("sub/restored", "sub/snapshot/"))}
        assert not new, f"written outside the restore and snapshot directories: {sorted(new)}"

    case()


def _download_run(real: RealCheckpoint, tmp: Path, counts: Counts, examples: int, run_seed: int) -> None:
    files = [(sub, f) for sub in real.metadata.operators[0].subtasks for f in sub.files if f.size > 0]

    @seed(run_seed)
    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def case(data: st.DataObject) -> None:
        _, f = data.draw(st.sampled_from(files), label="file")
        work = tmp / "dl"
        shutil.rmtree(work, ignore_errors=True)
        remote = work / "remote" / "file"
        remote.parent.mkdir(parents=True)
        original = (real.chk_dir / f.path).read_bytes()
        damaged = data.draw(ps.mutated_bytes(original), label="content")
        remote.write_bytes(damaged)
        storage = open_storage(remote.parent.as_uri())
        local = work / "local" / f.local_name

        def download() -> None:
            download_files(storage, [(remote.as_uri(), str(local), f.size, f.sha256)], threads=2)
            # Accepted only when the bytes are exactly the recorded ones.
            assert damaged == original, f"a damaged {f.local_name} was accepted"

        _run_case(download, counts, f"download of damaged {f.local_name}")
        if damaged != original:
            assert not local.exists() and not any((work / "local").glob("*")), "an unverified file was left behind"

    case()


READERS = {"metadata": _metadata_run, "subtask": _subtask_run, "download": _download_run}


def _fuzz_readers(real: RealCheckpoint, tmp: Path, reader: str, examples: int, seconds: float) -> Counts:
    counts = Counts()
    deadline = time.monotonic() + seconds
    run = 0
    while True:
        READERS[reader](real, tmp, counts, examples, 2000 + run)
        run += 1
        if time.monotonic() >= deadline:
            break
    print(
        f"{reader}: {counts.cases} cases, {counts.accepted} accepted, refused {counts.refused}; first messages {counts.samples}"
    )
    report = os.environ.get("KEYEDSTATE_FUZZ_REPORT")
    if report:
        with open(report, "a", encoding="utf-8") as out:
            out.write(
                json.dumps(
                    {
                        "test": f"checkpoint-readers:{reader}",
                        "cases": counts.cases,
                        "accepted": counts.accepted,
                        "refused": counts.refused,
                        "seeds": run,
                    }
                )
                + "\n"
            )
    assert counts.cases >= examples
    return counts


@pytest.mark.parametrize("reader", sorted(READERS))
def test_fuzz_checkpoint_reader_bounded(real_checkpoint: RealCheckpoint, tmp_path: Path, reader: str) -> None:
    counts = _fuzz_readers(real_checkpoint, tmp_path, reader, max(20, default_examples() // 3), 0)
    # The mutations must reach the checks: most cases are refused, with the typed error.
    assert counts.refused and counts.cases - counts.accepted >= counts.cases // 3


@pytest.mark.fuzz_long
@pytest.mark.timeout(0)
@pytest.mark.parametrize("reader", sorted(READERS))
def test_fuzz_checkpoint_reader_long(real_checkpoint: RealCheckpoint, tmp_path: Path, reader: str) -> None:
    _fuzz_readers(real_checkpoint, tmp_path, reader, 200, long_seconds())


# -- coverage-guided (atheris) ------------------------------------------------------------------

ATHERIS_TARGETS = ("metadata", "manifest", "kvs")


def _seed_corpus(real: RealCheckpoint, target: str, corpus: Path) -> None:
    corpus.mkdir(parents=True)
    if target == "metadata":
        shutil.copyfile(real.chk_dir / "_metadata", corpus / "_metadata")
        return
    for index, (_, directory) in real.snapshots.items():
        for path in directory.iterdir():
            if (target == "manifest" and path.name == "_snapshot.json") or (target == "kvs" and path.suffix == ".kvs"):
                shutil.copyfile(path, corpus / f"{index}-{path.name}")
    assert any(corpus.iterdir()), f"the real checkpoint has no {target} file"


def run_atheris(real: RealCheckpoint, tmp: Path, target: str, limit: list[str]) -> dict[str, Any]:
    """Run the libFuzzer loop on ``target`` in a subprocess; its counts, or a failure with the crash input."""
    import re
    import subprocess
    import sys

    corpus = tmp / f"corpus-{target}"
    _seed_corpus(real, target, corpus)
    artifacts = tmp / "artifacts"
    artifacts.mkdir(exist_ok=True)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.fuzz.atheris_readers",
            target,
            *limit,
            "-seed=1",
            "-timeout=20",
            "-rss_limit_mb=4096",
            f"-artifact_prefix={artifacts}/",
            str(corpus),
        ],
        cwd=Path(__file__).resolve().parents[2],
        # The target's scratch directory (tempfile) goes under this test's directory: libFuzzer
        # ends the process without running its clean-up, which left one in /tmp per run.
        env={**os.environ, "TMPDIR": str(tmp)},
        capture_output=True,
        text=True,
        timeout=long_seconds() + 600,
    )
    crashes = sorted(p.name for p in artifacts.iterdir())
    assert proc.returncode == 0 and not crashes, (
        f"atheris {target}: exit {proc.returncode}, {crashes}\n{proc.stderr[-3000:]}"
    )
    done = re.findall(r"Done (\d+) runs in (\d+) second", proc.stderr)
    cov = re.findall(r"cov: (\d+) ft: (\d+)", proc.stderr)
    result = {
        "test": f"atheris:{target}",
        "runs": int(done[-1][0]),
        "seconds": int(done[-1][1]),
        "cov": int(cov[-1][0]),
        "ft": int(cov[-1][1]),
        "crashes": 0,
    }
    print(result)
    report = os.environ.get("KEYEDSTATE_FUZZ_REPORT")
    if report:
        with open(report, "a", encoding="utf-8") as out:
            out.write(json.dumps(result) + "\n")
    return result


@pytest.mark.parametrize("target", ATHERIS_TARGETS)
def test_atheris_checkpoint_parser_bounded(real_checkpoint: RealCheckpoint, tmp_path: Path, target: str) -> None:
    result = run_atheris(real_checkpoint, tmp_path, target, ["-runs=1500"])
    assert result["runs"] == 1500 and result["cov"] > 0


@pytest.mark.fuzz_long
@pytest.mark.timeout(0)
@pytest.mark.parametrize("target", ATHERIS_TARGETS)
def test_atheris_checkpoint_parser_long(real_checkpoint: RealCheckpoint, tmp_path: Path, target: str) -> None:
    run_atheris(real_checkpoint, tmp_path, target, [f"-max_total_time={int(long_seconds())}"])
