"""statectl argument handling and the configuration reference (no cluster needed)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from keyedstate.cli import statectl
from keyedstate.common.config import options


def _exit_code(argv: list[str]) -> int:
    try:
        return statectl.main(argv)
    except SystemExit as exc:  # argparse exits by itself on usage errors
        return int(exc.code or 0)


@pytest.mark.parametrize(
    "argv,fragment",
    [
        ([], "the following arguments are required: command"),
        (["bogus"], "invalid choice: 'bogus'"),
        (["cluster", "--bogus"], "unrecognized arguments: --bogus"),
        (["job", "frob"], "invalid choice: 'frob'"),
        (["checkpoint", "trigger"], "the following arguments are required: job"),
        (["cluster", "--timeout", "soon"], "invalid float value: 'soon'"),
        (["job", "rescale", "j", "--parallelism", "two"], "invalid int value: 'two'"),
    ],
)
def test_bad_arguments_exit_2_with_usage(capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str) -> None:
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err
    assert "usage: statectl" in err and fragment in err


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["checkpoint", "trigger", "bad id"], "invalid job id 'bad id'"),
        (["savepoint", "../up"], "invalid job id '../up'"),
    ],
)
def test_invalid_job_id_exits_2_with_usage_before_connecting(
    capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str
) -> None:
    # No --jobmanager: the id is refused before any connection is attempted.
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err
    assert "usage: statectl" in err and fragment in err and "[A-Za-z0-9_.-]" in err


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["job", "info", "--jobmanager", "127.0.0.1:1"], "statectl job info needs a JOB id"),
        (["job", "rescale", "j", "--jobmanager", "127.0.0.1:1"], "needs --parallelism N"),
        (["job", "restore", "j", "--jobmanager", "127.0.0.1:1"], "needs --from PATH"),
        (
            ["job", "restore", "j", "--from", "/x", "--claim-mode", "legacy", "--jobmanager", "127.0.0.1:1"],
            "--claim-mode: restore mode LEGACY was removed in Flink 2.0",
        ),
        (
            ["job", "restore", "j", "--from", "/x", "--claim-mode", "all", "--jobmanager", "127.0.0.1:1"],
            "--claim-mode: 'all' is not a claim mode; use CLAIM or NO_CLAIM",
        ),
        (["cluster", "-D", "no-equals"], "-D 'no-equals': expected key=value"),
        (["cluster", "-D", "jobmanager.rpc.port=abc"], "jobmanager.rpc.port: expected an integer"),
        (["cluster", "--config", "/no/such/file.yaml"], "cannot read config file /no/such/file.yaml"),
        (
            ["checkpoint", "gc", "j", "--dir", "jobmanager://a1b2c3/", "--jobmanager", "127.0.0.1:1"],
            "jobmanager://a1b2c3/ is in a JobManager's memory (execution.checkpointing.storage: jobmanager)",
        ),
        (
            ["checkpoint", "gc", "j", "-D", "state.backend.type=forst", "--jobmanager", "127.0.0.1:1"],
            "state.backend.type: 'forst' is not supported: ForSt keeps the working state on remote storage",
        ),
    ],
)
def test_bad_values_exit_2_naming_the_fix(capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str) -> None:
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("statectl: ") and fragment in err


def test_config_docs_prints_every_key_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["config", "docs"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| `")]
    documented = [row.split("`")[1] for row in rows]
    assert documented == [o.key for o in options.ALL]
    assert len(set(documented)) == len(documented), "a key is declared twice in options.py"
    for option in options.ALL:
        [row] = [r for r in rows if r.startswith(f"| `{option.key}` |")]
        assert f"| {option.type_name} |" in row and option.description.split(";")[0][:40] in row
        for legacy in option.fallback_keys:
            assert f"`{legacy}`" in row
    # Spot checks of rendered defaults.
    assert "| `heartbeat.timeout` | duration | `50000 ms` |" in out
    assert "| `state.limits.max-key-bytes` | memory | `64kb` |" in out
    assert "| `state.backend.rocksdb.localdir` | string | `<tmp>/keyedstate` |" in out


def test_config_docs_through_the_entry_point() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "keyedstate.cli.statectl", "config", "docs"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    for option in options.ALL:
        assert f"| `{option.key}` |" in result.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "10.0.0.1:6123", "cluster"],
        ["cluster", "-m", "10.0.0.1:6123"],
        ["--jobmanager", "10.0.0.1:6123", "--json", "--timeout", "5", "job", "list"],
        ["-D", "a=1", "job", "list", "-m", "10.0.0.1:6123", "-D", "b=2"],
    ],
)
def test_common_options_are_accepted_before_or_after_the_command(argv: list[str]) -> None:
    args = statectl._apply_common_defaults(statectl.build_parser().parse_args(argv))
    assert args.jobmanager == "10.0.0.1:6123"
    if "--timeout" in argv:
        assert args.timeout == 5.0 and args.json is True
    else:
        assert args.timeout == 30.0 and args.json is False
    if "-D" in argv:
        assert args.overrides == ["a=1", "b=2"]  # both places apply, the later one last


def test_an_option_after_the_command_wins_and_defaults_follow_the_command() -> None:
    parser = statectl.build_parser()
    args = statectl._apply_common_defaults(parser.parse_args(["-m", "a:1", "--timeout", "5", "cluster", "-m", "b:2"]))
    assert (args.jobmanager, args.timeout, args.overrides, args.config) == ("b:2", 5.0, [], None)
    assert statectl._apply_common_defaults(parser.parse_args(["savepoint", "j"])).timeout == 600.0
    assert statectl._apply_common_defaults(parser.parse_args(["--timeout", "9", "savepoint", "j"])).timeout == 9.0


def test_a_command_registered_from_its_own_module_gets_the_common_options_and_error_handling(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The contract EXTRA_COMMANDS offers (statectl inspect, cli/inspect.py, is wired through it)."""
    from keyedstate.common.errors import InvalidArgumentError

    seen: list[Any] = []

    def demo(args: Any) -> int:
        seen.append(args)
        if args.path == "bad":
            raise InvalidArgumentError("demo: PATH 'bad' is not a checkpoint")
        return 0

    def register(sub: statectl.Subcommands, common: Any) -> None:
        p = sub.add_parser("demo", parents=[common], help="a demo command")
        p.add_argument("path")
        p.set_defaults(fn=demo)

    monkeypatch.setattr(statectl, "EXTRA_COMMANDS", (register,))
    assert statectl.main(["demo", "chk-1", "--json", "-D", "a=b"]) == 0
    assert (seen[0].path, seen[0].json, seen[0].overrides, seen[0].timeout) == ("chk-1", True, ["a=b"], 30.0)
    assert statectl.main(["demo", "bad"]) == 2
    assert capsys.readouterr().err == "statectl: demo: PATH 'bad' is not a checkpoint\n"
    assert "demo" in statectl.build_parser().format_help()
