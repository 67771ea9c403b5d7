"""``--version`` on the three programs, through their entry points."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["keyedstate.jobmanager", "keyedstate.taskmanager", "keyedstate.cli.statectl"])
def test_version(module: str) -> None:
    from keyedstate.common.version import package_version

    result = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    prog = module.split(".")[-1]
    assert result.stdout.strip() == f"{prog} (keyedstate) {package_version()}"
    assert package_version() != "unknown"
