"""``jobmanager`` / ``python -m keyedstate.jobmanager``: run the JobManager daemon."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from keyedstate.common.config import Configuration
from keyedstate.common.errors import KeyedStateError
from keyedstate.common.logs import setup_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jobmanager", description="Run the keyedstate JobManager daemon.")
    parser.add_argument("--config", "-c", metavar="FILE", help="YAML file with Flink-style keys")
    parser.add_argument("-D", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key (repeatable)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    log = logging.getLogger("keyedstate.jobmanager")
    from keyedstate.jobmanager.daemon import JobManager

    try:
        conf = Configuration.load(args.config, args.overrides)
        jm = JobManager(conf)
        jm.start()
    except KeyedStateError as exc:
        log.error("jobmanager failed to start: %s", exc)
        print(f"jobmanager: {exc}", file=sys.stderr)
        return 2

    def shutdown(signum: int, _frame: object) -> None:
        log.info("received %s; shutting down", signal.Signals(signum).name)
        jm.stop()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    print(f"jobmanager serving on {jm.address}", flush=True)
    jm.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
