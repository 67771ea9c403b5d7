"""``statectl inspect PATH``: what a checkpoint or savepoint holds, read offline (no cluster needed).

    statectl inspect s3://bucket/checkpoints/orders/chk-42 -D s3.endpoint=http://...   # the summary
    statectl inspect PATH --json                                                        # the same, as JSON
    statectl inspect PATH --dump jsonl --operator counts --state total --key-serializer str --value-serializer int
    statectl inspect PATH --dump csv --operator counts --state total > total.csv

The summary lists the job-wide fields, every operator's subtasks (key groups, backend, files, bytes),
every state (kind, TTL, keys, entries, bytes), keys and bytes per key group, and the largest keys.
A dump writes one row per stored entry with the columns of :mod:`keyedstate.state_processor.records`;
binary values (keys read with the ``bytes`` serializer, namespaces) are written as base64.

:func:`run` is the command's logic (a stream in, an exit code out); :func:`register` adds it to
statectl's commands. Exit codes: 0 success, 1 the checkpoint cannot be read (missing,
damaged), 2 bad arguments (an unknown operator, state or serializer).
"""

from __future__ import annotations

import argparse
import base64
import csv
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from keyedstate.common.config import Configuration
from keyedstate.common.errors import CheckpointError, ConfigError, InvalidArgumentError, KeyedStateError

if TYPE_CHECKING:
    from keyedstate.state_processor import Savepoint, StateSerializers, Summary

logger = logging.getLogger(__name__)

DUMP_FORMATS = ("jsonl", "csv")


def run(
    path: str,
    out: TextIO,
    err: TextIO | None = None,
    *,
    config: Configuration | Mapping[str, Any] | None = None,
    dump: str | None = None,
    operator: str | None = None,
    state: str | None = None,
    serializers: StateSerializers | None = None,
    largest: int = 10,
    as_json: bool = False,
    include_expired: bool = False,
    progress: bool = False,
) -> int:
    """Inspect ``path``: a summary (text or ``as_json``), or ``dump`` one state as JSON lines or CSV."""
    # Imported here: statectl registers this command at every start, and the readers pull in
    # RocksDB and both daemons' snapshot code, which the other commands never need.
    from keyedstate.state_processor import Savepoint, StateSerializers, read_columns, summarize

    err = err or sys.stderr
    try:
        if dump is not None:
            _check_dump(dump, operator, state)
        with Savepoint.open(path, config) as sp:
            if dump is not None:
                assert operator is not None and state is not None  # _check_dump made sure
                if progress:
                    err.write(f"reading {operator}/{state} of {sp.directory} ...\n")
                cols = read_columns(
                    sp, operator, state, serializers or StateSerializers(), include_expired=include_expired
                )
                (_write_jsonl if dump == "jsonl" else _write_csv)(cols, out)
            else:
                if progress:
                    err.write(f"scanning every state of {sp.directory} ...\n")
                summary = summarize(sp, largest)
                out.write(_summary_json(sp, summary) if as_json else _summary_text(sp, summary))
        out.flush()
        return 0
    except BrokenPipeError:
        return 0  # the reader (head, less) went away: nothing more to show, not an error
    except (InvalidArgumentError, ConfigError) as exc:
        err.write(f"statectl inspect: error: {exc.message}\n")
        return 2
    except (CheckpointError, KeyedStateError) as exc:
        err.write(f"statectl inspect: error: {exc.message}\n")
        return 1


def _check_dump(dump: str, operator: str | None, state: str | None) -> None:
    if dump not in DUMP_FORMATS:
        raise InvalidArgumentError(f"--dump {dump!r}: use one of {', '.join(DUMP_FORMATS)}")
    if not operator or not state:
        raise InvalidArgumentError("--dump needs --operator and --state (the summary lists them)")


# -- the summary --------------------------------------------------------------------------------


def _summary_dict(sp: Savepoint, summary: Summary) -> dict[str, Any]:
    meta = sp.metadata
    per_state: dict[tuple[str, str], list[int]] = {}
    per_group: dict[int, list[int]] = {}
    for g in summary.key_groups:
        s = per_state.setdefault((g.operator_id, g.state), [0, 0, 0])
        s[0], s[1], s[2] = s[0] + g.keys, s[1] + g.entries, s[2] + g.bytes
        kg = per_group.setdefault(g.key_group, [0, 0])
        kg[0], kg[1] = kg[0] + g.keys, kg[1] + g.bytes
    return {
        "path": sp.directory,
        "job_id": meta.job_id,
        "checkpoint_id": meta.checkpoint_id,
        "savepoint": meta.savepoint,
        "timestamp_ms": meta.timestamp_ms,
        "epoch": meta.epoch,
        "max_parallelism": meta.max_parallelism,
        "full_size": meta.full_size,
        "operators": [
            {
                "operator_id": op.operator_id,
                "parallelism": op.parallelism,
                "subtasks": [
                    {
                        "subtask_index": s.subtask_index,
                        "key_groups": [s.key_groups.start, s.key_groups.end],
                        "backend": s.backend,
                        "committed_epoch": s.committed_epoch,
                        "files": len(s.files),
                        "bytes": s.full_size,
                    }
                    for s in op.subtasks
                ],
                "states": [
                    {
                        "name": d.name,
                        "kind": d.kind.value,
                        "ttl_ms": None if d.ttl is None else d.ttl.ttl_ms,
                        "reduce_fields": [f"{f.name}:{f.function.value}:{f.type.value}" for f in d.reduce_fields],
                        "keys": per_state.get((op.operator_id, d.name), [0, 0, 0])[0],
                        "entries": per_state.get((op.operator_id, d.name), [0, 0, 0])[1],
                        "bytes": per_state.get((op.operator_id, d.name), [0, 0, 0])[2],
                    }
                    for d in op.states
                ],
            }
            for op in meta.operators
        ],
        "key_groups": [{"key_group": kg, "keys": v[0], "bytes": v[1]} for kg, v in sorted(per_group.items())],
        "largest_keys": [
            {
                "operator_id": k.operator_id,
                "state": k.state,
                "key_group": k.key_group,
                "key": _show_key(k.key),
                "entries": k.entries,
                "bytes": k.bytes,
            }
            for k in summary.largest_keys
        ],
    }


def _summary_json(sp: Savepoint, summary: Summary) -> str:
    return json.dumps(_summary_dict(sp, summary), indent=2, sort_keys=True) + "\n"


def _summary_text(sp: Savepoint, summary: Summary) -> str:
    d = _summary_dict(sp, summary)
    kind = "savepoint" if d["savepoint"] else "checkpoint"
    lines = [
        f"{kind} {d['checkpoint_id']} of job {d['job_id']} at {d['path']}",
        f"epoch {d['epoch']}, max parallelism {d['max_parallelism']}, {d['full_size']} bytes",
        "",
    ]
    subtasks = [
        [op["operator_id"], s["subtask_index"], "{}-{}".format(*s["key_groups"]), s["backend"], s["files"], s["bytes"]]
        for op in d["operators"]
        for s in op["subtasks"]
    ]
    lines += [_table(["OPERATOR", "SUBTASK", "KEY GROUPS", "BACKEND", "FILES", "BYTES"], subtasks), ""]
    states = [
        [op["operator_id"], s["name"], s["kind"], s["ttl_ms"] or "-", s["keys"], s["entries"], s["bytes"]]
        for op in d["operators"]
        for s in op["states"]
    ]
    lines += [_table(["OPERATOR", "STATE", "KIND", "TTL MS", "KEYS", "ENTRIES", "BYTES"], states), ""]
    groups = [[g["key_group"], g["keys"], g["bytes"]] for g in d["key_groups"]]
    lines += [_table(["KEY GROUP", "KEYS", "BYTES"], groups), ""]
    large = [
        [k["operator_id"], k["state"], k["key_group"], k["key"], k["entries"], k["bytes"]] for k in d["largest_keys"]
    ]
    lines += ["largest keys:", _table(["OPERATOR", "STATE", "KEY GROUP", "KEY", "ENTRIES", "BYTES"], large)]
    return "\n".join(lines) + "\n"


def _show_key(key: bytes) -> str:
    """A key for people: its text when it is printable UTF-8, else ``0x`` and its hex."""
    try:
        text = key.decode("utf-8")
        if text.isprintable():
            return text
    except UnicodeDecodeError:
        pass
    return "0x" + key.hex()


def _table(headers: list[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(out)


# -- dumps ----------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A column value as JSON/CSV can hold it: bytes as base64, tuples as lists."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _write_jsonl(cols: Mapping[str, list[Any]], out: TextIO) -> None:
    names = list(cols)
    for row in zip(*(cols[n] for n in names)):
        out.write(json.dumps({n: _plain(v) for n, v in zip(names, row)}, ensure_ascii=False, default=repr) + "\n")


def _write_csv(cols: Mapping[str, list[Any]], out: TextIO) -> None:
    names = list(cols)
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(names)
    for row in zip(*(cols[n] for n in names)):
        values = [_plain(v) for v in row]
        writer.writerow([json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else v for v in values])


# -- the statectl command ------------------------------------------------------------------------


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``inspect`` to statectl's commands (``sub``: its subparsers; ``common``: --config, -D, --json)."""
    p = sub.add_parser(
        "inspect",
        parents=[common],
        help="what a checkpoint or savepoint holds, read offline (no cluster needed); or dump one state",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("path", metavar="PATH", help="a chk-<n>/ or savepoint directory, or its _metadata (any fsspec URL)")
    p.add_argument("--dump", choices=DUMP_FORMATS, help="dump one state (--operator, --state) instead of the summary")
    p.add_argument("--operator", help="the operator of the state to dump")
    p.add_argument("--state", help="the state to dump")
    p.add_argument("--key-serializer", default="bytes", help="how the job serialized keys (default: bytes)")
    p.add_argument("--value-serializer", default="bytes", help="how the job serialized values (default: bytes)")
    p.add_argument("--user-key-serializer", default="bytes", help="map state: how user keys were serialized")
    p.add_argument("--largest", type=_count, default=10, help="how many of the largest keys to list (default: 10)")
    p.add_argument("--include-expired", action="store_true", help="dump values whose TTL expired too")
    p.add_argument("--quiet", action="store_true", help="say nothing on stderr about what is being read")
    p.set_defaults(fn=_command)


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; give 0 or more")
    return value


def _command(args: argparse.Namespace) -> int:
    """statectl's entry: a bad --config or -D raises ConfigError, which statectl turns into exit 2."""
    from keyedstate.state_processor import StateSerializers

    conf = Configuration.load(args.config, args.overrides)
    return run(
        args.path,
        sys.stdout,
        sys.stderr,
        config=conf,
        dump=args.dump,
        operator=args.operator,
        state=args.state,
        serializers=StateSerializers(args.key_serializer, args.value_serializer, args.user_key_serializer),
        largest=args.largest,
        as_json=args.json,
        include_expired=args.include_expired,
        progress=not args.quiet,
    )
