"""URL arithmetic for checkpoint storage paths (``file:///x``, ``s3://bucket/x``), without I/O.

The storage protocol speaks absolute URLs; ``_metadata`` speaks paths relative to the directory
that holds it. These helpers convert between the two and reject relative paths that could
escape where they belong.
"""

from __future__ import annotations

import logging
import posixpath

logger = logging.getLogger(__name__)

SHARED_DIR = "shared"
TASKOWNED_DIR = "taskowned"
METADATA_FILE = "_metadata"
CHECKPOINT_DIR_PREFIX = "chk-"
MATERIALIZATION_GROUP_PREFIX = "mat-"
"""``shared/mat-<id>/`` holds a changelog slot's background materialization (not tied to one checkpoint)."""


def _split(url: str) -> tuple[str, str]:
    scheme, sep, rest = url.partition("://")
    return (scheme + sep, rest) if sep else ("", url)


def normalize(url: str) -> str:
    """Collapse ``.``/``..``/duplicate slashes and drop a trailing slash."""
    prefix, rest = _split(url)
    if not rest:
        return url
    norm = posixpath.normpath(rest)
    if norm == ".":
        norm = ""
    return prefix + norm


def join(base: str, *parts: str) -> str:
    """``base`` joined with relative ``parts`` (``..`` allowed), normalized."""
    tail = "/".join(p.strip("/") for p in parts if p)
    return normalize(base.rstrip("/") + "/" + tail) if tail else normalize(base)


def parent(url: str) -> str:
    prefix, rest = _split(normalize(url))
    return prefix + posixpath.dirname(rest)


def name(url: str) -> str:
    return posixpath.basename(normalize(url))


def relative_to(url: str, base: str) -> str | None:
    """``url`` relative to ``base`` when it lies strictly inside it, else None."""
    url_n, base_n = normalize(url), normalize(base).rstrip("/")
    if url_n.startswith(base_n + "/"):
        return url_n[len(base_n) + 1 :]
    return None


def is_inside_relative(path: str) -> bool:
    """True for a clean relative path that stays inside its base (``a/b.sst``, not ``../x``)."""
    if not path or path.startswith("/") or "://" in path or "\\" in path:
        return False
    return posixpath.normpath(path) == path and not path.startswith("..") and path != "."


def under(path: str, directory: str) -> str | None:
    """For a relative ``path`` of the form ``../<directory>/<rest>``, return ``<rest>``."""
    prefix = f"../{directory}/"
    if path.startswith(prefix) and is_inside_relative(path[len(prefix) :]):
        return path[len(prefix) :]
    return None


def checkpoint_dir_name(checkpoint_id: int) -> str:
    return f"{CHECKPOINT_DIR_PREFIX}{checkpoint_id}"


def parse_checkpoint_dir_name(dir_name: str) -> int | None:
    """The id of a ``chk-<n>`` directory name, or None for anything else."""
    if not dir_name.startswith(CHECKPOINT_DIR_PREFIX):
        return None
    digits = dir_name[len(CHECKPOINT_DIR_PREFIX) :]
    if not digits.isdigit() or (len(digits) > 1 and digits[0] == "0"):
        return None
    return int(digits)


def savepoint_dir_name(job_id: str, checkpoint_id: int) -> str:
    return f"savepoint-{job_id[:8]}-{checkpoint_id}"
