"""The installed keyedstate version, for ``--version`` on statectl and the daemons."""

from __future__ import annotations

from importlib import metadata


def package_version() -> str:
    """The version of the installed ``keyedstate`` distribution (``unknown`` when run from a bare tree)."""
    try:
        return metadata.version("keyedstate")
    except metadata.PackageNotFoundError:
        return "unknown"


def version_line(prog: str) -> str:
    """``<prog> (keyedstate) <version>``: what ``--version`` prints."""
    return f"{prog} (keyedstate) {package_version()}"
