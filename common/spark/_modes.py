"""How ``foreach_batch`` lays a micro-batch out over Spark tasks, and the partial aggregation of the shuffle-free mode.

Two modes (the README's "Two foreach_batch modes" says which logic fits which):

* :attr:`BatchMode.KEYED`: the batch is repartitioned by key group at the job's parallelism, so
  Spark task ``i`` holds every row of the keys of subtask ``i``. Logic that needs all of a key's
  events of the batch together (sessionization, ordering by event time, read-then-decide
  updates) needs this mode. It costs a Spark shuffle.
* :attr:`BatchMode.SHUFFLE_FREE`: each input partition runs ``process`` on its own rows, and the
  client routes every write to the slot that owns its key: the state service is the shuffle.
  Correct for updates that commute across partitions (ReducingState sums/min/max, ListState
  appends whose order does not matter, MapState puts of distinct user keys); one key's rows may
  reach several tasks, so a task must never read a key's state and write back a value derived
  from it. Writes stay staged per (epoch, partition, attempt) and commit exactly once, as in the
  keyed mode; partitions of the same epoch apply in partition order.

:class:`ReduceInto` is the shuffle-free mode's common case, done the way Spark's partial
aggregation does it: a partition's rows are grouped per key with Arrow (no Python loop per row)
and one operand per key goes to the owner's ReducingState in one blind call.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from keyedstate.common.descriptors import OperatorSpec, ReduceFunction, StateKind
from keyedstate.common.errors import InvalidArgumentError

ROW_COUNT = "*"
"""In :class:`ReduceInto` fields: the field counts the key's rows instead of folding a column."""


class BatchMode(enum.Enum):
    """How a micro-batch's rows reach Spark tasks (see the module docstring)."""

    KEYED = "keyed"
    SHUFFLE_FREE = "shuffle_free"

    @classmethod
    def parse(cls, mode: BatchMode | str) -> BatchMode:
        """``mode`` as a BatchMode; a clear error naming the choices otherwise."""
        if isinstance(mode, BatchMode):
            return mode
        try:
            return cls(str(mode))
        except ValueError:
            choices = ", ".join(repr(m.value) for m in cls)
            raise InvalidArgumentError(f"foreach_batch mode {mode!r} is not one of {choices}") from None


# Arrow's group_by aggregation per reduce function: a partial result that the state's own function
# folds again on the TaskManager (sum of sums, min of mins, max of maxes).
_ARROW_AGGREGATION = {ReduceFunction.SUM: "sum", ReduceFunction.MIN: "min", ReduceFunction.MAX: "max"}


@dataclass(frozen=True)
class ReduceInto:
    """A ``process`` function that pre-aggregates a partition per key and folds it into a ReducingState.

    ``fields`` maps every reduce field of the state, in any order, to the input column it folds, or to
    :data:`ROW_COUNT` for a SUM field that counts the key's rows. Rows whose key is null are refused
    (a null has no key group). Build it through :meth:`KeyedStateRuntime.reduce_batch`, which checks
    ``fields`` against the state's descriptor on the driver.
    """

    state: str
    key_col: str
    fields: tuple[tuple[str, str, ReduceFunction], ...]
    """(reduce field, input column or ROW_COUNT, the field's reduce function), in the state's field order."""
    key_serializer: str = "str"
    operator: str | None = None

    @classmethod
    def checked(
        cls,
        operators: Sequence[OperatorSpec],
        operator: str,
        state: str,
        key_col: str,
        fields: Mapping[str, str],
        key_serializer: str,
    ) -> ReduceInto:
        """A ReduceInto whose ``fields`` match the reduce fields of ``operator``'s ``state``; InvalidArgumentError naming the fix otherwise."""
        spec = next((op for op in operators if op.operator_id == operator), None)
        if spec is None:
            raise InvalidArgumentError(f"reduce_batch: the job has no operator {operator!r}")
        descriptor = next((s for s in spec.states if s.name == state), None)
        if descriptor is None or descriptor.kind is not StateKind.REDUCING:
            raise InvalidArgumentError(
                f"reduce_batch: operator {operator!r} has no reducing state {state!r} "
                f"(its states: {', '.join(s.name for s in spec.states) or 'none'})"
            )
        names = [f.name for f in descriptor.reduce_fields]
        if sorted(fields) != sorted(names):
            raise InvalidArgumentError(
                f"reduce_batch: fields must name every reduce field of {state!r} exactly once: {names}, "
                f"got {sorted(fields)}"
            )
        for f in descriptor.reduce_fields:
            if fields[f.name] == ROW_COUNT and f.function is not ReduceFunction.SUM:
                raise InvalidArgumentError(
                    f"reduce_batch: field {f.name!r} reduces with {f.function.value}; only a SUM field can count rows ('*')"
                )
        ordered = tuple((f.name, fields[f.name], f.function) for f in descriptor.reduce_fields)
        return cls(state, key_col, ordered, key_serializer, operator)

    def __call__(self, batches: Iterator[Any], state: Any) -> None:
        table = self.partial(batches)
        if table is None:
            return
        keys = table.column(0).to_pylist()
        columns = [table.column(i + 1).to_pylist() for i in range(len(self.fields))]
        handle = state.reducing(self.state, operator=self.operator, key_serializer=self.key_serializer)
        handle.add_many(keys, list(zip(*columns)))

    def partial(self, batches: Iterator[Any]) -> Any:
        """The partition's rows grouped per key: a ``pyarrow.Table`` (key, one column per field), or None when empty."""
        import pyarrow as pa
        import pyarrow.compute as pc

        present = [b for b in batches if b.num_rows]
        if not present:
            return None
        table = pa.Table.from_batches(present)
        if table.column(self.key_col).null_count:
            raise InvalidArgumentError(
                f"reduce_batch: column {self.key_col!r} holds nulls; filter them out (a null key has no key group)"
            )
        aggregations: list[tuple[str, str]] = []
        for _, column, function in self.fields:
            if column == ROW_COUNT:
                aggregations.append((self.key_col, "count"))
            else:
                aggregations.append((column, _ARROW_AGGREGATION[function]))
        # Arrow names each output "<column>_<aggregation>", so two fields folding the same column the
        # same way collide: aggregate each distinct pair once and pick the columns by name.
        distinct = list(dict.fromkeys(aggregations))
        grouped = table.group_by(self.key_col, use_threads=False).aggregate(distinct)
        picked = [grouped.column(f"{c}_{a}") for c, a in aggregations]
        if any(pc.any(pc.is_null(col)).as_py() for col in picked):
            raise InvalidArgumentError(
                "reduce_batch: an input column of a reduce field holds nulls for a whole key; fill or filter them"
            )
        return pa.table([grouped.column(self.key_col), *picked], names=[self.key_col, *(f[0] for f in self.fields)])
