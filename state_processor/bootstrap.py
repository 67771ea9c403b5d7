"""Bootstrapping a savepoint from tables: state for a new job (a backfill), written where a job restores it.

    from keyedstate.state_processor import BootstrapOperator, BootstrapState, StateSerializers, bootstrap_savepoint

    totals = BootstrapState(StateDescriptor("total", StateKind.VALUE), table, StateSerializers("str", "int"))
    bootstrap_savepoint("s3://bucket/savepoints/backfill", [BootstrapOperator("counts", 4, (totals,))])

The data of a state is an Arrow table, a pandas DataFrame or a PySpark DataFrame (collected to the
driver through Arrow) with the columns :mod:`.records` reads back: ``key`` and, by kind, ``value``
(value state), ``value`` per element (list state, in row order or by an ``index`` column), ``user_key``
and ``value`` (map state), or one column per reduce field (reducing state). ``namespace`` (bytes) is
optional. A key twice in a value state, or a user key twice under one key of a map state, is refused;
rows of one key of a reducing state are combined with its reduce functions.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from keyedstate.common.clock import Clock, SystemClock
from keyedstate.common.config import Configuration
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.keygroups import (
    DEFAULT_MAX_PARALLELISM,
    check_parallelism,
    key_group_range_for_subtask,
    key_groups,
    subtask_table,
)
from keyedstate.common.serializers import get_serializer
from keyedstate.common.storage import open_storage
from keyedstate.jobmanager.checkpoint import CheckpointMetadata
from keyedstate.state_processor.records import StateSerializers
from keyedstate.state_processor.writer import OperatorContent, SavepointHeader, SubtaskContent, write_savepoint
from keyedstate.taskmanager.state import layout, values
from keyedstate.taskmanager.state.reducing import Reducer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BootstrapState:
    """One state to write: its descriptor, its rows, and the serializers the job will read it with."""

    descriptor: StateDescriptor
    data: Any
    """A ``pyarrow.Table``, a ``pandas.DataFrame`` or a PySpark ``DataFrame``."""
    serializers: StateSerializers = field(default_factory=StateSerializers)


@dataclass(frozen=True)
class BootstrapOperator:
    """An operator of the new job: its id, parallelism, and the states it starts with."""

    operator_id: str
    parallelism: int
    states: tuple[BootstrapState, ...]


def bootstrap_savepoint(
    path: str,
    operators: Sequence[BootstrapOperator],
    *,
    max_parallelism: int = DEFAULT_MAX_PARALLELISM,
    job_id: str = "bootstrap",
    config: Configuration | Mapping[str, Any] | None = None,
    clock: Clock | None = None,
) -> CheckpointMetadata:
    """Write a savepoint at ``path`` holding ``operators``' states; a job restores it with ``restore_path``."""
    clock = clock or SystemClock()
    conf = config if isinstance(config, Configuration) else Configuration(dict(config or {}))
    contents = [_operator(op, max_parallelism, clock.now_ms()) for op in operators]
    storage = open_storage(path, conf)
    return write_savepoint(storage, path, SavepointHeader(job_id, max_parallelism), contents, clock)


def _operator(op: BootstrapOperator, max_parallelism: int, now_ms: int) -> OperatorContent:
    spec = OperatorSpec(op.operator_id, op.parallelism, tuple(s.descriptor for s in op.states))
    check_parallelism(op.parallelism, max_parallelism)
    owner = subtask_table(max_parallelism, op.parallelism)
    per_subtask: list[dict[str, list[tuple[bytes, bytes]]]] = [{} for _ in range(op.parallelism)]
    for state in op.states:
        where = f"state {state.descriptor.name!r} of operator {op.operator_id!r}"
        for stored_key, stored_value in stored_records(state, max_parallelism, now_ms, where):
            subtask = owner[layout.key_group_of(stored_key)]
            per_subtask[subtask].setdefault(state.descriptor.name, []).append((stored_key, stored_value))
    subtasks = tuple(
        SubtaskContent(
            i,
            key_group_range_for_subtask(max_parallelism, op.parallelism, i),
            {name: sorted(recs) for name, recs in per_subtask[i].items()},
        )
        for i in range(op.parallelism)
    )
    return OperatorContent(spec, subtasks)


def table_columns(data: Any, where: str) -> dict[str, list[Any]]:
    """The columns of an Arrow table, a pandas or a PySpark DataFrame as Python lists."""
    if hasattr(data, "toArrow") and hasattr(data, "sparkSession"):
        data = data.toArrow()
    if hasattr(data, "column_names") and hasattr(data, "to_pydict"):
        out: dict[str, list[Any]] = data.to_pydict()
        return out
    if hasattr(data, "columns") and hasattr(data, "to_dict"):
        return {str(c): data[c].tolist() for c in data.columns}
    raise InvalidArgumentError(
        f"{where}: data must be a pyarrow Table, a pandas DataFrame or a PySpark DataFrame, got {type(data).__name__}"
    )


def _need(cols: Mapping[str, list[Any]], names: Sequence[str], where: str, kind: StateKind) -> None:
    missing = [n for n in names if n not in cols]
    if missing:
        raise InvalidArgumentError(
            f"{where}: {kind.value} state needs the column(s) {list(names)}; missing {missing} (it has {sorted(cols)})"
        )


def stored_records(state: BootstrapState, max_parallelism: int, now_ms: int, where: str) -> list[tuple[bytes, bytes]]:
    """The state's rows as stored (key, value) pairs, unsorted (see taskmanager/state/layout.py)."""
    d = state.descriptor
    if d.kind is StateKind.TIMERS:
        raise InvalidArgumentError(
            f"{where}: timers state cannot be bootstrapped from a table; register timers at run time"
        )
    cols = table_columns(state.data, where)
    _need(cols, ["key"], where, d.kind)
    keys = _encode(state.serializers.key, cols["key"], where, "key")
    groups = key_groups(keys, max_parallelism)
    namespaces = [bytes(n) if n is not None else b"" for n in cols.get("namespace", [b""] * len(keys))]
    prefixes = [layout.key_prefix(g, k, n) for g, k, n in zip(groups, keys, namespaces)]
    headers = _headers(d, cols.get("timestamp_ms"), len(keys), now_ms)
    if d.kind is StateKind.VALUE:
        _need(cols, ["value"], where, d.kind)
        payloads = _encode(state.serializers.value, cols["value"], where, "value")
        return _unique(where, "key", prefixes, [h + p for h, p in zip(headers, payloads)])
    if d.kind is StateKind.MAP:
        _need(cols, ["user_key", "value"], where, d.kind)
        user_keys = _encode(state.serializers.user_key, cols["user_key"], where, "user key")
        payloads = _encode(state.serializers.value, cols["value"], where, "value")
        return _unique(
            where,
            "(key, user key)",
            [p + u for p, u in zip(prefixes, user_keys)],
            [h + p for h, p in zip(headers, payloads)],
        )
    if d.kind is StateKind.LIST:
        _need(cols, ["value"], where, d.kind)
        payloads = _encode(state.serializers.value, cols["value"], where, "value")
        order = sorted(range(len(keys)), key=lambda i: (prefixes[i], cols["index"][i] if "index" in cols else i))
        out: list[tuple[bytes, bytes]] = []
        seq: dict[bytes, int] = {}
        for i in order:
            n = seq.get(prefixes[i], 0)
            seq[prefixes[i]] = n + 1
            out.append((layout.list_element_key(prefixes[i], n), headers[i] + payloads[i]))
        return out
    return _reduced(state, cols, prefixes, headers, where)


def _reduced(
    state: BootstrapState, cols: Mapping[str, list[Any]], prefixes: list[bytes], headers: list[bytes], where: str
) -> list[tuple[bytes, bytes]]:
    d = state.descriptor
    names = [f.name for f in d.reduce_fields]
    _need(cols, names, where, d.kind)
    fmt = d.vector_format
    reducer = Reducer(d)
    combined: dict[bytes, tuple[bytes, bytes]] = {}
    for i, prefix in enumerate(prefixes):
        try:
            vector = fmt.pack(*(cols[n][i] for n in names))
        except Exception as exc:
            raise InvalidArgumentError(
                f"{where}: row {i} does not fit the reduce fields {names} ({exc}); int64 fields need ints, float64 "
                "fields numbers"
            ) from exc
        old = combined.get(prefix)
        combined[prefix] = (headers[i], vector if old is None else reducer.combine(old[1], vector))
    return [(k, h + v) for k, (h, v) in combined.items()]


def _headers(d: StateDescriptor, stamps: list[Any] | None, n: int, now_ms: int) -> list[bytes]:
    """The value headers: a TTL timestamp (``timestamp_ms`` when given, else now) for a state with TTL."""
    codec = values.ValueCodec.for_descriptor(d)
    if not codec.has_ttl:
        return [values.PLAIN_HEADER] * n
    if stamps is None:
        return [codec.header(now_ms)] * n
    return [codec.header(now_ms if s is None else int(s)) for s in stamps]


def _unique(where: str, what: str, keys: list[bytes], stored: list[bytes]) -> list[tuple[bytes, bytes]]:
    seen: dict[bytes, bytes] = {}
    for k, v in zip(keys, stored):
        if k in seen:
            decoded = layout.decode_key(k)
            raise InvalidArgumentError(
                f"{where}: {what} {decoded.key!r}{' / ' + repr(decoded.suffix) if decoded.suffix else ''} appears "
                "twice; a savepoint holds one value per key: deduplicate the rows first"
            )
        seen[k] = v
    return list(seen.items())


def _encode(serializer: Any, items: list[Any], where: str, what: str) -> list[bytes]:
    ser = get_serializer(serializer)
    try:
        encoded: list[bytes] = ser.dumps_many(items)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(
            f"{where}: a {what} does not encode with the {ser.name} serializer: {exc.message}"
        ) from exc
    return encoded
