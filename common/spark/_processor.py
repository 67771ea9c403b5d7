"""Spark's own keyed-state API on this runtime: a PySpark ``StatefulProcessor`` run unchanged, one epoch per micro-batch.

A processor written for ``transformWithStateInPandas`` (``init`` asks its handle for value, list
and map state; ``handleInputRows(key, rows, timerValues)`` reads and writes them per grouping key
and yields pandas DataFrames) runs here as a keyed ``foreach_batch``:

* **Descriptors** come from the processor itself: :func:`processor_states` runs its ``init``
  against a recording handle and turns every ``getValueState``/``getListState``/``getMapState``
  (with its TTL) into a :class:`~keyedstate.common.descriptors.StateDescriptor`;
  :func:`processor_operator` wraps them in the operator a job is submitted with.
* **Per Spark task** (one subtask's key groups, every row of its keys): the rows are grouped per
  key, sorted by key as Spark's grouping does (several grouping columns are one state key, the
  JSON Spark makes of them); the processor's ``init`` runs once against local
  handles (:class:`ProcessorHandle`) that implement PySpark's ``ValueState``/``ListState``/
  ``MapState`` methods; ``handleInputRows`` runs per key. A value or list state is read for
  *all* the task's keys in one bulk call the first time any key reads it (a state only written —
  appended, put, cleared — is never read); a map is read per key, on its first read. Writes are
  kept locally and sent in bulk at the end of the task (clears, then appends and puts), staged in
  the task's epoch transaction: exactly once across failed task attempts and re-run batches, as
  for any ``foreach_batch``.
* **Output**: the DataFrames the processor yields go, as the winning attempts' output of the
  batch, to the user's sink on the driver before the epoch commits: ``sink(output, batch_id)``
  with a Spark DataFrame (the function given to Spark's own ``foreachBatch`` works unchanged), a
  pandas DataFrame or a pyarrow Table. A batch can run more than once (a failover, a driver
  restart before Spark recorded it), so, as with Spark's ``foreachBatch``, the sink must write
  idempotently per ``batch_id``; each run of a batch reads the state committed through the
  previous batch, so a deterministic processor emits the same rows every time.

An ``initial_state`` DataFrame (Spark's ``initialState``) travels with the query's first batch,
marked per row, and each of its keys goes through ``handleInitialState`` before its rows.

Timers (``timeMode`` "ProcessingTime" or "EventTime") go through the runtime's
:class:`~keyedstate.common.client.TimerService`, on a TIMERS state the operator declares
(:func:`processor_operator` with the time mode): ``registerTimer``/``deleteTimer`` are kept per key
in the task and staged with its other writes; after the task's last key, the timers due at the
batch's time (the batch timestamp, or the watermark) as they stood when the rows were done go
through ``handleExpiredTimer``, each deleted once its handler has run, as Spark 4 does.
"""

from __future__ import annotations

import copy
import json
import logging
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from keyedstate.common.client import TimeDomain, timers_state
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind, TtlConfig
from keyedstate.common.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

TIME_MODES = ("None", "ProcessingTime", "EventTime")
TIMER_DOMAINS = {"ProcessingTime": TimeDomain.PROCESSING_TIME, "EventTime": TimeDomain.EVENT_TIME}
"""The time modes with timers, and the domain their timers live in."""
TIMERS_STATE = "tws.timers"
"""The TIMERS state of a processor's operator in a timer mode (a name Spark's state variables do not take:
:func:`processor_states` refuses it)."""
SINK_FORMATS = ("spark", "pandas", "arrow")
MAX_ROWS_PER_FRAME = 10_000
"""A key's rows reach ``handleInputRows`` in DataFrames of at most this many rows, as Spark's
``spark.sql.execution.arrow.maxRecordsPerBatch`` (default 10000) splits them."""

_VALUE_SERIALIZER = "pickle"
"""Values and map user keys are tuples of plain Python values (numpy scalars are converted first), so
pickle is exact and gives equal user keys equal bytes."""


@dataclass(frozen=True)
class ProcessorState:
    """One state variable a processor's ``init`` asked for: its kind, schemas (as given) and TTL."""

    name: str
    kind: StateKind
    schema: Any
    """The value schema: a ``StructType`` or a DDL string."""
    user_key_schema: Any = None
    """Map state only: the user key's schema."""
    ttl_ms: int | None = None

    def descriptor(self) -> StateDescriptor:
        """The runtime's descriptor of this state (TTL refreshed on create and write, as Spark's is)."""
        ttl = TtlConfig(self.ttl_ms) if self.ttl_ms else None
        return StateDescriptor(self.name, self.kind, ttl)


class _Recorder:
    """The handle ``init`` sees while the states are being derived: it records, it serves nothing."""

    def __init__(self) -> None:
        self.states: dict[str, ProcessorState] = {}

    def _add(self, state: ProcessorState) -> _Unbound:
        _check_name(state.name)
        if state.name == TIMERS_STATE:
            raise InvalidArgumentError(
                f"state name {TIMERS_STATE!r} is the runtime's (it holds the processor's timers); rename the state variable"
            )
        known = self.states.get(state.name)
        if known is not None and known != state:
            raise InvalidArgumentError(
                f"StatefulProcessor.init asked for state {state.name!r} twice, differently ({known} and {state}); "
                "give each state variable its own name"
            )
        self.states[state.name] = state
        return _Unbound(state.name)

    def getValueState(self, stateName: str, schema: Any, ttlDurationMs: int | None = None) -> Any:
        return self._add(ProcessorState(stateName, StateKind.VALUE, schema, None, _ttl(stateName, ttlDurationMs)))

    def getListState(self, stateName: str, schema: Any, ttlDurationMs: int | None = None) -> Any:
        return self._add(ProcessorState(stateName, StateKind.LIST, schema, None, _ttl(stateName, ttlDurationMs)))

    def getMapState(
        self, stateName: str, userKeySchema: Any, valueSchema: Any, ttlDurationMs: int | None = None
    ) -> Any:
        return self._add(
            ProcessorState(stateName, StateKind.MAP, valueSchema, userKeySchema, _ttl(stateName, ttlDurationMs))
        )

    def deleteIfExists(self, stateName: str) -> None:
        raise _no_delete_if_exists(stateName)

    def registerTimer(self, expiryTimestampMs: int) -> None:
        raise InvalidArgumentError("StatefulProcessor.init cannot register timers: there is no grouping key in init")

    def deleteTimer(self, expiryTimestampMs: int) -> None:
        raise InvalidArgumentError("StatefulProcessor.init cannot delete timers: there is no grouping key in init")

    def listTimers(self) -> Iterator[int]:
        raise InvalidArgumentError("StatefulProcessor.init cannot list timers: there is no grouping key in init")


class _Unbound:
    """What the recording handle returns: using it outside ``handleInputRows`` is a clear error."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") or attr == "_name":  # pickling and copying probe these: plain attribute errors
            raise AttributeError(attr)
        raise InvalidArgumentError(
            f"state {self._name!r} was used ({attr}) while its descriptor was derived from StatefulProcessor.init; "
            "read and write state in handleInputRows only, where a grouping key is set"
        )


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"a state variable needs a non-empty string name, got {name!r}")


def _ttl(name: str, ttl_ms: Any) -> int | None:
    if ttl_ms is None:
        return None
    if not isinstance(ttl_ms, int) or isinstance(ttl_ms, bool) or ttl_ms <= 0:
        raise InvalidArgumentError(f"state {name!r}: ttlDurationMs must be a positive int (ms) or None, got {ttl_ms!r}")
    return ttl_ms


def _no_delete_if_exists(name: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"deleteIfExists({name!r}) is not supported: a state belongs to the job's definition here; drop it from a "
        "savepoint with the State Processor API (DropState) and restore the job from that savepoint"
    )


def processor_states(processor: Any) -> tuple[ProcessorState, ...]:
    """Run ``processor.init`` against a recording handle: the state variables it declares, in order.

    ``processor.close()`` runs afterwards, as Spark's driver-side pre-init does.
    """
    if not callable(getattr(processor, "init", None)) or not callable(getattr(processor, "handleInputRows", None)):
        raise InvalidArgumentError(
            f"expected a pyspark StatefulProcessor (with init and handleInputRows), got {type(processor).__name__}"
        )
    recorder = _Recorder()
    # A shallow copy runs init, so the processor the query ships keeps no recording handles in its attributes.
    processor = copy.copy(processor)
    processor.init(recorder)
    close = getattr(processor, "close", None)
    if callable(close):
        close()
    if not recorder.states:
        raise InvalidArgumentError(
            f"{type(processor).__name__}.init declared no state (getValueState, getListState or getMapState)"
        )
    return tuple(recorder.states.values())


def parse_time_mode(time_mode: Any) -> str:
    """Spark's ``timeMode`` in its canonical spelling (matched case-insensitively, as Spark does)."""
    mode = next((m for m in TIME_MODES if m.lower() == str(time_mode).lower()), None)
    if mode is None:
        raise InvalidArgumentError(f"time_mode {time_mode!r} is not one of {', '.join(TIME_MODES)}")
    return mode


def processor_operator(processor: Any, operator_id: str, parallelism: int, time_mode: str = "None") -> OperatorSpec:
    """The operator a job runs ``processor`` in: one state descriptor per state its ``init`` declares.

    ``time_mode`` "ProcessingTime" or "EventTime" (the query's ``timeMode``) adds the TIMERS state
    :data:`TIMERS_STATE` that holds the processor's timers.
    """
    states = tuple(s.descriptor() for s in processor_states(processor))
    if parse_time_mode(time_mode) in TIMER_DOMAINS:
        states += (timers_state(TIMERS_STATE),)
    return OperatorSpec(operator_id, parallelism, states)


def check_operator(
    states: Sequence[ProcessorState], operators: Sequence[OperatorSpec], operator: str, time_mode: str = "None"
) -> None:
    """InvalidArgumentError naming the fix unless ``operator`` declares every state of the processor, alike
    (and, in a timer mode, the timers state)."""
    spec = next((op for op in operators if op.operator_id == operator), None)
    if spec is None:
        raise InvalidArgumentError(
            f"the job has no operator {operator!r} (operators: {', '.join(op.operator_id for op in operators)})"
        )
    declared = {d.name: d for d in spec.states}
    wanted = [s.descriptor() for s in states]
    if time_mode in TIMER_DOMAINS:
        wanted.append(timers_state(TIMERS_STATE))
    for want in wanted:
        have = declared.get(want.name)
        if have != want:
            raise InvalidArgumentError(
                f"operator {operator!r} declares state {want.name!r} as {have}, but the processor "
                f"(time_mode {time_mode!r}) needs {want}; submit the job with "
                f"processor_operator(processor, ..., time_mode={time_mode!r}) so the two agree"
            )


# -- values ---------------------------------------------------------------------------------------
_PLAIN = frozenset({int, float, str, bool, bytes, type(None)})


def _plain(v: Any) -> Any:
    """A state value as plain Python (numpy and pandas scalars converted), as PySpark's client does before storing it."""
    if type(v) in _PLAIN:
        return v
    if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
        return type(v)(_plain(x) for x in v)
    if hasattr(v, "_fields"):  # Row and named tuples
        return tuple(_plain(x) for x in v)
    if isinstance(v, dict):
        return {_plain(k): _plain(x) for k, x in v.items()}
    if hasattr(v, "to_pytimedelta"):
        return v.to_pytimedelta()
    if hasattr(v, "to_pydatetime"):
        return v.to_pydatetime()
    if hasattr(v, "tolist") and hasattr(v, "dtype"):  # a numpy scalar
        return v.tolist()
    return v


def _row(name: str, schema: Any, value: Any) -> tuple[Any, ...]:
    """``value`` as the tuple the state stores; InvalidArgumentError when it does not fit ``schema``."""
    if not isinstance(value, (tuple, list)):
        raise InvalidArgumentError(
            f"state {name!r}: a value is a tuple of the schema's fields ({_field_names(schema)}), "
            f"got {type(value).__name__}"
        )
    fields = getattr(schema, "fields", None)
    if fields is not None and len(value) != len(fields):
        raise InvalidArgumentError(
            f"state {name!r}: the value has {len(value)} fields, the schema {_field_names(schema)} has {len(fields)}"
        )
    if type(value) is tuple and all(type(x) in _PLAIN for x in value):
        return value  # the common case: nothing to convert
    return tuple(_plain(x) for x in value)


def _field_names(schema: Any) -> str:
    fields = getattr(schema, "fields", None)
    return ", ".join(f.name for f in fields) if fields is not None else str(schema)


# -- the local handles ----------------------------------------------------------------------------
_CLEARED = object()


class _Task:
    """One task's keys and the grouping key being processed; the handles read it implicitly, as Spark's do."""

    def __init__(self, state: Any, keys: list[Any], key_serializer: str) -> None:
        self.state = state
        self.keys = keys
        self.key_serializer = key_serializer
        self.current: Any = None
        self.has_key = False

    def key(self, what: str) -> Any:
        if not self.has_key:
            raise InvalidArgumentError(f"{what} needs a grouping key: use state in handleInputRows only")
        return self.current


class LocalValueState:
    """PySpark's ``ValueState`` for one task: reads the task's keys in bulk once, writes back in bulk at its end."""

    def __init__(self, task: _Task, spec: ProcessorState, schema: Any) -> None:
        self._task = task
        self._spec = spec
        self._schema = schema
        self._base: dict[Any, Any] | None = None
        self._changes: dict[Any, Any] = {}

    def _current(self) -> Any:
        key = self._task.key(f"ValueState {self._spec.name!r}")
        change = self._changes.get(key, None)
        if change is not None:
            return None if change is _CLEARED else change
        if self._base is None:
            self._base = dict(zip(self._task.keys, self._handle().get_many(self._task.keys)))
        return self._base.get(key)

    def _handle(self) -> Any:
        return self._task.state.value(
            self._spec.name, key_serializer=self._task.key_serializer, value_serializer=_VALUE_SERIALIZER
        )

    def exists(self) -> bool:
        """Whether the key has a value."""
        return self._current() is not None

    def get(self) -> tuple[Any, ...] | None:
        """The key's value, or None."""
        value = self._current()
        return None if value is None else tuple(value)

    def update(self, newValue: Any) -> None:
        """Set the key's value (a tuple of the schema's fields)."""
        self._changes[self._task.key(f"ValueState {self._spec.name!r}")] = _row(self._spec.name, self._schema, newValue)

    def clear(self) -> None:
        """Remove the key's value."""
        self._changes[self._task.key(f"ValueState {self._spec.name!r}")] = _CLEARED

    def flush(self) -> None:
        """Send the task's changes in bulk: one clear and one put call."""
        if not self._changes:
            return
        cleared = [k for k, v in self._changes.items() if v is _CLEARED]
        put = [(k, v) for k, v in self._changes.items() if v is not _CLEARED]
        handle = self._handle()
        if cleared:
            handle.clear_many(cleared)
        if put:
            handle.put_many([k for k, _ in put], [v for _, v in put])


@dataclass
class _ListChange:
    replaced: bool
    """True: the list is ``items`` (put or cleared); False: the stored list plus ``items`` appended."""
    items: list[tuple[Any, ...]] = field(default_factory=list)


class LocalListState:
    """PySpark's ``ListState`` for one task: appends are sent blind; a list is read (in bulk for the task) only when asked for."""

    def __init__(self, task: _Task, spec: ProcessorState, schema: Any) -> None:
        self._task = task
        self._spec = spec
        self._schema = schema
        self._base: dict[Any, list[Any]] | None = None
        self._changes: dict[Any, _ListChange] = {}

    def _handle(self) -> Any:
        return self._task.state.list(
            self._spec.name, key_serializer=self._task.key_serializer, value_serializer=_VALUE_SERIALIZER
        )

    def _key(self) -> Any:
        return self._task.key(f"ListState {self._spec.name!r}")

    def _current(self) -> list[Any]:
        key = self._key()
        change = self._changes.get(key)
        if change is not None and change.replaced:
            return change.items
        if self._base is None:
            self._base = dict(zip(self._task.keys, self._handle().get_many(self._task.keys)))
        base = self._base.get(key, [])
        return base + change.items if change is not None else base

    def exists(self) -> bool:
        """Whether the key's list holds an element."""
        return bool(self._current())

    def get(self) -> Iterator[tuple[Any, ...]]:
        """The key's elements, in order (a snapshot: later writes do not change an iterator already taken)."""
        return iter([tuple(x) for x in self._current()])

    def put(self, newState: Sequence[Any]) -> None:
        """Replace the key's list."""
        rows = self._rows(newState, "put")
        self._changes[self._key()] = _ListChange(True, rows)

    def appendValue(self, newState: Any) -> None:
        """Append one element to the key's list."""
        self._append([_row(self._spec.name, self._schema, newState)])

    def appendList(self, newState: Sequence[Any]) -> None:
        """Append elements to the key's list."""
        self._append(self._rows(newState, "appendList"))

    def _rows(self, values: Any, what: str) -> list[tuple[Any, ...]]:
        if not isinstance(values, (list, tuple)):
            raise InvalidArgumentError(
                f"ListState {self._spec.name!r}.{what} takes a list of tuples, got {type(values).__name__}"
            )
        return [_row(self._spec.name, self._schema, v) for v in values]

    def _append(self, rows: list[tuple[Any, ...]]) -> None:
        key = self._key()
        change = self._changes.get(key)
        if change is None:
            change = self._changes[key] = _ListChange(False)
        change.items.extend(rows)

    def clear(self) -> None:
        """Remove the key's list."""
        self._changes[self._key()] = _ListChange(True)

    def flush(self) -> None:
        """Send the task's changes in bulk: one clear of the replaced lists, then one append of every new element."""
        if not self._changes:
            return
        handle = self._handle()
        replaced = [k for k, c in self._changes.items() if c.replaced]
        if replaced:
            handle.clear_many(replaced)  # staged before the appends: the epoch applies a task's requests in order
        keys = [k for k, c in self._changes.items() for _ in c.items]
        if keys:
            handle.append_many(keys, [x for c in self._changes.values() for x in c.items])


@dataclass
class _MapChange:
    cleared: bool = False
    puts: dict[tuple[Any, ...], tuple[Any, ...]] = field(default_factory=dict)
    removed: set[tuple[Any, ...]] = field(default_factory=set)


class LocalMapState:
    """PySpark's ``MapState`` for one task: a key's map is read (one scan) on its first read; writes go in bulk."""

    def __init__(self, task: _Task, spec: ProcessorState, schema: Any, user_key_schema: Any) -> None:
        self._task = task
        self._spec = spec
        self._schema = schema
        self._user_key_schema = user_key_schema
        self._base: dict[Any, dict[tuple[Any, ...], tuple[Any, ...]]] = {}
        self._changes: dict[Any, _MapChange] = {}

    def _handle(self) -> Any:
        return self._task.state.map(
            self._spec.name,
            key_serializer=self._task.key_serializer,
            user_key_serializer=_VALUE_SERIALIZER,
            value_serializer=_VALUE_SERIALIZER,
        )

    def _key(self) -> Any:
        return self._task.key(f"MapState {self._spec.name!r}")

    def _user_key(self, key: Any) -> tuple[Any, ...]:
        return _row(f"{self._spec.name} (user key)", self._user_key_schema, key)

    def _current(self) -> dict[tuple[Any, ...], tuple[Any, ...]]:
        key = self._key()
        change = self._changes.get(key)
        if change is not None and change.cleared:
            base: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        else:
            if key not in self._base:
                self._base[key] = {tuple(uk): tuple(v) for uk, v in self._handle().items(key)}
            base = self._base[key]
        if change is None:
            return base
        merged = {uk: v for uk, v in base.items() if uk not in change.removed}
        merged.update(change.puts)
        return merged

    def _change(self) -> _MapChange:
        key = self._key()
        change = self._changes.get(key)
        if change is None:
            change = self._changes[key] = _MapChange()
        return change

    def exists(self) -> bool:
        """Whether the key's map holds an entry."""
        return bool(self._current())

    def getValue(self, key: Any) -> tuple[Any, ...] | None:
        """The value of user key ``key``, or None."""
        return self._current().get(self._user_key(key))

    def containsKey(self, key: Any) -> bool:
        """Whether the map holds user key ``key``."""
        return self._user_key(key) in self._current()

    def updateValue(self, key: Any, value: Any) -> None:
        """Set the value of user key ``key``."""
        uk = self._user_key(key)
        change = self._change()
        change.removed.discard(uk)
        change.puts[uk] = _row(self._spec.name, self._schema, value)

    def iterator(self) -> Iterator[tuple[tuple[Any, ...], tuple[Any, ...]]]:
        """The map's (user key, value) pairs (a snapshot)."""
        return iter(list(self._current().items()))

    def keys(self) -> Iterator[tuple[Any, ...]]:
        """The map's user keys (a snapshot)."""
        return iter(list(self._current()))

    def values(self) -> Iterator[tuple[Any, ...]]:
        """The map's values (a snapshot)."""
        return iter(list(self._current().values()))

    def removeKey(self, key: Any) -> None:
        """Remove user key ``key`` from the map."""
        uk = self._user_key(key)
        change = self._change()
        change.puts.pop(uk, None)
        if not change.cleared:
            change.removed.add(uk)

    def clear(self) -> None:
        """Remove the key's whole map."""
        self._changes[self._key()] = _MapChange(cleared=True)

    def flush(self) -> None:
        """Send the task's changes in bulk: one clear of the cleared maps, one remove, one put."""
        if not self._changes:
            return
        handle = self._handle()
        cleared = [k for k, c in self._changes.items() if c.cleared]
        if cleared:
            handle.clear_many(cleared)
        removed = [(k, uk) for k, c in self._changes.items() for uk in c.removed]
        if removed:
            handle.remove_many([k for k, _ in removed], [uk for _, uk in removed])
        puts = [(k, uk, v) for k, c in self._changes.items() for uk, v in c.puts.items()]
        if puts:
            handle.put_many([p[0] for p in puts], [p[1] for p in puts], [p[2] for p in puts])


def _timestamp(what: str, value: Any) -> int:
    """A timer's timestamp as an int (numpy integers too); InvalidArgumentError for anything else."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidArgumentError(
            f"{what} takes an int timestamp in milliseconds, got {type(value).__name__} {value!r}"
        )
    return operator.index(value)


class LocalTimers:
    """The handle's timer calls for one task: ``registerTimer``/``deleteTimer``/``listTimers`` of the current key.

    Registrations and deletions are kept per key and sent in bulk at the end of the task, staged
    in its epoch like every other write. The timers stored before the batch are read when needed:
    the due ones once, before the first key (:meth:`load_due`); all of the task's once, on the
    first ``listTimers``.
    """

    def __init__(self, task: _Task, domain: TimeDomain) -> None:
        self._task = task
        self.domain = domain
        self._due: dict[Any, set[int]] | None = None
        self._due_limit: int | None = None
        self._all: dict[Any, set[int]] | None = None
        self._changes: dict[Any, dict[int, bool]] = {}
        """key -> timestamp -> registered (True) or deleted (False) in this task."""

    def _service(self) -> Any:
        return self._task.state.timers(TIMERS_STATE, key_serializer=self._task.key_serializer)

    def _read(self, up_to_ms: int) -> dict[Any, set[int]]:
        stored: dict[Any, set[int]] = {}
        for t in self._service().due(self.domain, up_to_ms, self._task.state.key_groups()):
            stored.setdefault(t.key, set()).add(t.timestamp_ms)
        return stored

    def load_due(self, up_to_ms: int) -> set[Any]:
        """Read the stored timers due at ``up_to_ms`` (one bounded scan per key group); the keys that have one."""
        self._due, self._due_limit = self._read(up_to_ms), up_to_ms
        return set(self._due)

    def register(self, timestamp_ms: Any) -> None:
        key = self._task.key("registerTimer")
        self._changes.setdefault(key, {})[_timestamp("registerTimer", timestamp_ms)] = True

    def delete(self, timestamp_ms: Any) -> None:
        key = self._task.key("deleteTimer")
        self._changes.setdefault(key, {})[_timestamp("deleteTimer", timestamp_ms)] = False

    def current(self) -> Iterator[int]:
        """The current key's timers, ascending (a snapshot), with this task's changes."""
        key = self._task.key("listTimers")
        if self._all is None:
            self._all = self._read(_MAX_TIMESTAMP)
        timers = set(self._all.get(key, ()))
        for ts, registered in self._changes.get(key, {}).items():
            if registered:
                timers.add(ts)
            else:
                timers.discard(ts)
        return iter(sorted(timers))

    def expired(self) -> list[tuple[int, Any]]:
        """(timestamp, key) of every timer due at :meth:`load_due`'s time as the task stands now, ascending."""
        if self._due is None or self._due_limit is None:
            raise RuntimeError("LocalTimers.expired before load_due")
        limit = self._due_limit
        due = {(ts, k) for k, stamps in self._due.items() for ts in stamps}
        for key, changes in self._changes.items():
            for ts, registered in changes.items():
                if registered and ts <= limit:
                    due.add((ts, key))
                elif not registered:
                    due.discard((ts, key))
        return sorted(due)  # by time, then key, as Spark's timer index orders them

    def fired(self, key: Any, timestamp_ms: int) -> None:
        """Delete a timer whose handler has run (a registration of the same timestamp by the handler too)."""
        self._changes.setdefault(key, {})[timestamp_ms] = False

    def flush(self) -> None:
        """Send the task's changes in bulk: one delete and one register call."""
        if not self._changes:
            return
        service = self._service()
        deleted = [(k, ts) for k, c in self._changes.items() for ts, registered in c.items() if not registered]
        added = [(k, ts) for k, c in self._changes.items() for ts, registered in c.items() if registered]
        if deleted:
            service.delete_many(self.domain, [k for k, _ in deleted], [ts for _, ts in deleted])
        if added:
            service.register_many(self.domain, [k for k, _ in added], [ts for _, ts in added])


_MAX_TIMESTAMP = (1 << 63) - 1

LocalState = LocalValueState | LocalListState | LocalMapState


class ProcessorHandle:
    """PySpark's ``StatefulProcessorHandle`` for one task: the states ``init`` asks for, bound to the task's epoch."""

    def __init__(
        self,
        task: _Task,
        specs: dict[str, ProcessorState],
        schemas: dict[str, tuple[Any, Any]],
        time_mode: str = "None",
    ) -> None:
        self._task = task
        self._specs = specs
        self._schemas = schemas
        self._time_mode = time_mode
        self.states: dict[str, LocalState] = {}
        domain = TIMER_DOMAINS.get(time_mode)
        self.timers = LocalTimers(task, domain) if domain is not None else None
        """The task's timers (None in time mode "None": the timer calls are errors, as in Spark)."""

    @classmethod
    def bound(
        cls,
        state: Any,
        keys: list[Any],
        key_serializer: str,
        states: Sequence[ProcessorState],
        schemas: dict[str, tuple[Any, Any]],
        time_mode: str = "None",
    ) -> ProcessorHandle:
        """A handle for one task: ``state`` is its :class:`PartitionState`, ``keys`` every grouping key it will
        process (states read in bulk are read for these keys)."""
        return cls(_Task(state, keys, key_serializer), {s.name: s for s in states}, schemas, time_mode)

    def add_keys(self, keys: Iterator[Any] | set[Any]) -> None:
        """More grouping keys the task will process (keys with due timers only), before any state is read."""
        known = set(self._task.keys)
        self._task.keys.extend(k for k in keys if k not in known)

    def set_key(self, key: Any) -> None:
        """The grouping key the states act on until the next call (Spark's implicit key)."""
        self._task.current, self._task.has_key = key, True

    def unset_key(self) -> None:
        """No grouping key: state access is an error until :meth:`set_key`."""
        self._task.has_key = False

    def _state(self, name: str, kind: StateKind) -> Any:
        spec = self._specs.get(name)
        if spec is None or spec.kind is not kind:
            raise InvalidArgumentError(
                f"state {name!r} ({kind.value}) is not among the states the processor's init declared when the "
                f"query started ({', '.join(f'{s.name} ({s.kind.value})' for s in self._specs.values())}); "
                "ask for every state in init, the same way every time"
            )
        state = self.states.get(name)
        if state is None:
            value_schema, user_key_schema = self._schemas[name]
            if kind is StateKind.VALUE:
                state = LocalValueState(self._task, spec, value_schema)
            elif kind is StateKind.LIST:
                state = LocalListState(self._task, spec, value_schema)
            else:
                state = LocalMapState(self._task, spec, value_schema, user_key_schema)
            self.states[name] = state
        return state

    def getValueState(self, stateName: str, schema: Any, ttlDurationMs: int | None = None) -> Any:
        return self._state(stateName, StateKind.VALUE)

    def getListState(self, stateName: str, schema: Any, ttlDurationMs: int | None = None) -> Any:
        return self._state(stateName, StateKind.LIST)

    def getMapState(
        self, stateName: str, userKeySchema: Any, valueSchema: Any, ttlDurationMs: int | None = None
    ) -> Any:
        return self._state(stateName, StateKind.MAP)

    def deleteIfExists(self, stateName: str) -> None:
        raise _no_delete_if_exists(stateName)

    def registerTimer(self, expiryTimestampMs: int) -> None:
        """Call the current key back through ``handleExpiredTimer`` once the mode's time reaches ``expiryTimestampMs``."""
        if self.timers is None:
            raise _no_timers("register_timer")
        self.timers.register(expiryTimestampMs)

    def deleteTimer(self, expiryTimestampMs: int) -> None:
        """Delete the current key's timer at ``expiryTimestampMs`` (an absent one is no error)."""
        if self.timers is None:
            raise _no_timers("delete_timer")
        self.timers.delete(expiryTimestampMs)

    def listTimers(self) -> Iterator[int]:
        """The current key's timers, ascending."""
        if self.timers is None:
            raise _no_timers("list_timers")
        return self.timers.current()

    def flush(self) -> None:
        """Send every state's changes of the task (in the order init asked for the states), then its timers'."""
        for state in self.states.values():
            state.flush()
        if self.timers is not None:
            self.timers.flush()


def _no_timers(operation: str) -> InvalidArgumentError:
    # Spark's own error class and wording, with the fix.
    return InvalidArgumentError(
        "[STATEFUL_PROCESSOR_CANNOT_PERFORM_OPERATION_WITH_INVALID_TIME_MODE] Failed to perform stateful processor "
        f"operation={operation} with invalid timeMode=NoTime; run the query with time_mode 'ProcessingTime' or "
        "'EventTime' to use timers"
    )


# -- the task function ----------------------------------------------------------------------------
@dataclass(frozen=True)
class _ProcessorPlan:
    """What each task needs, shipped with the processor (schemas parsed on the driver: executors have no JVM)."""

    key_col: str
    key_serializer: str
    states: tuple[ProcessorState, ...]
    schemas: dict[str, tuple[Any, Any]]
    output_arrow: Any
    time_mode: str
    initial_columns: tuple[str, ...] = ()
    """The initial state's columns (empty: no initial state)."""
    grouping: tuple[str, ...] = ()
    """The grouping columns when there are several: ``key_col`` is then :data:`COMPOSITE_KEY`, their JSON."""

    def key_tuple(self, key: Any) -> tuple[Any, ...]:
        """The grouping key Spark passes for a state key (a key with a due timer and no rows in the batch).

        Several grouping columns: the values of the JSON object their state key is, in column order
        (exact for the string, integral and boolean columns a timer mode allows).
        """
        if not self.grouping:
            return (key,)
        values = json.loads(key)
        return tuple(values.get(c) for c in self.grouping)


COMPOSITE_KEY = "__keyedstate_key"
"""The state key of a processor grouped by several columns: Spark's ``to_json(struct(columns))``, computed in
the JVM, so the key group and the stored key come from one deterministic string."""

INITIAL_FLAG = "__keyedstate_initial_state"
"""The column that marks the initial state's rows in the first batch (they travel with the input, by key group)."""


def with_composite_key(df: Any, grouping: Sequence[str]) -> Any:
    """``df`` with :data:`COMPOSITE_KEY`: the JSON of its grouping columns, the state key of a multi-column grouping."""
    from pyspark.sql import functions as F

    return df.withColumn(COMPOSITE_KEY, F.to_json(F.struct(*grouping)))


def with_initial_state(df: Any, initial: Any) -> Any:
    """The first batch's input with the initial state's rows appended, each row marked by :data:`INITIAL_FLAG`.

    The input's columns come first, then the flag, then the columns only the initial state has:
    a task tells the two apart by position.
    """
    from pyspark.sql import functions as F

    return df.withColumn(INITIAL_FLAG, F.lit(False)).unionByName(
        initial.withColumn(INITIAL_FLAG, F.lit(True)), allowMissingColumns=True
    )


class _Groups:
    """One table's rows grouped per key, keys ascending, rows in arrival order (as Spark's grouping gives them)."""

    def __init__(self, table: Any, key_col: str, grouping: Sequence[str]) -> None:
        import pyarrow.compute as pc

        table = table.take(pc.sort_indices(table, [(key_col, "ascending")]))
        key_column = table.column(key_col).combine_chunks()
        starts = [0] if len(key_column) else []
        if len(key_column) > 1:
            changed = pc.not_equal(key_column.slice(1), key_column.slice(0, len(key_column) - 1))
            starts += [i + 1 for i in pc.indices_nonzero(changed).to_pylist()]
        bounds = [*starts, table.num_rows]
        self.rows = table.num_rows
        self.bounds = {key_column[s].as_py(): (s, bounds[i + 1]) for i, s in enumerate(starts)}
        # The grouping key as Spark passes it: a tuple of the grouping columns' values.
        columns = [table.column(c) for c in grouping] if grouping else [key_column]
        self.key_tuples = {k: tuple(col[s].as_py() for col in columns) for k, (s, _) in self.bounds.items()}
        if COMPOSITE_KEY in table.column_names:
            table = table.drop_columns([COMPOSITE_KEY])  # the runtime's column, not the processor's
        self.frame = table.to_pandas() if starts else None

    def frames(self, key: Any) -> Iterator[Any] | None:
        """The key's rows as DataFrames, or None when it has none."""
        where = self.bounds.get(key)
        return None if where is None else _frames(self.frame, *where)


class ProcessorPartition:
    """The ``process`` function of a processor's keyed ``foreach_batch``: one Spark task's keys, through the processor."""

    def __init__(self, processor: Any, plan: _ProcessorPlan) -> None:
        self.processor = processor
        self.plan = plan

    def __call__(self, batches: Iterator[Any], state: Any) -> list[Any] | None:
        import pyarrow as pa
        import pyarrow.compute as pc
        from pyspark.sql.streaming.stateful_processor import ExpiredTimerInfo

        plan = self.plan
        present = [b for b in batches if b.num_rows]
        groups: _Groups | None = None
        initial: _Groups | None = None
        if present:
            table = pa.Table.from_batches(present)
            if table.column(plan.key_col).null_count:
                raise InvalidArgumentError(
                    f"column {plan.key_col!r} holds nulls; filter them out before the processor (a null key has no key group)"
                )
            if INITIAL_FLAG in table.column_names:
                flag = table.column(INITIAL_FLAG)
                inputs = table.column_names[: table.column_names.index(INITIAL_FLAG)]
                extra = [COMPOSITE_KEY] if plan.grouping else []
                initial = _Groups(
                    table.filter(flag).select([*plan.initial_columns, *extra]), plan.key_col, plan.grouping
                )
                table = table.filter(pc.invert(flag)).select(inputs)
            groups = _Groups(table, plan.key_col, plan.grouping)
        keys = sorted(set(groups.bounds if groups is not None else ()) | set(initial.bounds if initial else ()))
        handle = ProcessorHandle.bound(
            state, list(keys), plan.key_serializer, plan.states, plan.schemas, plan.time_mode
        )
        timer_values, due_at = _timer_values(plan.time_mode, state.times)
        if handle.timers is not None and due_at is not None:
            # The stored timers due now, read before any key: their keys join the task's bulk reads.
            handle.add_keys(handle.timers.load_due(due_at))
        elif not keys:
            return None
        if not keys and handle.timers is not None and not handle.timers.expired():
            return None  # nothing to do: no rows, no due timer (init and close are not called)
        out: list[Any] = []
        self.processor.init(handle)
        try:
            for key in keys:
                handle.set_key(key)
                # The first batch: the key's initial state first, then its rows, as Spark calls them.
                if initial is not None:
                    for chunk in initial.frames(key) or ():
                        self.processor.handleInitialState(initial.key_tuples[key], chunk, timer_values)
                rows = groups.frames(key) if groups is not None else None
                if rows is None:
                    continue
                self._drain(self.processor.handleInputRows(groups.key_tuples[key], rows, timer_values), out)  # type: ignore[union-attr]
            if handle.timers is not None and due_at is not None:
                # Spark's order: after every key's rows, the timers due as the rows left them (those the
                # handlers register fire in a later batch; one a handler deletes still fires now).
                for timestamp, key in handle.timers.expired():
                    handle.set_key(key)
                    key_tuple = groups.key_tuples.get(key) if groups is not None else None
                    result = self.processor.handleExpiredTimer(
                        key_tuple if key_tuple is not None else plan.key_tuple(key),
                        timer_values,
                        ExpiredTimerInfo(timestamp),
                    )
                    self._drain(result, out)
                    handle.timers.fired(key, timestamp)  # deleted once its handler ran, as Spark does
            handle.unset_key()
            handle.flush()  # staged in the attempt's epoch transaction: only a winning attempt's apply
        finally:
            self.processor.close()  # Spark's teardown, after the last key (it may fail the attempt too)
        logger.debug(
            "batch %d: %d keys, %d rows in, %d frames out",
            state.batch_id,
            len(keys),
            groups.rows if groups is not None else 0,
            len(out),
        )
        return _output_batches(out, plan.output_arrow)

    def _drain(self, result: Any, out: list[Any]) -> None:
        """Collect what a handler yielded, while the key is set: a generator reads and writes state as it yields."""
        for item in result if result is not None else ():
            emitted = _output_frame(item, self.plan.output_arrow)
            if emitted is not None:
                out.append(emitted)


def _timer_values(time_mode: str, times: Any) -> tuple[Any, int | None]:
    """Spark's ``TimerValues`` for the batch, and the time its timers are due at (None: none fire).

    As Spark 4 gives them: -1 and -1 in time mode "None"; otherwise the batch timestamp and the
    batch watermark Spark recorded (0 in a query without ``withWatermark``), in both timer modes.
    Outside a streaming query there is no watermark (-1), and event-time timers wait.
    """
    from pyspark.sql.streaming.stateful_processor import TimerValues

    domain = TIMER_DOMAINS.get(time_mode)
    if domain is None or times is None:
        return TimerValues(-1, -1), None
    watermark = times.watermark_ms
    values = TimerValues(times.timestamp_ms, watermark if watermark is not None else -1)
    return values, times.timestamp_ms if domain is TimeDomain.PROCESSING_TIME else watermark


def _frames(frame: Any, start: int, stop: int) -> Iterator[Any]:
    import pandas as pd

    for first in range(start, stop, MAX_ROWS_PER_FRAME):
        last = min(stop, first + MAX_ROWS_PER_FRAME)
        part = frame.iloc[first:last]
        part.index = pd.RangeIndex(last - first)  # numbered from 0, as Spark's are; cheaper than reset_index's copy
        yield part


def _output_frame(item: Any, schema: Any) -> Any:
    """One DataFrame the processor yielded, with the output schema's columns (by name, or by position); None when empty."""
    import pandas as pd

    if not isinstance(item, pd.DataFrame):
        raise InvalidArgumentError(
            f"handleInputRows must yield pandas DataFrames (transformWithStateInPandas), got {type(item).__name__}"
        )
    if not len(item):
        return None
    if not all(isinstance(c, str) for c in item.columns):
        if len(item.columns) != len(schema):
            raise InvalidArgumentError(
                f"handleInputRows yielded {len(item.columns)} unnamed columns; the output schema has {len(schema)}"
            )
        item = item.set_axis(schema.names, axis=1)
    missing = [n for n in schema.names if n not in item.columns]
    if missing:
        raise InvalidArgumentError(
            f"handleInputRows yielded columns {list(item.columns)}, without {missing} of the output schema {schema.names}"
        )
    return item[schema.names]


def _output_batches(frames: list[Any], schema: Any) -> list[Any]:
    """The task's output frames as record batches of the output schema, converted once (not per key)."""
    import pandas as pd
    import pyarrow as pa

    if not frames:
        return []
    frame = frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)
    try:
        table = pa.Table.from_pandas(frame, schema=schema, preserve_index=False)
    except (pa.ArrowException, ValueError, TypeError) as exc:
        raise InvalidArgumentError(
            f"handleInputRows yielded rows that do not fit the output schema {schema}: {exc}"
        ) from exc
    return list(table.to_batches())


# -- the driver side ------------------------------------------------------------------------------
def parse_schema(schema: Any, what: str) -> Any:
    """A ``StructType`` from a StructType or a DDL string (parsed by the driver's JVM, as Spark does)."""
    from pyspark.sql.types import StructType, _parse_datatype_string

    if isinstance(schema, StructType):
        return schema
    if not isinstance(schema, str):
        raise InvalidArgumentError(f"{what}: a schema is a StructType or a DDL string, got {type(schema).__name__}")
    try:
        parsed = _parse_datatype_string(schema)
    except Exception as exc:  # the JVM's parse error, or no active SparkContext
        raise InvalidArgumentError(f"{what}: cannot parse schema {schema!r} on the driver: {exc}") from exc
    if not isinstance(parsed, StructType):
        raise InvalidArgumentError(f"{what}: schema {schema!r} is not a struct; write it as 'name type, ...'")
    return parsed


_TIMER_KEY_TYPES = ("StringType", "ByteType", "ShortType", "IntegerType", "LongType", "BooleanType")


def check_timer_grouping(df: Any, grouping: Sequence[str], time_mode: str) -> None:
    """InvalidArgumentError unless a timer mode's several grouping columns come back exactly from their JSON.

    A key whose timer fires in a batch without its rows gets its grouping values from its state
    key (the JSON of the columns): exact for strings, integers and booleans only.
    """
    if time_mode not in TIMER_DOMAINS or not grouping:
        return
    for column in grouping:
        dtype = df.schema[column].dataType
        if type(dtype).__name__ not in _TIMER_KEY_TYPES:
            raise InvalidArgumentError(
                f"grouping column {column!r} is {dtype.simpleString()}; with timers (time_mode {time_mode!r}) and "
                "several grouping columns, group by string, integral or boolean columns (cast the others to string)"
            )


def event_time_column(df: Any) -> str | None:
    """The column ``withWatermark`` was set on (Spark marks it with ``spark.watermarkDelayMs``), or None."""
    for f in df.schema.fields:
        if "spark.watermarkDelayMs" in (f.metadata or {}):
            return str(f.name)
    return None


def drop_late_rows(df: Any, column: str, late_watermark_ms: int) -> Any:
    """``df`` without the rows Spark's EventTime ``transformWithState`` drops as late: an event time at or before
    the previous batch's watermark (rows with a null event time stay, as in Spark)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StructType

    event_time = F.col(column)
    if isinstance(df.schema[column].dataType, StructType):
        event_time = event_time.getField("end")  # a window: Spark compares its end
    return df.filter(event_time.isNull() | (event_time > F.timestamp_millis(F.lit(late_watermark_ms))))


def key_serializer_for(df: Any, key_col: str) -> str:
    """The key serializer of a grouping column: ``str`` for strings, ``int`` for integral types."""
    from pyspark.sql.types import ByteType, IntegerType, LongType, ShortType, StringType

    if key_col not in df.columns:
        raise InvalidArgumentError(f"the DataFrame has no column {key_col!r} to group by (columns: {df.columns})")
    dtype = df.schema[key_col].dataType
    if isinstance(dtype, StringType):
        return "str"
    if isinstance(dtype, (ByteType, ShortType, IntegerType, LongType)):
        return "int"
    raise InvalidArgumentError(
        f"grouping column {key_col!r} is {dtype.simpleString()}; group by a string or integral column "
        "(cast it, or concatenate several grouping columns into one string column)"
    )


def build_plan(
    processor: Any,
    operators: Sequence[OperatorSpec],
    operator: str,
    key_col: str,
    key_serializer: str,
    output_schema: Any,
    time_mode: str,
    initial_state: Any = None,
    grouping: Sequence[str] = (),
) -> tuple[_ProcessorPlan, Any]:
    """Check the processor against the job's operator and parse its schemas: the tasks' plan and the output StructType."""
    from pyspark.sql.pandas.types import to_arrow_schema

    mode = parse_time_mode(time_mode)
    if key_serializer not in ("str", "int"):
        raise InvalidArgumentError(
            f"key_serializer must be 'str' or 'int' (the grouping column's type), not {key_serializer!r}"
        )
    states = processor_states(processor)
    check_operator(states, operators, operator, mode)
    schemas = {
        s.name: (
            parse_schema(s.schema, f"state {s.name!r}"),
            parse_schema(s.user_key_schema, f"state {s.name!r} (user key)") if s.kind is StateKind.MAP else None,
        )
        for s in states
    }
    output = parse_schema(output_schema, "output_schema")
    initial_columns: tuple[str, ...] = ()
    if initial_state is not None:
        if not hasattr(initial_state, "columns") or not hasattr(initial_state, "unionByName"):
            raise InvalidArgumentError(
                f"initial_state is a DataFrame with the grouping column {key_col!r} (not grouped), "
                f"got {type(initial_state).__name__}"
            )
        for column in grouping or (key_col,):
            if column not in initial_state.columns:
                raise InvalidArgumentError(
                    f"initial_state has no grouping column {column!r} (columns: {initial_state.columns})"
                )
        if not grouping and key_serializer_for(initial_state, key_col) != key_serializer:
            raise InvalidArgumentError(f"initial_state's column {key_col!r} has another type than the input's")
        if INITIAL_FLAG in initial_state.columns:
            raise InvalidArgumentError(f"initial_state has a column named {INITIAL_FLAG!r}, which the runtime uses")
        initial_columns = tuple(initial_state.columns)
    plan = _ProcessorPlan(
        key_col, key_serializer, states, schemas, to_arrow_schema(output), mode, initial_columns, tuple(grouping)
    )
    return plan, output


def output_sink(
    sink: Callable[[Any, int], None], sink_format: str, output: Any, spark: Any = None
) -> Callable[[Any, int], None]:
    """The ``foreach_batch`` sink (a pyarrow Table per batch) turned into what the user's sink takes.

    ``spark``: the session that builds the Spark DataFrames (``sink_format="spark"``); None: the
    driver's active session now (the streaming query calls the sink from its own thread, where
    there may be none).
    """
    if sink_format not in SINK_FORMATS:
        raise InvalidArgumentError(f"sink_format {sink_format!r} is not one of {', '.join(SINK_FORMATS)}")
    if not callable(sink):
        raise InvalidArgumentError(f"sink must be a function (output, batch_id), got {type(sink).__name__}")
    if sink_format == "arrow":
        return sink
    if sink_format == "pandas":

        def to_pandas(table: Any, batch_id: int) -> None:
            sink(table.to_pandas(), batch_id)

        return to_pandas
    if spark is None:
        from pyspark.sql import SparkSession

        spark = SparkSession.getActiveSession()
    if spark is None:
        raise InvalidArgumentError(
            "sink_format='spark' needs a SparkSession: create it first, or pass sink_format='pandas' or 'arrow'"
        )

    def to_spark(table: Any, batch_id: int) -> None:
        sink(spark.createDataFrame(table, schema=output), batch_id)

    return to_spark
