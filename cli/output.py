"""What statectl's commands print: tables and JSON on stdout, progress on stderr, a closed pipe ended quietly.

rich renders the tables and the progress display. Only the command line imports it: the client
package that PySpark executors import stays free of it (tests/unit/cli checks that).
"""

from __future__ import annotations

import errno
import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from keyedstate.common.rpc.enums import message_to_dict

if TYPE_CHECKING:
    from rich.console import Console

CLOSED_PIPE_EXIT = 141
"""The exit code after stdout's reader went away (``statectl cluster | head``): 128 + SIGPIPE, as a shell reports it."""

# Piped or redirected output is never cut to a terminal's width: scripts split its columns.
_PIPE_WIDTH = 10_000


def _stdout() -> Console:
    # rich is imported when something is drawn: `statectl health`, run by probes every few
    # seconds, draws nothing. Made per call: sys.stdout may have been replaced since (capsys).
    from rich.console import Console

    class PipeAwareConsole(Console):
        """rich's console, leaving a closed pipe to statectl's main (rich would exit 1 by itself)."""

        def on_broken_pipe(self) -> None:
            raise BrokenPipeError(errno.EPIPE, "stdout's reader went away")

    console = PipeAwareConsole(file=sys.stdout, highlight=False, soft_wrap=True)
    if not console.is_terminal:
        console = PipeAwareConsole(file=sys.stdout, highlight=False, soft_wrap=True, width=_PIPE_WIDTH)
    return console


def print_json(message: Any) -> None:
    """A protobuf message or plain data as indented JSON with sorted keys."""
    if hasattr(message, "DESCRIPTOR"):
        message = message_to_dict(message)
    print(json.dumps(message, indent=2, sort_keys=True))


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Aligned columns under a bold header; each row starts at column 0 and cells are split by 2+ spaces.

    Cells are shown as text, never as rich markup (a failure reason may hold brackets).
    """
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, show_edge=False, pad_edge=False, header_style="bold", padding=(0, 1))
    for header in headers:
        table.add_column(header, no_wrap=True)
    for row in rows:
        table.add_row(*(Text(str(cell)) for cell in row))
    console = _stdout()
    with console.capture() as captured:
        console.print(table)
    # rich pads the last column too: trailing blanks would end up in every script's last field.
    print("\n".join(line.rstrip() for line in captured.get().splitlines()))


def print_line(text: str) -> None:
    """One line of plain text on stdout."""
    print(text)


@contextmanager
def progress(description: str, enabled: bool = True) -> Iterator[None]:
    """A spinner with the elapsed time on stderr while the block runs (a terminal only; removed afterwards).

    Nothing is drawn when stderr is not a terminal (scripts, CI, pipes): their stderr keeps only
    the messages that matter.
    """
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(file=sys.stderr)
    if not (enabled and console.is_terminal):
        yield
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, redirect_stdout=False) as shown:
        shown.add_task(description, total=None)
        yield


def end_closed_pipe() -> int:
    """After a BrokenPipeError on stdout: no traceback, and none at interpreter exit either.

    Python flushes stdout once more when it exits; pointing the descriptor at /dev/null makes that
    flush succeed instead of printing "Exception ignored ... BrokenPipeError".
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (captured): nothing will flush it
        pass
    finally:
        os.close(devnull)
    return CLOSED_PIPE_EXIT
