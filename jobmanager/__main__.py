"""``jobmanager`` / ``python -m keyedstate.jobmanager``: run the JobManager daemon."""

from __future__ import annotations

import sys

from keyedstate.common.config import Configuration
from keyedstate.common.daemon_main import run_daemon


def _create(conf: Configuration) -> object:
    from keyedstate.jobmanager.daemon import JobManager

    return JobManager(conf)


def main(argv: list[str] | None = None) -> int:
    return run_daemon("jobmanager", "Run the keyedstate JobManager daemon.", _create, argv)


if __name__ == "__main__":
    sys.exit(main())
