"""Logging set-up for the daemons and CLIs: one greppable line per event."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s",
    )
    # gRPC and botocore are noisy at INFO.
    for noisy in ("botocore", "s3fs", "aiobotocore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
