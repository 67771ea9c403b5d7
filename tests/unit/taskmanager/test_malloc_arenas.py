"""The TaskManager limits glibc malloc arenas before its threads start (taskmanager.memory.malloc-arena-max)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from keyedstate.common.config import Configuration
from keyedstate.common.config import options as o


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_mallopt_is_accepted_by_this_libc(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from keyedstate.taskmanager.__main__ import _limit_malloc_arenas

    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    # In a child process: the setting is process-wide and must not leak into the test run.
    code = (
        "import logging; logging.basicConfig(level=logging.INFO); "
        "from keyedstate.taskmanager.__main__ import _limit_malloc_arenas as f; f(2)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "refused" not in result.stderr and "not limited" not in result.stderr
    with caplog.at_level(logging.INFO):
        _limit_malloc_arenas(0)  # 0: leave glibc alone, say nothing
    assert caplog.records == []


def test_default_and_bad_values() -> None:
    assert Configuration({}).get(o.MALLOC_ARENA_MAX) == 2
    with pytest.raises(Exception, match="taskmanager.memory.malloc-arena-max"):
        Configuration({"taskmanager.memory.malloc-arena-max": "-1"}).get(o.MALLOC_ARENA_MAX)
