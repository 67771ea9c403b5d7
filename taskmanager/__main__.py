"""``taskmanager`` / ``python -m keyedstate.taskmanager``: run a TaskManager daemon."""

from __future__ import annotations

import sys

from keyedstate.common.config import Configuration
from keyedstate.common.daemon_main import run_daemon


def _create(conf: Configuration) -> object:
    from keyedstate.taskmanager.daemon import TaskManager

    return TaskManager(conf)


def main(argv: list[str] | None = None) -> int:
    return run_daemon("taskmanager", "Run a keyedstate TaskManager daemon.", _create, argv)


if __name__ == "__main__":
    sys.exit(main())
