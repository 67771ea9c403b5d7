"""``statectl``: operate a keyedstate cluster from the shell.

    statectl cluster [--json] [--wait N]            TaskManagers, slots, slot processes, jobs (--wait: until N registered)
    statectl job list|info|cancel JOB
    statectl job restore JOB --from PATH [--claim-mode CLAIM|NO_CLAIM]
                                                    replace JOB's state with a checkpoint or savepoint (verified first)
    statectl job rescale JOB --parallelism N
    statectl checkpoint trigger|list JOB
    statectl checkpoint gc JOB [--dry-run]          remove orphaned checkpoint files
    statectl savepoint JOB [--dir PATH]
    statectl health [--service S]                   grpc.health.v1 status of the port given with -m (exit 0: SERVING)
    statectl config docs                            the configuration reference (Markdown)
    statectl config show                            the effective configuration (secrets shown as ******)
    statectl auth token NAME --role R [--jobs J,..] --out FILE
                                                    create a token: the token goes to FILE (mode 600), the
                                                    tokens-file entry (its hash) to stdout

Authentication (security.auth.enabled): statectl sends the token in security.auth.token-file, else
the file named by KEYEDSTATE_TOKEN_FILE, else KEYEDSTATE_TOKEN. A token on the command line is refused:
every user of the host can read a command line.

Every command takes --jobmanager/-m HOST:PORT (default from --config / -D jobmanager.rpc.*), --config,
-D, --json and --timeout, before the command (statectl -m HOST:PORT cluster) or after it.
Exit codes: 0 success, 1 the operation failed (a checkpoint or savepoint that did not complete, or
is still running when --timeout passes, is a failure), 2 bad arguments or configuration, 141 the
reader of stdout went away (`statectl cluster | head`). `statectl --version` prints the version.

Tables are drawn by rich; long operations (savepoint, checkpoint trigger, job restore and rescale,
checkpoint gc) show a spinner with the elapsed time on stderr when it is a terminal.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, Protocol

from google.protobuf import json_format

from keyedstate.cli import inspect
from keyedstate.cli.output import end_closed_pipe, print_json, print_table, progress
from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.claim_mode import RecoveryClaimMode
from keyedstate.common.config import Configuration
from keyedstate.common.config import options as o
from keyedstate.common.errors import CapacityError, ConfigError, InvalidArgumentError, KeyedStateError, UnavailableError
from keyedstate.common.keygroups import past_max_parallelism
from keyedstate.common.rpc.enums import name_of
from keyedstate.common.version import version_line


def _client(args: argparse.Namespace) -> Any:
    from keyedstate.common.auth import token_from_config
    from keyedstate.common.client import ClientSettings, StateClient, client_security

    conf = Configuration.load(args.config, args.overrides)
    address = args.jobmanager or f"{conf.get(o.JOBMANAGER_ADDRESS)}:{conf.get(o.JOBMANAGER_PORT)}"
    settings = ClientSettings.from_config(conf)
    # A CLI should fail fast when the JobManager is down, not retry for a minute.
    settings = ClientSettings(
        timeout_s=args.timeout,
        max_attempts=2,
        backoff_s=0.2,
        batch_size=settings.batch_size,
        max_in_flight=settings.max_in_flight,
    )
    return StateClient(address, settings, client_security(conf), token=token_from_config(conf))


# -- commands ----------------------------------------------------------------------------------


def cmd_cluster(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.wait:
            # Ready means registered: scripts start jobs only after this returns 0.
            try:
                overview = client.wait_for_taskmanagers(args.wait, timeout_s=args.timeout)
            except UnavailableError as exc:
                print(f"statectl: {exc.message} (--timeout {args.timeout:g} s)", file=sys.stderr)  # names its own fix
                return 1
        else:
            overview = client.cluster()
    if args.json:
        print_json(overview)
        return 0
    print(f"TaskManagers: {len(overview.taskmanagers)}   slots: {overview.total_slots}   free: {overview.free_slots}")
    print()
    rows = []
    for tm in overview.taskmanagers:
        used = [f"{s.slot_index}:{s.job_id}/{s.operator_id}/{s.subtask_index}" for s in tm.slots if s.job_id]
        rows.append(
            [
                tm.taskmanager_id,
                tm.address,
                name_of(jm_pb.TaskManagerStatus, tm.status),
                tm.num_slots,
                tm.free_slots,
                f"{tm.last_heartbeat_age_ms} ms",
                ", ".join(used) or "-",
            ]
        )
    print_table(["TASKMANAGER", "ADDRESS", "STATUS", "SLOTS", "FREE", "HEARTBEAT", "ASSIGNED"], rows)
    print()
    processes = [
        [
            tm.taskmanager_id,
            p.index,
            ", ".join(str(i) for i in range(p.index, tm.num_slots, len(tm.slot_processes))),
            p.address,
            p.pid or "replacing",
        ]
        for tm in overview.taskmanagers
        for p in tm.slot_processes
    ]
    if processes:  # only TaskManagers with taskmanager.slot-processes > 1 have them
        print_table(["TASKMANAGER", "SLOT-PROCESS", "SLOTS", "ADDRESS", "PID"], processes)
        print()
    jobs = [
        [
            j.job_id,
            name_of(pb.JobStatus, j.status),
            ", ".join(f"{op.operator_id}x{op.parallelism}" for op in j.operators),
            j.max_parallelism,
            j.latest_checkpoint_id or "-",
            j.committed_epoch,
            j.failure_cause or "-",
        ]
        for j in overview.jobs
    ]
    print_table(["JOB", "STATUS", "OPERATORS", "MAX-PAR", "CHECKPOINT", "EPOCH", "FAILURE"], jobs)
    return 0


def cmd_job(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.action == "list":
            overview = client.cluster()
            if args.json:
                print_json(
                    {"jobs": [json_format.MessageToDict(j, preserving_proto_field_name=True) for j in overview.jobs]}
                )
            else:
                print_table(
                    ["JOB", "STATUS", "CHECKPOINT"],
                    [[j.job_id, name_of(pb.JobStatus, j.status), j.latest_checkpoint_id or "-"] for j in overview.jobs],
                )
            return 0
        if not args.job:
            raise InvalidArgumentError(f"statectl job {args.action} needs a JOB id")
        if args.action == "info":
            print_json(client.job_info(args.job))
        elif args.action == "cancel":
            info = client.cancel_job(args.job)
            print(f"job {info.job_id} {name_of(pb.JobStatus, info.status)}")
        elif args.action == "restore":
            if not args.source:
                raise InvalidArgumentError("statectl job restore needs --from PATH (a chk-<n> or savepoint directory)")
            # One call: the JobManager verifies the source before it touches the job (never cancel-then-submit).
            mode = RecoveryClaimMode.parse(args.claim_mode, "--claim-mode") if args.claim_mode else None
            with progress(f"restoring job {args.job} from {args.source}", not args.json):
                routing = client.restore_job(args.job, args.source, claim_mode=mode)
            shown = f", claim mode {mode.value}" if mode is not None else ""
            print(f"job {args.job} restored from {args.source}{shown} (routing v{routing.version})")
        elif args.action == "rescale":
            if not args.parallelism:
                raise InvalidArgumentError("statectl job rescale needs --parallelism N")
            _check_rescale_capacity(client, args.job, args.parallelism)
            with progress(f"rescaling job {args.job} to parallelism {args.parallelism}", not args.json):
                routing = client.rescale_job(args.job, args.parallelism, timeout_s=args.timeout)
            print(f"job {args.job} rescaled to parallelism {args.parallelism} (routing v{routing.version})")
    return 0


def _check_rescale_capacity(client: Any, job_id: str, parallelism: int) -> None:
    """Refuse a rescale the cluster has no slots for before the JobManager stops the job for it."""
    overview = client.cluster()
    job = next((j for j in overview.jobs if j.job_id == job_id), None)
    if job is None or job.status != pb.JOB_STATUS_RUNNING:
        return  # the JobManager gives the precise error
    if parallelism > job.max_parallelism:
        raise InvalidArgumentError(past_max_parallelism(job_id, parallelism, job.max_parallelism))
    held = sum(op.parallelism for op in job.operators)
    needed = parallelism * len(job.operators)
    available = overview.free_slots + held
    if needed > available:
        raise CapacityError(
            f"rescaling job {job_id} to parallelism {parallelism} needs {needed} slots but only {available} are "
            f"available ({overview.free_slots} free and {held} the job holds); start more TaskManagers first. "
            "The job keeps running at its current parallelism"
        )


def cmd_checkpoint(args: argparse.Namespace) -> int:
    if args.action == "gc":
        from keyedstate.jobmanager.checkpoint_gc_cli import run_gc

        with progress(f"collecting orphaned checkpoint files of job {args.job}", not args.json):
            return run_gc(args)
    with _client(args) as client:
        if args.action == "trigger":
            with progress(f"checkpoint of job {args.job}", not (args.json or args.no_wait)):
                info = client.trigger_checkpoint(args.job, wait=not args.no_wait, timeout_s=args.timeout)
            return _report_checkpoint(info, args, waited=not args.no_wait)
        if args.action == "list":
            listing = client.list_checkpoints(args.job)
            if args.json:
                print_json(listing)
            else:
                print_table(
                    ["ID", "STATUS", "KIND", "EPOCH", "DURATION", "FULL", "INCREMENTAL", "PATH/REASON"],
                    [
                        [
                            c.checkpoint_id,
                            name_of(jm_pb.CheckpointStatus, c.status),
                            "savepoint" if c.savepoint else "checkpoint",
                            c.epoch,
                            f"{c.duration_ms} ms",
                            c.full_size,
                            c.incremental_size,
                            c.path or c.failure_reason,
                        ]
                        for c in listing.checkpoints
                    ],
                )
    return 0


def cmd_savepoint(args: argparse.Namespace) -> int:
    with _client(args) as client, progress(f"savepoint of job {args.job}", not args.json):
        info = client.trigger_checkpoint(
            args.job, savepoint=True, target_directory=args.dir or "", timeout_s=args.timeout
        )
    return _report_checkpoint(info, args)


def _report_checkpoint(info: Any, args: argparse.Namespace, waited: bool = True) -> int:
    """Print the outcome; exit 0 only for a completed one (or, without waiting, one that started)."""
    # A savepoint refused before it started comes back without the flag: the command says what it was.
    kind = "savepoint" if info.savepoint or args.command == "savepoint" else "checkpoint"
    if args.json:
        print_json(info)
    elif info.status == jm_pb.CHECKPOINT_STATUS_COMPLETED:
        print(f"{kind} {info.checkpoint_id} completed in {info.duration_ms} ms: {info.path}")
    elif info.status == jm_pb.CHECKPOINT_STATUS_IN_PROGRESS and waited:
        # Not a success: a script must not go on (cancel the job, move the savepoint) as if it were.
        print(
            f"statectl: {kind} {info.checkpoint_id} did not complete within --timeout {args.timeout:g} s; it may "
            f"still complete: `statectl checkpoint list {args.job}` shows when it does, or run it again with a "
            f"larger --timeout: {info.failure_reason or info.path}",
            file=sys.stderr,
        )
    elif info.status == jm_pb.CHECKPOINT_STATUS_IN_PROGRESS:
        print(f"{kind} {info.checkpoint_id} triggered: {info.path}")
    else:
        print(
            f"statectl: {kind}{f' {info.checkpoint_id}' if info.checkpoint_id else ''} "
            f"{name_of(jm_pb.CheckpointStatus, info.status)}: {info.failure_reason or info.path}",
            file=sys.stderr,
        )
    if info.status == jm_pb.CHECKPOINT_STATUS_COMPLETED or (
        info.status == jm_pb.CHECKPOINT_STATUS_IN_PROGRESS and not waited
    ):
        return 0
    return 1


def cmd_health(args: argparse.Namespace) -> int:
    """One grpc.health.v1 check of a daemon's port (what the Kubernetes probes and the image's HEALTHCHECK run)."""
    # Not through keyedstate.common.client: a probe every few seconds should not load numpy and pyarrow.
    from keyedstate.common.rpc.health import check_health
    from keyedstate.common.security.tls import REST
    from keyedstate.common.security.transport import TransportSecurity

    conf = Configuration.load(args.config, args.overrides)
    address = args.jobmanager or f"{conf.get(o.JOBMANAGER_ADDRESS)}:{conf.get(o.JOBMANAGER_PORT)}"
    security = TransportSecurity.from_config(conf, role="client").channel_security(REST)
    status = check_health(address, service=args.service, security=security, timeout_s=args.timeout)
    if args.json:
        print_json({"address": address, "service": args.service, "status": status})
    else:
        print(f"{address}{' ' + args.service if args.service else ''}: {status}")
    return 0 if status == "SERVING" else 1


def cmd_config(args: argparse.Namespace) -> int:
    if args.action == "docs":
        print(o.docs_markdown(), end="")
        return 0
    conf = Configuration.load(args.config, args.overrides)
    shown = conf.redacted()
    if args.json:
        print_json(shown)
    else:
        for key in sorted(shown):
            print(f"{key}: {shown[key]}")
    return 0


def cmd_auth(args: argparse.Namespace) -> int:
    """Create a token: written to --out (0600) only; stdout gets the tokens-file entry, which holds its hash."""
    import os

    import yaml

    from keyedstate.common.auth import ALL_JOBS, Role, TokenEntry, hash_token, new_token

    try:
        role = Role(args.role)
    except ValueError:
        raise InvalidArgumentError(f"--role {args.role!r} is not one of {', '.join(r.value for r in Role)}") from None
    jobs = [j.strip() for j in (args.jobs or ALL_JOBS).split(",") if j.strip()]
    from keyedstate.common.auth import parse_entry

    token = new_token()
    entry: TokenEntry = parse_entry(
        {"name": args.name, "sha256": hash_token(token), "role": role.value, "jobs": jobs}, "the new token"
    )
    try:
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise InvalidArgumentError(
            f"--out {args.out} exists; choose a new file (a token is never overwritten)"
        ) from None
    except OSError as exc:
        raise InvalidArgumentError(f"cannot create --out {args.out}: {exc.strerror}") from None
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    print("# add to the tokens file (security.auth.tokens-file) of the JobManager and TaskManagers:")
    print(yaml.safe_dump({"tokens": [entry.to_dict()]}, sort_keys=False), end="")
    print(
        f"# the token is in {args.out} (mode 600); give it to its user as security.auth.token-file or KEYEDSTATE_TOKEN_FILE",
        file=sys.stderr,
    )
    return 0


_DEFAULT_TIMEOUT_S = 30.0
# A savepoint copies the whole state; a health check answers at once or the daemon is unwell.
_COMMAND_TIMEOUT_S = {"savepoint": 600.0, "health": 5.0}


def _add_common_options(parser: argparse.ArgumentParser, overrides_dest: str) -> None:
    """The options every command takes, accepted before the command as well as after it.

    Their defaults are suppressed so that a value given before the command is not overwritten
    by the command's parser; :func:`_apply_common_defaults` fills in what neither place set.
    """
    s = argparse.SUPPRESS
    parser.add_argument("--jobmanager", "-m", metavar="HOST:PORT", default=s, help="JobManager address")
    parser.add_argument(
        "--config", "-c", metavar="FILE", default=s, help="YAML config (for jobmanager.rpc.* and storage keys)"
    )
    parser.add_argument("-D", dest=overrides_dest, action="append", default=s, metavar="KEY=VALUE")
    parser.add_argument("--json", action="store_true", default=s, help="print JSON instead of tables")
    parser.add_argument(
        "--timeout",
        type=float,
        default=s,
        help=f"seconds to wait for the JobManager (default {_DEFAULT_TIMEOUT_S:g}; "
        + "; ".join(f"{name}: {seconds:g}" for name, seconds in _COMMAND_TIMEOUT_S.items())
        + ")",
    )
    # Accepted only to refuse it with the safer way (see main).
    parser.add_argument("--token", dest="token_on_command_line", default=s, help=argparse.SUPPRESS)


def _apply_common_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Defaults for the common options; -D given before and after the command both apply (after wins)."""
    for name, default in (("jobmanager", None), ("config", None), ("json", False)):
        if not hasattr(args, name):
            setattr(args, name, default)
    if not hasattr(args, "timeout"):
        args.timeout = _COMMAND_TIMEOUT_S.get(args.command, _DEFAULT_TIMEOUT_S)
    args.overrides = [*getattr(args, "global_overrides", []), *getattr(args, "overrides", [])]
    if hasattr(args, "global_overrides"):
        del args.global_overrides
    return args


class Subcommands(Protocol):
    """What ``add_subparsers()`` returns, as far as a registrar uses it."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


Registrar = Callable[[Subcommands, argparse.ArgumentParser], None]
"""Adds one command: ``register(sub, common)`` calls ``sub.add_parser(NAME, parents=[common], help=...)``
(``common`` carries --jobmanager, --config, -D, --json and --timeout), adds the command's own
options, and ``set_defaults(fn=...)`` with a function of the parsed arguments returning the exit
code. Inside it, keyedstate.cli.output prints tables, JSON and progress; errors are raised as
KeyedStateError subclasses (ConfigError/InvalidArgumentError exit 2, the others exit 1)."""

EXTRA_COMMANDS: tuple[Registrar, ...] = (inspect.register,)
"""Commands kept in modules of their own; ``statectl inspect`` (cli/inspect.py) registers here."""


def _actions(parser: argparse.ArgumentParser) -> Subcommands:
    """The second word of a command (``job restore``): each action has its own options and --help.

    The common options go before the command or after the action, not between the two.
    """
    return parser.add_subparsers(dest="action", required=True, metavar="ACTION")


def _add_job_commands(sub: Subcommands, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("job", help="list, inspect, cancel, restore or rescale jobs")
    p.set_defaults(fn=cmd_job)
    actions = _actions(p)
    actions.add_parser("list", parents=[common], help="every job with its status and latest checkpoint")
    # JOB is checked by cmd_job, so that a missing one is named with the command (exit 2).
    for name, text in (("info", "the job's status, operators, states and restarts (JSON)"), ("cancel", "cancel it")):
        actions.add_parser(name, parents=[common], help=text).add_argument("job", nargs="?")
    a = actions.add_parser(
        "restore",
        parents=[common],
        help="replace the job's state with a checkpoint or savepoint (verified first)",
        description="The JobManager verifies the source in full before it touches the job; a failed restore "
        "leaves the job as it was.",
    )
    a.add_argument("job", nargs="?")
    a.add_argument("--from", dest="source", metavar="PATH", help="a chk-<n> or savepoint directory (any fsspec URL)")
    a.add_argument(
        "--claim-mode",
        metavar="MODE",
        help="who owns the source's files afterwards: NO_CLAIM (the user: never deleted, the first checkpoint is "
        "full) or CLAIM (the job: deleted once subsumed; incremental from the start for a checkpoint of the job's "
        "own directory). Default: the job's execution.state-recovery.claim-mode (NO_CLAIM)",
    )
    a = actions.add_parser("rescale", parents=[common], help="run every operator at a new parallelism")
    a.add_argument("job", nargs="?")
    a.add_argument("--parallelism", type=int, metavar="N", help="the new parallelism of every operator")


def _add_checkpoint_commands(sub: Subcommands, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("checkpoint", help="trigger, list or garbage-collect checkpoints")
    p.set_defaults(fn=cmd_checkpoint)
    actions = _actions(p)
    a = actions.add_parser("trigger", parents=[common], help="take a checkpoint now; exit 0 once it completed")
    a.add_argument("job")
    a.add_argument("--no-wait", action="store_true", help="return once triggered")
    a = actions.add_parser("list", parents=[common], help="completed, failed and running checkpoints and savepoints")
    a.add_argument("job")
    a = actions.add_parser(
        "gc",
        parents=[common],
        help="remove orphaned checkpoint files",
        description="Removes the files of JOB's checkpoint directory that no retained checkpoint references.",
    )
    a.add_argument("job")
    a.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    a.add_argument("--dir", help="the checkpoint directory (default state.checkpoints.dir)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="statectl", description="Operate a keyedstate cluster.")
    parser.add_argument("--version", action="version", version=version_line("statectl"))
    _add_common_options(parser, "global_overrides")
    common = argparse.ArgumentParser(add_help=False)
    _add_common_options(common, "overrides")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("cluster", parents=[common], help="TaskManagers, slots and jobs")
    p.add_argument(
        "--wait",
        type=int,
        metavar="N",
        default=0,
        help="first wait (up to --timeout) until N TaskManagers are registered; exit 1 if they are not",
    )
    p.set_defaults(fn=cmd_cluster)

    _add_job_commands(sub, common)
    _add_checkpoint_commands(sub, common)

    p = sub.add_parser("savepoint", parents=[common], help="write a self-contained, relocatable savepoint")
    p.add_argument("job")
    p.add_argument("--dir", help="target directory (default state.savepoints.dir)")
    p.set_defaults(fn=cmd_savepoint)

    p = sub.add_parser(
        "health",
        parents=[common],
        help="ask a daemon's port for its grpc.health.v1 status (exit 0 only when SERVING)",
        description="One health check of the port given with --jobmanager/-m (a JobManager's or a TaskManager's). "
        "With TLS, --config names security.ssl.rest.ca (and security.ssl.rest.server-name when the certificate "
        "does not name the address dialled). Needs no token.",
    )
    p.add_argument("--service", default="", help="a service name (default: the whole daemon)")
    p.set_defaults(fn=cmd_health)

    p = sub.add_parser("config", parents=[common], help="configuration reference, or the effective configuration")
    p.add_argument("action", choices=["docs", "show"])
    p.set_defaults(fn=cmd_config)

    p = sub.add_parser("auth", parents=[common], help="create tokens (security.auth.*)")
    p.add_argument("action", choices=["token"])
    p.add_argument("name", help="the token's name (shows in logs and refusals)")
    p.add_argument("--role", required=True, help="admin, writer, reader, taskmanager or jobmanager")
    p.add_argument("--jobs", help="comma-separated job ids it may touch (default: * = all)")
    p.add_argument("--out", required=True, help="new file to write the token to (mode 600)")
    p.set_defaults(fn=cmd_auth)

    for register in EXTRA_COMMANDS:
        register(sub, common)
    return parser


_TOKEN_REFUSAL = (
    "a token on the command line can be read by every user of this host (ps, /proc); put it in a file readable only "
    "by you (chmod 600) and pass -D security.auth.token-file=PATH, or set KEYEDSTATE_TOKEN_FILE=PATH (or KEYEDSTATE_TOKEN)"
)


def _refuse_secrets_on_command_line(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from keyedstate.common.config import SAFER_WAYS, secret_overrides

    if getattr(args, "token_on_command_line", None) is not None:
        parser.error(f"--token is refused: {_TOKEN_REFUSAL}")
    for key in secret_overrides(getattr(args, "overrides", [])):
        if any(word in key.lower() for word in ("token", "password", "passwd")):
            parser.error(f"-D {key}=... is refused: {_TOKEN_REFUSAL}")
        print(
            f"statectl: warning: secret {key} was given with -D, so any user on this host can read it in the "
            f"process list; instead {SAFER_WAYS}",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = _apply_common_defaults(parser.parse_args(argv))
    _refuse_secrets_on_command_line(args, parser)
    if getattr(args, "job", None) is not None and args.command != "job":
        from keyedstate.common.ids import validate_id

        try:
            validate_id("job id", args.job)
        except InvalidArgumentError as exc:
            parser.error(str(exc))
    fn: Callable[[argparse.Namespace], int] = args.fn
    try:
        code = fn(args)
        sys.stdout.flush()  # here, so that a closed pipe is reported below and not at exit
        return code
    except BrokenPipeError:
        # `statectl cluster | head`: the reader has what it wanted; no traceback for that.
        return end_closed_pipe()
    except (ConfigError, InvalidArgumentError) as exc:
        print(f"statectl: {exc}", file=sys.stderr)
        return 2
    except UnavailableError as exc:
        print(f"statectl: {exc}", file=sys.stderr)
        print(
            "statectl: is the JobManager running and reachable? Point statectl at it with --jobmanager HOST:PORT "
            "(or jobmanager.rpc.address and jobmanager.rpc.port in --config / -D)",
            file=sys.stderr,
        )
        return 1
    except KeyedStateError as exc:
        print(f"statectl: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
