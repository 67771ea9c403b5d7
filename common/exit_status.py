"""How a child process ended, in words for logs and errors (the TaskManager's slot and transfer processes)."""

from __future__ import annotations

import signal


def describe_exit(code: int | None) -> str:
    """``code`` as ``subprocess.Popen.poll()`` returns it: None (still running, so it stopped answering),
    a negative signal number, or an exit status."""
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"
