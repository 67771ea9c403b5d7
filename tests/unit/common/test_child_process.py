"""The socket-pair handshake of the TaskManager's child processes, with real sockets and real children."""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from keyedstate.common.child_process import (
    EXIT_PARENT_GONE,
    EXIT_USAGE,
    ChildProcess,
    ParentLink,
    connect_to_parent,
)
from keyedstate.taskmanager.slot_process import MODULE as SLOT_PROCESS
from keyedstate.taskmanager.snapshot.transfer_protocol import TransferDone, UploadRequest, WorkerSettings
from keyedstate.taskmanager.snapshot.transfer_worker import MODULE as TRANSFER_WORKER


def _pair() -> tuple[Connection, socket.socket]:
    """Our end as a Connection and the child's end as a socket whose descriptor the helper is handed."""
    ours, theirs = socket.socketpair()
    return Connection(ours.detach()), theirs


@pytest.mark.parametrize("argv", [[], ["x"], ["3", "role", "extra"]])
def test_wrong_arguments_print_the_usage_and_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert connect_to_parent(argv, "some.module", WorkerSettings, "transfer process", ("role",)) == EXIT_USAGE
    assert "usage: python -m some.module <socket fd> [<role>]" in capsys.readouterr().err


def test_the_first_message_is_returned_with_the_link() -> None:
    ours, theirs = _pair()
    settings = WorkerSettings(config={"a": 1}, nice=10)
    ours.send(settings)
    link = connect_to_parent([str(theirs.detach()), "checkpoint"], "m", WorkerSettings, "transfer process", ("role",))
    assert isinstance(link, ParentLink) and link.first == settings
    link.conn.send("reply")
    assert ours.recv() == "reply"
    ours.close()
    link.wait_parent_gone()  # returns at once: our end closed
    link.conn.close()


def test_a_parent_that_goes_away_before_speaking_means_exit_0() -> None:
    ours, theirs = _pair()
    ours.close()
    assert connect_to_parent([str(theirs.detach())], "m", WorkerSettings, "transfer process") == EXIT_PARENT_GONE


def test_another_first_message_is_refused_naming_both_types(capsys: pytest.CaptureFixture[str]) -> None:
    ours, theirs = _pair()
    ours.send("not the settings")
    assert connect_to_parent([str(theirs.detach())], "m", WorkerSettings, "transfer process") == EXIT_USAGE
    assert "transfer process: expected WorkerSettings first, got str" in capsys.readouterr().err
    ours.close()


@pytest.mark.parametrize(("module", "usage"), [(SLOT_PROCESS, "<socket fd>"), (TRANSFER_WORKER, "[<role>]")])
def test_both_children_exit_2_with_their_usage_when_started_by_hand(module: str, usage: str) -> None:
    result = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, timeout=60)
    assert result.returncode == EXIT_USAGE
    assert f"usage: python -m {module} <socket fd>" in result.stderr and usage in result.stderr


@pytest.mark.parametrize("module", [SLOT_PROCESS, TRANSFER_WORKER])
def test_a_child_exits_0_when_its_parent_hangs_up_before_the_first_message(module: str) -> None:
    child = ChildProcess(module)
    child.hang_up()
    assert child.wait_exit(60)
    assert child.exit_code() == EXIT_PARENT_GONE
    child.close_socket()


def test_a_child_sent_the_wrong_first_message_exits_2() -> None:
    child = ChildProcess(SLOT_PROCESS)
    child.conn.send(WorkerSettings(config={}, nice=0))  # a transfer process's settings, not a SlotProcessSpec
    assert child.wait_exit(60)
    assert child.exit_code() == EXIT_USAGE
    child.close_socket()


def test_a_transfer_process_serves_until_its_parent_hangs_up(tmp_path: Path) -> None:
    child = ChildProcess(TRANSFER_WORKER, ("checkpoint",))
    child.conn.send(WorkerSettings(config={}, nice=0))
    (tmp_path / "f").write_bytes(b"x" * 10)
    remote = (tmp_path / "out").as_uri()
    child.conn.send(UploadRequest(7, remote, ((str(tmp_path / "f"), f"{remote}/f"),), 1))
    assert child.conn.poll(60), "no reply from the transfer process"
    reply = child.conn.recv()
    assert isinstance(reply, TransferDone) and reply.request_id == 7, reply
    assert [(u.size, u.sha256) for u in reply.uploaded] == [(10, hashlib.sha256(b"x" * 10).hexdigest())]
    assert (tmp_path / "out" / "f").read_bytes() == b"x" * 10
    child.hang_up()
    assert child.wait_exit(60), "the transfer process had to be killed after its parent hung up"
    assert child.exit_code() == 0
    child.close_socket()


def test_wait_exit_kills_a_child_that_does_not_exit() -> None:
    child = ChildProcess(TRANSFER_WORKER, ("checkpoint",))
    child.conn.send(WorkerSettings(config={}, nice=0))
    assert not child.wait_exit(0.2)  # it still serves: our end is open
    code = child.exit_code()
    assert code is not None and code < 0  # killed by a signal
    child.hang_up()
    child.close_socket()
