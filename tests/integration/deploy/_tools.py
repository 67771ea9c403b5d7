"""Binaries the deploy tests run (Debian's packages, installed by ``make test-deps``)."""

from __future__ import annotations

import os
import shutil

import pytest


def require(binary: str, package: str) -> str:
    """The path of ``binary``; fails under ``make`` (CI must have it), skips when pytest is run by hand."""
    path = shutil.which(binary)
    if path:
        return path
    message = f"{binary} is missing; `make test-deps` installs it (apt-get install -y {package})"
    if os.environ.get("MAKELEVEL"):  # make exports MAKELEVEL to its recipes: `make test` is the entry point
        pytest.fail(message)
    pytest.skip(message)
