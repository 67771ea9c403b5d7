"""Transforming a savepoint: drop a state or an operator, rename an operator, map a state's values.

    from keyedstate.state_processor import MapValues, RenameOperator, Savepoint, transform_savepoint

    with Savepoint.open(src) as sp:
        transform_savepoint(sp, dst, [RenameOperator("counts", "totals"),
                                      MapValues("totals", "total", lambda key, v: v * 100, StateSerializers("str", "int"))])

The result keeps the source's job-wide fields (checkpoint id, epoch and its lineage, max
parallelism), every operator's parallelism and key-group ranges, each subtask's committed epoch,
and every untouched entry byte for byte (TTL timestamps included). A mapped value keeps its
timestamp; a function returning None removes the entry (list elements close up).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from keyedstate.common.clock import Clock
from keyedstate.common.config import Configuration
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.ids import validate_id
from keyedstate.common.serializers import get_serializer
from keyedstate.common.storage import open_storage
from keyedstate.jobmanager.checkpoint import CheckpointMetadata
from keyedstate.jobmanager.checkpoint.metadata import OperatorSnapshot
from keyedstate.state_processor.records import StateSerializers
from keyedstate.state_processor.savepoint import RawEntry, Savepoint
from keyedstate.state_processor.writer import OperatorContent, SavepointHeader, SubtaskContent, write_savepoint
from keyedstate.taskmanager.state import layout, values

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DropState:
    """Remove ``state`` of ``operator_id`` (the restored job no longer declares it)."""

    operator_id: str
    state: str


@dataclass(frozen=True)
class DropOperator:
    """Remove every state of ``operator_id``."""

    operator_id: str


@dataclass(frozen=True)
class RenameOperator:
    """Give operator ``old`` the id ``new`` (the state follows it)."""

    old: str
    new: str


@dataclass(frozen=True)
class MapValues:
    """Replace each value of ``state`` with ``fn(key, value)``; None removes the entry.

    ``value`` is the decoded value (a tuple of the fields for reducing state); ``operator_id`` is
    the id in the source savepoint.
    """

    operator_id: str
    state: str
    fn: Callable[[Any, Any], Any]
    serializers: StateSerializers = field(default_factory=StateSerializers)


Transformation = DropState | DropOperator | RenameOperator | MapValues


def transform_savepoint(
    source: Savepoint,
    path: str,
    transformations: Sequence[Transformation],
    *,
    config: Configuration | Mapping[str, Any] | None = None,
    clock: Clock | None = None,
) -> CheckpointMetadata:
    """Write the transformed copy of ``source`` as a new savepoint at ``path``."""
    _check(source, transformations)
    dropped_ops = {t.operator_id for t in transformations if isinstance(t, DropOperator)}
    renames = {t.old: t.new for t in transformations if isinstance(t, RenameOperator)}
    contents = [
        _operator(source, op, renames.get(op.operator_id, op.operator_id), transformations)
        for op in source.operators
        if op.operator_id not in dropped_ops
    ]
    meta = source.metadata
    header = SavepointHeader(meta.job_id, meta.max_parallelism, meta.checkpoint_id, meta.epoch, meta.lineage)
    conf = config if isinstance(config, Configuration) else Configuration(dict(config or {}))
    return write_savepoint(open_storage(path, conf), path, header, contents, clock)


def _check(source: Savepoint, transformations: Sequence[Transformation]) -> None:
    """Every named operator and state exists, and renames leave the operator ids unique."""
    ids = {op.operator_id for op in source.operators}
    for t in transformations:
        if isinstance(t, (DropState, MapValues)):
            source.state(t.operator_id, t.state)
        elif isinstance(t, DropOperator):
            source.operator(t.operator_id)
        elif isinstance(t, RenameOperator):
            source.operator(t.old)
            validate_id("operator id", t.new)
        else:
            raise InvalidArgumentError(
                f"{t!r} is not a transformation: use DropState, DropOperator, RenameOperator or MapValues"
            )
    renames = {t.old: t.new for t in transformations if isinstance(t, RenameOperator)}
    dropped = {t.operator_id for t in transformations if isinstance(t, DropOperator)}
    final = [renames.get(i, i) for i in sorted(ids - dropped)]
    dupes = sorted({i for i in final if final.count(i) > 1})
    if dupes:
        raise InvalidArgumentError(
            f"after the renames, operator id {dupes[0]!r} would appear twice; rename the other too"
        )


def _operator(
    source: Savepoint, op: OperatorSnapshot, new_id: str, transformations: Sequence[Transformation]
) -> OperatorContent:
    dropped = {t.state for t in transformations if isinstance(t, DropState) and t.operator_id == op.operator_id}
    mappers = {t.state: t for t in transformations if isinstance(t, MapValues) and t.operator_id == op.operator_id}
    states = tuple(d for d in op.states if d.name not in dropped)
    subtasks = []
    for sub in sorted(op.subtasks, key=lambda s: s.subtask_index):
        records: dict[str, list[tuple[bytes, bytes]]] = {}
        for d in states:
            entries = source.entries(op.operator_id, d.name, subtask_index=sub.subtask_index)
            mapper = mappers.get(d.name)
            records[d.name] = list(_restored(entries if mapper is None else _mapped(d, mapper, entries), d.kind))
        meta = source.meta(op.operator_id, sub.subtask_index)
        subtasks.append(SubtaskContent(sub.subtask_index, sub.key_groups, records, meta, sub.committed_epoch))
    return OperatorContent(OperatorSpec(new_id, op.parallelism, states), tuple(subtasks))


def _restored(entries: Iterator[RawEntry], kind: StateKind) -> Iterator[tuple[bytes, bytes]]:
    """Entries back as stored (key, value) pairs, in order; list elements numbered 0.. per key."""
    previous: bytes | None = None
    seq = 0
    for e in entries:
        prefix = layout.key_prefix(e.key_group, e.key, e.namespace)
        if kind is StateKind.LIST:
            seq = seq + 1 if prefix == previous else 0
            previous = prefix
            yield layout.list_element_key(prefix, seq), e.stored_value
        else:
            yield prefix + e.suffix, e.stored_value


def _mapped(d: StateDescriptor, mapper: MapValues, entries: Iterator[RawEntry]) -> Iterator[RawEntry]:
    key_ser = get_serializer(mapper.serializers.key)
    value_ser = get_serializer(mapper.serializers.value)
    fmt = d.vector_format if d.kind is StateKind.REDUCING else None
    for e in entries:
        stored = e.stored_value
        head = stored[: len(stored) - len(values.payload_of(stored))]
        payload = values.payload_of(stored)
        value = fmt.unpack(payload) if fmt is not None else value_ser.loads(payload)
        new = mapper.fn(key_ser.loads(e.key), value)
        if new is None:
            continue
        try:
            encoded = fmt.pack(*new) if fmt is not None else value_ser.dumps(new)
        except Exception as exc:
            raise InvalidArgumentError(
                f"MapValues on state {d.name!r}: the function returned {new!r}, which does not encode "
                f"({exc}); return a value of the state's type (None removes the entry)"
            ) from exc
        yield RawEntry(e.key_group, e.key, e.namespace, e.suffix, head + encoded)
