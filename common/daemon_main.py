"""The command line shared by the ``jobmanager`` and ``taskmanager`` daemons."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

from keyedstate.common import gc_policy
from keyedstate.common.config import SAFER_WAYS, Configuration, secret_overrides
from keyedstate.common.errors import KeyedStateError
from keyedstate.common.logs import setup_logging
from keyedstate.common.sd_notify import SystemdNotifier
from keyedstate.common.version import version_line


def build_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", "-c", metavar="FILE", help="YAML file with Flink-style keys")
    parser.add_argument(
        "-D",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key (repeatable)",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--version", action="version", version=version_line(prog))
    return parser


def run_daemon(
    prog: str, description: str, create: Callable[[Configuration], Any], argv: list[str] | None = None
) -> int:
    """Parse the command line, start the daemon, serve until SIGTERM/SIGINT, stop it cleanly.

    Exit codes: 0 after a clean shutdown, 2 when the configuration or start-up fails (the
    message names the key or the fix). The line ``<prog> ... serving on HOST:PORT`` on stdout
    tells supervisors and tests that the daemon is ready; under systemd (``Type=notify``) the
    same moment sends ``READY=1`` to ``$NOTIFY_SOCKET``, and shutdown sends ``STOPPING=1``.
    """
    args = build_parser(prog, description).parse_args(argv)
    # Taken from the environment before anything starts a child process (see SystemdNotifier).
    notifier = SystemdNotifier.from_environment()
    setup_logging(args.log_level)
    log = logging.getLogger(f"keyedstate.{prog}")
    for key in secret_overrides(args.overrides):
        # The command line of a process is world-readable (ps, /proc/<pid>/cmdline).
        log.warning(
            "secret %s was given with -D, so any user on this host can read it in the process list; instead %s",
            key,
            SAFER_WAYS,
        )
    try:
        conf = Configuration.load(args.config, args.overrides)
        for key, value in sorted(conf.redacted().items()):
            log.info("configuration: %s: %s", key, value)
        daemon = create(conf)
        daemon.start()
    except KeyedStateError as exc:
        log.error("%s failed to start: %s", prog, exc)
        print(f"{prog}: {exc}", file=sys.stderr)
        notifier.status(f"failed to start: {exc}")
        return 2

    def shutdown(signum: int, _frame: object) -> None:
        log.info("received %s; shutting down", signal.Signals(signum).name)
        notifier.stopping(f"received {signal.Signals(signum).name}; shutting down")
        daemon.stop()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    # `kill -USR1 <pid>` prints every thread's stack to stderr and the daemon goes on: what a
    # daemon that stopped answering waits on. faulthandler writes from C, so this works even when
    # every Python thread is stuck on a lock.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    gc_policy.apply()
    ident = getattr(daemon, "id", None)
    print(f"{prog}{' ' + ident if ident else ''} serving on {daemon.address}", flush=True)
    # start() returned with the servers started and health SERVING: the port answers now.
    notifier.ready(f"serving on {daemon.address}")
    # Wake up twice a second: CPython runs signal handlers only on the main thread, and a
    # process-directed SIGTERM that the kernel hands to one of gRPC's or RocksDB's threads does
    # not interrupt an untimed wait, so the handler would wait for some other wake-up. The same
    # loop feeds systemd's watchdog (WatchdogSec): a main thread that hangs stops feeding it.
    while not daemon.wait(0.5):
        notifier.watchdog()
    notifier.stopping()
    daemon.stop()
    failure = getattr(daemon, "failure", None)
    if failure:
        # It stopped by itself (it cannot serve what it offered): a supervisor must restart it.
        log.error("%s stopped: %s", prog, failure)
        return 1
    return 0
