"""Child processes tied to their parent by a socket pair: the TaskManager's slot and transfer processes.

The parent starts ``python -m <module> <fd> [args]`` with :class:`ChildProcess`, where ``<fd>`` is
the child's end of a socket pair, and sends its first message (the child's settings) on it. The
child takes that message with :func:`connect_to_parent` and lives exactly as long as the parent's
end stays open: the kernel closes that end when the parent dies in any way, ``kill -9`` included,
so a child that watches the socket never outlives its parent. (``PR_SET_PDEATHSIG`` would fire
when the *thread* that forked exits, not the process.)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Generic, TypeVar

T = TypeVar("T")

EXIT_PARENT_GONE = 0
"""The parent went away before it said anything: nothing to do, and nothing went wrong."""
EXIT_USAGE = 2
"""Started by hand with the wrong arguments, or sent something else first: a bug or a misuse."""


class ChildProcess:
    """The parent's side: a child started as ``python -m <module> <fd> [args]``, and the socket to it.

    ``conn`` carries pickled messages both ways; :meth:`hang_up` closes our end, which the child
    reads as "exit now".
    """

    def __init__(self, module: str, args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", module, str(theirs.fileno()), *args],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                close_fds=True,
                env=None if env is None else dict(env),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # only the child holds it now: its death closes the socket for us
        self.pid = self.process.pid
        # The socket object stays ours so hang_up() can shut it down, which wakes a reader blocked
        # in recv() on the duplicate descriptor (closing a descriptor another thread reads does not).
        self._sock = ours
        self.conn = Connection(os.dup(ours.fileno()))

    def exit_code(self) -> int | None:
        """None while the child runs (``Popen.poll``)."""
        return self.process.poll()

    def kill(self) -> None:
        """SIGKILL the child (nothing happens if it is gone already)."""
        try:
            self.process.kill()
        except OSError:
            pass

    def hang_up(self) -> None:
        """Shut our end of the socket down: the child sees end-of-file and exits."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already shut down, or the child closed it first
            pass

    def wait_exit(self, timeout_s: float) -> bool:
        """Wait for the child to exit; after ``timeout_s`` kill it and reap it. False: it had to be killed."""
        try:
            self.process.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            self.kill()
            self.process.wait()
            return False

    def close_socket(self) -> None:
        """Release both descriptors of our end (after :meth:`hang_up` and the child's exit)."""
        self.conn.close()
        self._sock.close()


@dataclass(frozen=True)
class ParentLink(Generic[T]):
    """The child's side: its end of the socket and the first message its parent sent."""

    conn: Connection
    first: T

    def wait_parent_gone(self) -> None:
        """Block until the parent's end closes (a stop, a crash, ``kill -9``); nothing else is expected."""
        try:
            self.conn.recv()
        except (EOFError, OSError):
            pass


def connect_to_parent(
    argv: Sequence[str], module: str, expected: type[T], what: str, optional_args: Sequence[str] = ()
) -> ParentLink[T] | int:
    """The startup handshake of a child's ``main``: the socket named by ``argv[0]`` and its first message.

    ``argv`` is ``<socket fd>`` followed by at most ``len(optional_args)`` more arguments (named in
    the usage line). Returns the link, or the exit status for ``main`` to return: :data:`EXIT_USAGE`
    (wrong arguments, or a first message that is not an ``expected``; both said on stderr) or
    :data:`EXIT_PARENT_GONE` (the parent closed its end before sending anything).
    """
    if not 1 <= len(argv) <= 1 + len(optional_args) or not argv[0].isdigit():
        extra = "".join(f" [<{name}>]" for name in optional_args)
        print(f"usage: python -m {module} <socket fd>{extra}", file=sys.stderr)
        return EXIT_USAGE
    conn = Connection(int(argv[0]))
    try:
        first = conn.recv()
    except (EOFError, OSError):
        conn.close()
        return EXIT_PARENT_GONE
    if not isinstance(first, expected):
        print(f"{what}: expected {expected.__name__} first, got {type(first).__name__}", file=sys.stderr)
        conn.close()
        return EXIT_USAGE
    return ParentLink(conn, first)
