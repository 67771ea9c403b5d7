"""Coverage-guided fuzzing (atheris, libFuzzer) of the checkpoint file parsers.

Run as a program, one target per process: ``python -m tests.fuzz.atheris_readers TARGET
[libFuzzer flags] CORPUS_DIR``, TARGET one of ``metadata`` (``_metadata``), ``manifest``
(``_snapshot.json``), ``kvs`` (HashMap ``.kvs`` files). test_checkpoint_readers.py seeds the
corpus with the files of a real checkpoint and runs it.

Oracle per input: the parser returns, or raises a KeyedStateError whose reason is not INTERNAL;
anything else is a crash (libFuzzer writes the input as ``crash-<sha1>`` and exits non-zero). A
``_metadata`` that parses must keep every file inside its job directory under a plain name.
"""

from __future__ import annotations

import inspect
import os
import posixpath
import sys
import tempfile
from pathlib import Path

import atheris

from keyedstate.common.errors import KeyedStateError, Reason
from keyedstate.common.storage import is_plain_file_name
from keyedstate.jobmanager.checkpoint import _paths
from keyedstate.jobmanager.checkpoint.metadata import CheckpointMetadata
from keyedstate.taskmanager.state.metadata import SNAPSHOT_MANIFEST
from keyedstate.taskmanager.state.snapshot import SnapshotManifest, read_kvs


def _instrument_keyedstate() -> int:
    """Instrument every function of the loaded keyedstate modules (in place).

    instrument_imports() does not see modules loaded through the editable install's import
    hook, and instrument_all() spends half a minute on grpc and protobuf.
    """
    count = 0

    def visit(fn: object) -> None:
        nonlocal count
        fn = getattr(fn, "__func__", fn)
        if inspect.isfunction(fn):
            atheris.instrument_func(fn)
            count += 1

    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("keyedstate"):
            continue
        for obj in list(vars(module).values()):
            if getattr(obj, "__module__", None) != name:
                continue
            if inspect.isclass(obj):
                for member in list(vars(obj).values()):
                    visit(member.fget if isinstance(member, property) else member)
            else:
                visit(obj)
    return count


INSTRUMENTED = _instrument_keyedstate()

SCRATCH = Path(tempfile.mkdtemp(prefix="atheris-readers-"))
BASE = "file:///checkpoints/job/chk-7"


def _metadata(data: bytes) -> None:
    meta = CheckpointMetadata.from_json(data)
    for _, _, f in meta.files():
        if not _paths.join(BASE, f.path).startswith("file:///checkpoints/job/"):
            raise AssertionError(f"file {f.path!r} escapes the job directory")
        if not is_plain_file_name(f.local_name or posixpath.basename(f.path)):
            raise AssertionError(f"file {f.path!r} restores under a name that is not a plain file name")


def _manifest(data: bytes) -> None:
    (SCRATCH / SNAPSHOT_MANIFEST).write_bytes(data)
    SnapshotManifest.read(SCRATCH)


def _kvs(data: bytes) -> None:
    path = SCRATCH / "state-v.kvs"
    path.write_bytes(data)
    for _ in read_kvs(path):
        pass


TARGETS = {"metadata": _metadata, "manifest": _manifest, "kvs": _kvs}


def main() -> None:
    target = TARGETS[sys.argv[1]]

    def one_input(data: bytes) -> None:
        try:
            target(data)
        except KeyedStateError as exc:
            if exc.reason is Reason.INTERNAL:
                raise

    atheris.Setup([sys.argv[0], *sys.argv[2:]], one_input)
    try:
        atheris.Fuzz()
    finally:
        for p in SCRATCH.iterdir():
            os.remove(p)
        SCRATCH.rmdir()


if __name__ == "__main__":
    main()
