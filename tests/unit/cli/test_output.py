"""statectl's output: tables keep their text, progress shows on a terminal only."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from keyedstate.cli import output


def test_tables_show_cells_as_text_in_columns_a_script_can_split(capsys: pytest.CaptureFixture[str]) -> None:
    long = "x" * 300  # piped output is never cut to a terminal's width
    output.print_table(["ID", "REASON"], [[1, "[bold]not markup[/bold]"], [22, long]])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "REASON"]
    assert lines[1].split(None, 1) == ["1", "[bold]not markup[/bold]"]
    assert lines[2].split() == ["22", long]
    assert "\x1b[" not in "".join(lines)  # no colour codes into a pipe


def test_progress_is_drawn_on_a_terminal_and_nowhere_else(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as terminal:
            monkeypatch.setattr("sys.stderr", terminal)
            with output.progress("savepoint of job orders"):
                time.sleep(0.5)
            os.set_blocking(master, False)
            drawn = os.read(master, 65536).decode(errors="replace")
        assert "savepoint of job orders" in drawn and "0:00:0" in drawn  # the description and the elapsed time
        with open(tmp_path / "stderr", "w") as redirected:
            monkeypatch.setattr("sys.stderr", redirected)
            with output.progress("savepoint of job orders"):
                time.sleep(0.2)
        assert (tmp_path / "stderr").read_text() == ""
    finally:
        os.close(master)
        os.close(slave)
