"""``taskmanager`` / ``python -m keyedstate.taskmanager``: run a TaskManager daemon."""

from __future__ import annotations

import sys

from keyedstate.common.config import Configuration
from keyedstate.common.daemon_main import run_daemon


def _limit_malloc_arenas(arenas: int) -> None:
    """mallopt(M_ARENA_MAX): the process-wide equivalent of MALLOC_ARENA_MAX, set before threads start."""
    import ctypes
    import ctypes.util
    import logging
    import os

    if arenas <= 0 or "MALLOC_ARENA_MAX" in os.environ or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_arena_max = -8  # from glibc's malloc.h
        if libc.mallopt(m_arena_max, arenas) != 1:
            logging.getLogger(__name__).warning("mallopt(M_ARENA_MAX, %d) was refused", arenas)
    except (OSError, AttributeError) as exc:  # not glibc (musl): nothing to limit
        logging.getLogger(__name__).info("malloc arenas not limited: %s", exc)


def _create(conf: Configuration) -> object:
    from keyedstate.common.config import options as o
    from keyedstate.taskmanager.daemon import TaskManager

    _limit_malloc_arenas(conf.get(o.MALLOC_ARENA_MAX))
    return TaskManager(conf)


def main(argv: list[str] | None = None) -> int:
    return run_daemon("taskmanager", "Run a keyedstate TaskManager daemon.", _create, argv)


if __name__ == "__main__":
    sys.exit(main())
