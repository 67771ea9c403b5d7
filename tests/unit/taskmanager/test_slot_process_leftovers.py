"""What a TaskManager removes of a killed predecessor's slot-process directory, and what it never touches.

The end-to-end case (a real TaskManager killed with -9 and restarted) is in
tests/integration/serving/test_slot_processes.py; these pin the safety rules on the record.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from keyedstate.taskmanager.slot_processes import remove_leftover_control_dir

RECORD = "slot-processes.dir"


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    out = tmp_path / "tmp"
    out.mkdir()
    return out


def _work(tmp_path: Path, names: str) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / RECORD).write_text(names)
    return work


def test_the_recorded_directory_and_the_record_are_removed(tmp_path: Path, tmp: Path) -> None:
    leftover = Path(tempfile.mkdtemp(prefix="keyedstate-slots-", dir=tmp))
    (leftover / "lease").write_bytes(b"\0" * 16)
    (leftover / "slot-0.sock").write_bytes(b"")
    work = _work(tmp_path, str(leftover))
    remove_leftover_control_dir(work)
    assert not leftover.exists() and not (work / RECORD).exists()


def test_nothing_recorded_removes_nothing(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    remove_leftover_control_dir(work)
    assert list(work.iterdir()) == []


def test_a_record_of_a_directory_already_gone_is_dropped(tmp_path: Path, tmp: Path) -> None:
    work = _work(tmp_path, str(tmp / "keyedstate-slots-gone"))
    remove_leftover_control_dir(work)
    assert not (work / RECORD).exists()


@pytest.mark.parametrize("name", ["precious", "keyedstate-slots-link"])
def test_what_is_no_slot_process_directory_is_left_alone(tmp_path: Path, tmp: Path, name: str) -> None:
    target = tmp / "data"
    target.mkdir()
    (target / "keep").write_text("x")
    named = tmp / name
    if name == "precious":
        named = target  # a directory of another name: not ours
    else:
        named.symlink_to(target, target_is_directory=True)  # our name, but a link to elsewhere
    work = _work(tmp_path, str(named))
    remove_leftover_control_dir(work)
    assert (target / "keep").read_text() == "x"
    assert not (work / RECORD).exists()  # the record is ours: it goes


def test_a_relative_or_unreadable_record_removes_nothing_else(tmp_path: Path, tmp: Path) -> None:
    kept = tmp / "keyedstate-slots-kept"
    kept.mkdir()
    work = _work(tmp_path, "keyedstate-slots-kept")  # relative: never resolved against the cwd
    remove_leftover_control_dir(work)
    assert kept.is_dir() and not (work / RECORD).exists()
    (work / RECORD).write_bytes(b"\xff\xfe")
    remove_leftover_control_dir(work)
    assert kept.is_dir() and not (work / RECORD).exists()
