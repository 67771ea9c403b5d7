"""foreachBatch integration: each micro-batch is one epoch, applied exactly once.

Driver side::

    runtime = KeyedStateRuntime("127.0.0.1:6123", "sessions", operators)
    query = (events.writeStream
             .foreachBatch(runtime.foreach_batch(process, key_col="user", operator="sessions"))
             .option("checkpointLocation", spark_checkpoint_dir).start())

``process(batches, state)`` runs once per Spark partition on an executor: ``batches`` is an
iterator of ``pyarrow.RecordBatch`` (the partition's rows, Arrow-native: no per-Row conversion)
and ``state`` a :class:`PartitionState` whose handles stage every write in the task's epoch
transaction; ``state.batch_id`` is the Spark batch id. Reads see the state committed through
the previous batch plus the task's own writes.

How one batch runs (docs/exactly-once.md has the whole protocol):

1. The driver asks the JobManager where the batch stands (``BeginBatch``): its job epoch, and
   whether to run it, only make it durable (the state already holds it: Spark re-runs a batch
   after a driver restart), wait (the job is restarting), or stop (the job FAILED or was
   cancelled). A batch the state cannot take next — it would skip epochs, after an older
   checkpoint was restored or the job was resubmitted empty — is refused with
   ``EpochGapError``, and nothing is applied.
2. The DataFrame is repartitioned by key group at the job's *current* parallelism, so Spark
   partition ``i`` talks to subtask ``i`` only, and ``process`` runs in ``mapInArrow`` under the
   routing version the batch began with. Each task returns its ``(partition, attempt)`` and its
   ledger (how many write requests each slot acknowledged). Spark keeps exactly one successful
   attempt per partition; failed, killed and losing speculative attempts are never named.
3. The driver commits the epoch with those winners: the JobManager checks every slot, then
   applies the winners' staged writes on every TaskManager and drops the rest, and answers once a
   completed checkpoint holds the epoch.
4. Anything that makes the batch's writes unusable (a failover, a redeploy, a commit refused) runs
   the batch again, within ``max_batch_attempts`` runs and ``batch_timeout_s``; ``foreachBatch``
   returns only once a completed checkpoint holds the batch, and otherwise raises with the reason.

Direct mode (``exactly_once=False``) writes straight to the state: lower latency, but a
retried or re-executed task applies its writes again (at-least-once).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from keyedstate.common.auth import resolve_token
from keyedstate.common.batches import Winner
from keyedstate.common.client import (
    BatchAction,
    BatchStart,
    CheckpointSummary,
    EpochCommitted,
    EpochScope,
    JobProgress,
    ListState,
    MapState,
    ReducingState,
    Routing,
    StateClient,
    TimerService,
    ValueState,
    status_name,
)
from keyedstate.common.clock import SYSTEM_CLOCK, Clock
from keyedstate.common.descriptors import OperatorSpec
from keyedstate.common.errors import (
    CheckpointError,
    EpochConflictError,
    EpochGapError,
    InvalidArgumentError,
    JobStateError,
    KeyedStateError,
    Reason,
    UnavailableError,
)
from keyedstate.common.keygroups import key_group_range_for_subtask
from keyedstate.common.retry import RetryPolicy, Waiter, call_with_retries
from keyedstate.common.rpc.convert import winner_from_bytes, winner_to_bytes
from keyedstate.common.security.tls import ChannelSecurity
from keyedstate.common.spark._credentials import executor_token_name, spark_file
from keyedstate.common.spark._modes import BatchMode, ReduceInto
from keyedstate.common.spark._processor import (
    COMPOSITE_KEY,
    TIMER_DOMAINS,
    ProcessorPartition,
    build_plan,
    check_timer_grouping,
    drop_late_rows,
    event_time_column,
    key_serializer_for,
    output_sink,
    parse_time_mode,
    with_composite_key,
    with_initial_state,
)
from keyedstate.common.spark._timers import BatchTimes, TimerFn, batch_times, fire_due

logger = logging.getLogger(__name__)

_CLIENTS: dict[tuple[str, Any, str], StateClient] = {}
_CLIENTS_LOCK = threading.Lock()
_WAIT_S = 0.2

# Errors raised on executors that mean "the batch's writes cannot be committed; run it again".
# A Spark job failure carries the executor's traceback as text, so they are recognised by name.
_STATE_PATH_ERRORS = ("EpochConflictError", "StaleRoutingError", "UnavailableError", "JobStateError", "LEASE_EXPIRED")


def worker_client(address: str, security: ChannelSecurity | None = None, token_file: str | None = None) -> StateClient:
    """One client per worker process, JobManager, TLS setting and token file (Spark reuses Python workers).

    ``security`` arrives pickled with the task: the executor reads the same certificate paths
    when it can (and follows their rotation), else uses the PEM bytes shipped from the driver.
    ``token_file``: the name of a token file shipped to the executors (``--files`` or
    ``KeyedStateRuntime(executor_token_file=...)``), resolved with ``SparkFiles.get``; without it
    the executor's environment (``KEYEDSTATE_TOKEN_FILE``, ``KEYEDSTATE_TOKEN``) is used.
    """
    key = (address, security.cache_key() if security is not None else None, token_file or "")
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            token = resolve_token(token_file, resolve_path=spark_file)
            client = StateClient(address, security=security, token=token)
            _CLIENTS[key] = client
        return client


class PartitionState:
    """State handles for one Spark task, bound to its epoch transaction (or direct)."""

    def __init__(
        self,
        client: StateClient,
        job_id: str,
        operator_id: str,
        epoch: EpochScope | None,
        batch_id: int = -1,
        times: BatchTimes | None = None,
        partition: int = -1,
    ) -> None:
        self.client = client
        self.job_id = job_id
        self.operator_id = operator_id
        self.scope = epoch
        self.batch_id = batch_id
        """The Spark batch id this task runs for."""
        self.times = times
        """The batch's watermark and processing time (None: the batch fires no timers)."""
        self.partition = partition
        """The Spark partition the task runs (in the keyed mode: the operator's subtask it serves)."""
        self._handles: dict[tuple[Any, ...], Any] = {}

    def key_groups(self) -> range:
        """The key groups of this task's subtask (keyed mode: partition ``i`` holds every key of subtask ``i``)."""
        if self.partition < 0:
            raise InvalidArgumentError("this task has no partition, so no key groups of its own")
        routing = self.client.routing(self.job_id)
        groups = key_group_range_for_subtask(
            routing.max_parallelism, routing.operator(self.operator_id).parallelism, self.partition
        )
        return range(groups.start, groups.end + 1)

    @property
    def epoch(self) -> int | None:
        """The job epoch the task's writes belong to (None in direct mode)."""
        return self.scope.epoch if self.scope is not None else None

    def _get(self, cls: type, name: str, operator: str | None, **kw: Any) -> Any:
        key = (cls, name, operator, tuple(sorted(kw.items())))
        handle = self._handles.get(key)
        if handle is None:
            handle = cls(self.client, self.job_id, operator or self.operator_id, name, epoch=self.scope, **kw)
            self._handles[key] = handle
        return handle

    def value(
        self, name: str, *, operator: str | None = None, key_serializer: str = "str", value_serializer: str = "pickle"
    ) -> ValueState[Any, Any]:
        """A ValueState handle on state ``name`` of this task's operator (or ``operator``), bound to the
        task's epoch; cached per arguments, so asking again per record is cheap.
        """
        handle: ValueState[Any, Any] = self._get(
            ValueState, name, operator, key_serializer=key_serializer, value_serializer=value_serializer
        )
        return handle

    def list(
        self, name: str, *, operator: str | None = None, key_serializer: str = "str", value_serializer: str = "pickle"
    ) -> ListState[Any, Any]:
        """A ListState handle on state ``name`` of this task's operator (or ``operator``), bound to the
        task's epoch; cached per arguments, so asking again per record is cheap.
        """
        handle: ListState[Any, Any] = self._get(
            ListState, name, operator, key_serializer=key_serializer, value_serializer=value_serializer
        )
        return handle

    def map(
        self,
        name: str,
        *,
        operator: str | None = None,
        key_serializer: str = "str",
        user_key_serializer: str = "str",
        value_serializer: str = "pickle",
    ) -> MapState[Any, Any, Any]:
        """A MapState handle on state ``name`` of this task's operator (or ``operator``), bound to the
        task's epoch; cached per arguments, so asking again per record is cheap.
        """
        handle: MapState[Any, Any, Any] = self._get(
            MapState,
            name,
            operator,
            key_serializer=key_serializer,
            user_key_serializer=user_key_serializer,
            value_serializer=value_serializer,
        )
        return handle

    def reducing(self, name: str, *, operator: str | None = None, key_serializer: str = "str") -> ReducingState[Any]:
        """A ReducingState handle on state ``name`` of this task's operator (or ``operator``), bound to
        the task's epoch; cached per arguments, so asking again per record is cheap.
        """
        handle: ReducingState[Any] = self._get(ReducingState, name, operator, key_serializer=key_serializer)
        return handle

    def timers(
        self, name: str = "timers", *, operator: str | None = None, key_serializer: str = "str"
    ) -> TimerService[Any]:
        """The TimerService on timers state ``name`` (declared with ``timers_state(name)``), bound to the
        task's epoch: timers registered or deleted here commit with the batch.
        """
        handle: TimerService[Any] = self._get(TimerService, name, operator, key_serializer=key_serializer)
        return handle

    @property
    def watermark_ms(self) -> int | None:
        """The batch's event-time watermark (Spark's ``batchWatermarkMs``; None outside a streaming query)."""
        return self.times.watermark_ms if self.times is not None else None

    @property
    def batch_timestamp_ms(self) -> int | None:
        """The batch's processing time (Spark's ``batchTimestampMs``; None when the batch fires no timers)."""
        return self.times.timestamp_ms if self.times is not None else None


ProcessFn = Callable[[Iterator[Any], PartitionState], "Iterable[Any] | None"]
"""``process(batches, state)``: returns None, or (with ``output_schema``) an iterable of ``pyarrow.RecordBatch``."""
OutputSink = Callable[[Any, int], None]
"""``sink(table, batch_id)``: a batch's output (a ``pyarrow.Table``) on the driver, before its commit."""


@dataclass(frozen=True)
class BatchTiming:
    """Where one micro-batch's time went on the driver (seconds), for profiling a pipeline."""

    batch_id: int
    tasks_s: float
    """The Spark job: partitioning, ``process`` on every partition, collecting the winners."""
    commit_s: float
    """The epoch commit on every TaskManager, and the checkpoint when one is taken (waited for)."""
    total_s: float
    """The whole ``foreachBatch`` call, retries and driver-side calls included."""
    checkpoint_s: float = 0.0
    """The part of ``commit_s`` the checkpoint took, as the JobManager measured it (0 without one)."""
    sink_s: float = 0.0
    """The output sink (``foreach_batch(sink=...)``), part of ``total_s`` (0 without one)."""


class BatchTimeoutError(KeyedStateError):
    """A batch could not be made durable within ``batch_timeout_s`` (or ``max_batch_attempts`` runs)."""

    reason = Reason.UNAVAILABLE


@dataclass(frozen=True)
class BatchOptions:
    """How ``foreach_batch`` runs batches (see :meth:`KeyedStateRuntime.foreach_batch`)."""

    operator_id: str
    key_col: str | None
    key_serializer: str = "str"
    exactly_once: bool = True
    checkpoint: bool = True
    max_batch_attempts: int = 5
    batch_timeout_s: float = 600.0
    mode: BatchMode = BatchMode.KEYED
    output_schema: Any = None
    """A ``pyarrow.Schema``: ``process`` returns record batches of it (None: it returns nothing)."""
    sink: OutputSink | None = None
    on_timer: TimerFn | None = None
    """Called per task with its fired timers, after ``process`` (None: the batches fire no timers)."""
    timers_state: str = "timers"
    read_times: bool = False
    """Give ``process`` the batch's times (``state.times``) without ``on_timer``: a StatefulProcessor's timers."""
    drop_late_events: bool = False
    """Drop the rows whose event time (the ``withWatermark`` column) is at or before the previous batch's
    watermark before ``process`` sees them, as Spark's EventTime ``transformWithState`` does."""


class KeyedStateRuntime:
    """The driver's handle on one job of the runtime: submission, batches, epoch commits."""

    def __init__(
        self,
        jobmanager: str,
        job_id: str,
        operators: Sequence[OperatorSpec],
        *,
        max_parallelism: int = 0,
        job_config: dict[str, str] | None = None,
        restore_path: str = "",
        security: ChannelSecurity | None = None,
        token_file: str | None = None,
        executor_token_file: str | None = None,
        clock: Clock = SYSTEM_CLOCK,
        waiter: Waiter | None = None,
    ) -> None:
        """Submit (or attach to) the job. A job already running keeps its current definition: a
        restarted driver adopts a parallelism changed by a rescale.

        ``security``: TLS to the cluster's client plane, for the driver and the executors
        (``client_security(conf)`` from the security.ssl.rest.* keys; None: plaintext).

        With authentication on (docs/security.md): the driver's token comes from ``token_file``,
        else from ``KEYEDSTATE_TOKEN_FILE`` / ``KEYEDSTATE_TOKEN``; it submits the job, so it needs
        role admin on the job. The executors' token (role writer is enough) is the file
        ``executor_token_file``, shipped to them, or the file named by the Spark conf key
        ``spark.keyedstate.tokenFile`` (shipped with ``spark-submit --files``).

        ``clock`` and ``waiter`` time the batches' deadlines and waits (tests inject fakes); the
        default waiter is released by :meth:`close`.
        """
        self.jobmanager = jobmanager
        self.clock = clock
        self._closing = threading.Event()
        self.waiter: Waiter = waiter if waiter is not None else self._closing
        self.job_id = job_id
        self.operators = list(operators)
        self.security = security
        self.executor_token_file = executor_token_file
        self._executor_token: tuple[str | None] | None = None
        self.client = StateClient(jobmanager, security=security, token=resolve_token(token_file), clock=clock)
        routing = self.client.submit_job(
            job_id, self.operators, max_parallelism=max_parallelism, restore_path=restore_path, config=job_config
        )
        self.max_parallelism = routing.max_parallelism
        # Spark task attempt ids restart at 0 in a new SparkContext. Folding a random per-driver
        # number into every attempt id keeps a restarted driver's attempts distinct from
        # writes an earlier driver staged for the same (uncommitted) epoch.
        self.driver_nonce = secrets.randbits(30) + 1
        self.batches_run = 0
        """Batches applied by this driver."""
        self.batches_skipped = 0
        """Batches the state already held (a re-run after a driver restart): only made durable."""
        self.batch_attempts = 0
        """Runs of batches' Spark jobs, re-runs included."""
        self.last_batch_id = -1
        """The last batch ``foreachBatch`` returned for (durable)."""
        self.last_checkpoint: CheckpointSummary | None = None
        """The checkpoint that made the last batch durable (None before the first, and in direct mode)."""
        self.timings: list[BatchTiming] = []

    # -- queries -------------------------------------------------------------------------------
    def job_info(self) -> JobProgress:
        """The job's status and epochs as the JobManager sees them now (one RPC per call, not cached).

        The whole JobInfo (operators, lineage, checkpoints) is ``self.client.job_info(self.job_id)``.
        """
        return self.client.job_progress(self.job_id)

    def committed_epoch(self) -> int:
        """The epoch the job's state holds."""
        return self.job_info().committed_epoch

    def durable_epoch(self) -> int:
        """The epoch of the job's latest completed checkpoint (-1: none)."""
        return self.job_info().durable_epoch

    def parallelism(self, operator_id: str) -> int:
        """The operator's parallelism now (a rescale changes it)."""
        routing = self.client.routing(self.job_id, refresh=True)
        return routing.operator(operator_id).parallelism

    # -- batches -------------------------------------------------------------------------------
    def foreach_batch(
        self,
        process: ProcessFn,
        *,
        key_col: str | None = None,
        operator: str | None = None,
        key_serializer: str = "str",
        mode: BatchMode | str = BatchMode.KEYED,
        output_schema: Any = None,
        sink: OutputSink | None = None,
        exactly_once: bool = True,
        checkpoint: bool = True,
        max_batch_attempts: int = 5,
        batch_timeout_s: float = 600.0,
        on_timer: TimerFn | None = None,
        timers_state: str = "timers",
    ) -> Callable[[Any, int], None]:
        """A ``foreachBatch`` function that runs ``process`` per partition, one epoch per batch.

        ``mode``: ``"keyed"`` (the default) repartitions the batch by key group on ``key_col``, so a
        task holds every row of its keys; ``"shuffle_free"`` runs ``process`` on the input partitions
        as they are and lets the client route each write to its key's owner, for updates that
        commute across partitions (see :class:`BatchMode`; ``key_col`` is then not needed).

        ``output_schema`` and ``sink``: ``process`` returns an iterable of ``pyarrow.RecordBatch`` of
        that schema, and ``sink(table, batch_id)`` gets the winning attempts' output on the driver
        after the batch's Spark job and before its commit. A batch can run more than once (a failover,
        a driver restart before Spark recorded it), so the sink must be idempotent per ``batch_id``,
        as Spark's own foreachBatch contract asks; a batch whose state was already committed by an
        earlier driver is not run again, and that driver's sink call came before the commit.

        ``checkpoint``: take a checkpoint of every batch (True), or return once a periodic one
        (``execution.checkpointing.interval``) holds it (False). Either way the function returns
        only when a completed checkpoint holds the batch. ``max_batch_attempts`` bounds how often
        the batch's Spark job runs (every failover under it costs one) and ``batch_timeout_s`` the
        whole call; past either, it raises with the last reason. Per-batch timings are appended to
        :attr:`timings`.

        ``on_timer(timers, state)``: fire timers (see the README's "Timers"). After ``process`` has
        consumed a task's rows, the task pops the timers of its key groups that are due (event
        time at or before the batch's watermark, processing time at or before the batch's
        timestamp; both as Spark recorded them for the batch) from the timers state
        ``timers_state`` and hands them to ``on_timer``, which may output rows like ``process``.
        Popping and the handler's writes commit with the batch's epoch, so each timer fires once.
        Needs the keyed mode (a task owns its key groups).
        """
        if max_batch_attempts < 1 or batch_timeout_s <= 0:
            raise InvalidArgumentError("max_batch_attempts must be >= 1 and batch_timeout_s > 0")
        parsed = BatchMode.parse(mode)
        if parsed is BatchMode.KEYED and not key_col:
            raise InvalidArgumentError(
                "foreach_batch in the keyed mode needs key_col (the column it partitions by); "
                "for commutative updates without a shuffle pass mode='shuffle_free'"
            )
        if (output_schema is None) != (sink is None):
            raise InvalidArgumentError("foreach_batch: output_schema and sink go together (pass both or neither)")
        if output_schema is not None:
            _check_schema(output_schema)
        if on_timer is not None and parsed is not BatchMode.KEYED:
            raise InvalidArgumentError(
                "foreach_batch: timers (on_timer) need the keyed mode, where each task owns the key groups it fires"
            )
        options = BatchOptions(
            operator or self.operators[0].operator_id,
            key_col,
            key_serializer,
            exactly_once,
            checkpoint,
            max_batch_attempts,
            batch_timeout_s,
            parsed,
            output_schema,
            sink,
            on_timer,
            timers_state,
        )
        return _BatchRunner(self, process, options)

    def reduce_batch(
        self,
        state: str,
        *,
        key_col: str,
        fields: Mapping[str, str],
        operator: str | None = None,
        key_serializer: str = "str",
        checkpoint: bool = True,
        max_batch_attempts: int = 5,
        batch_timeout_s: float = 600.0,
    ) -> Callable[[Any, int], None]:
        """A shuffle-free ``foreachBatch`` function folding each batch into the ReducingState ``state``.

        Each input partition groups its rows per ``key_col`` with Arrow (as Spark's partial
        aggregation does) and sends one operand per key straight to the key's owner; the epoch
        commit applies the winning attempts exactly once. ``fields`` maps every reduce field of the
        state to the column it folds (SUM, MIN or MAX, as the field declares) or to ``"*"`` to
        count rows: ``{"count": "*", "sum": "amount"}``. Checked here against the job's operators.
        """
        op = operator or self.operators[0].operator_id
        process = ReduceInto.checked(self.operators, op, state, key_col, fields, key_serializer)
        return self.foreach_batch(
            process,
            key_col=key_col,
            operator=op,
            key_serializer=key_serializer,
            mode=BatchMode.SHUFFLE_FREE,
            checkpoint=checkpoint,
            max_batch_attempts=max_batch_attempts,
            batch_timeout_s=batch_timeout_s,
        )

    def processor_batch(
        self,
        processor: Any,
        *,
        key_col: str | Sequence[str],
        output_schema: Any,
        sink: Callable[[Any, int], None],
        sink_format: str = "spark",
        key_serializer: str = "str",
        operator: str | None = None,
        time_mode: str = "None",
        checkpoint: bool = True,
        max_batch_attempts: int = 5,
        batch_timeout_s: float = 600.0,
        spark: Any = None,
        initial_state: Any = None,
    ) -> Callable[[Any, int], None]:
        """A ``foreachBatch`` function running a PySpark ``StatefulProcessor`` unchanged, one epoch per batch.

        The keyed mode on ``key_col`` (``key_serializer``: ``"str"`` or ``"int"``, the column's
        type; several grouping columns, as in ``groupBy("a", "b")``, are one state key: the JSON
        Spark's ``to_json(struct(a, b))`` makes of them, and the processor gets the tuple): each task runs the processor's ``init``, then ``handleInputRows((key,), frames,
        timerValues)`` per key against local handles (value and list states read in bulk, writes
        sent in bulk into the task's epoch). ``operator`` must declare the states ``init`` asks
        for (build it with ``processor_operator``). ``output_schema``: the processor's output, a
        ``StructType`` or DDL string as Spark's ``outputStructType``; ``sink(output, batch_id)`` gets
        each batch's output on the driver before the commit, as a Spark DataFrame
        (``sink_format="spark"``), a pandas DataFrame (``"pandas"``) or a pyarrow Table
        (``"arrow"``); write it idempotently per ``batch_id`` (a batch can run again).
        ``time_mode``: Spark's ``timeMode``: ``"None"``, or ``"ProcessingTime"`` / ``"EventTime"`` with
        timers (the operator then declares the timers state: ``processor_operator(..., time_mode=...)``):
        ``registerTimer``/``deleteTimer``/``listTimers`` per key, staged in the task's epoch, and
        ``handleExpiredTimer`` for the timers due at the batch timestamp / watermark after the task's
        rows; with ``"EventTime"`` rows at or before the previous batch's watermark are dropped, as in
        Spark. ``TimerValues`` carry the batch timestamp and watermark Spark recorded for the batch
        (-1, -1 in mode ``"None"``). ``spark``: the session the
        Spark DataFrames are built in (default: the active one). ``initial_state``: a DataFrame
        with ``key_col`` (Spark's ``initialState``, not grouped): in the query's first batch
        (``batch_id`` 0) each of its keys goes through ``handleInitialState`` before its rows, in
        the same epoch. The rest is :meth:`foreach_batch`.
        """
        op = operator or self.operators[0].operator_id
        columns = (key_col,) if isinstance(key_col, str) else tuple(key_col)
        if not columns or not all(isinstance(c, str) and c for c in columns):
            raise InvalidArgumentError(f"key_col is a column name or a sequence of them, got {key_col!r}")
        grouping = columns if len(columns) > 1 else ()
        if grouping:
            key_serializer = "str"  # the JSON of the grouping columns
        state_key = COMPOSITE_KEY if grouping else columns[0]
        plan, output = build_plan(
            processor, self.operators, op, state_key, key_serializer, output_schema, time_mode, initial_state, grouping
        )
        partition = ProcessorPartition(processor, plan)
        runner = self.foreach_batch(
            partition,
            key_col=state_key,
            operator=op,
            key_serializer=key_serializer,
            mode=BatchMode.KEYED,
            output_schema=plan.output_arrow,
            sink=output_sink(sink, sink_format, output, spark),
            checkpoint=checkpoint,
            max_batch_attempts=max_batch_attempts,
            batch_timeout_s=batch_timeout_s,
        )
        timers = plan.time_mode in TIMER_DOMAINS
        if timers:
            assert isinstance(runner, _BatchRunner)
            # TimerValues in every task, and (EventTime) late rows dropped before the processor, as Spark does.
            options = dataclasses.replace(
                runner.options, read_times=True, drop_late_events=plan.time_mode == "EventTime"
            )
            runner = _BatchRunner(self, partition, options)
        if initial_state is None and not grouping:
            return runner
        initial = (
            with_composite_key(initial_state, grouping) if grouping and initial_state is not None else initial_state
        )

        def batch(df: Any, batch_id: int) -> None:
            if grouping:
                check_timer_grouping(df, grouping, plan.time_mode)
                df = with_composite_key(df, grouping)
            # The initial state in batch 0 only, as Spark applies it; a re-run of it is deduplicated by its epoch.
            if initial is not None and batch_id == 0:
                df = with_initial_state(df, initial)
            runner(df, batch_id)

        return batch

    def transform_with_state_in_pandas(
        self,
        df: Any,
        processor: Any,
        *,
        key_col: str | Sequence[str],
        output_schema: Any,
        sink: Callable[[Any, int], None],
        sink_format: str = "spark",
        operator: str | None = None,
        time_mode: str = "None",
        checkpoint: bool = True,
        max_batch_attempts: int = 5,
        batch_timeout_s: float = 600.0,
        initial_state: Any = None,
    ) -> Any:
        """``df.groupBy(key_col).transformWithStateInPandas(processor, ...)`` then ``foreachBatch(sink)``, on this runtime.

        Returns the ``DataStreamWriter`` of ``df`` with the batch function set: add the
        ``checkpointLocation`` and ``start()``. The key serializer follows ``key_col``'s type.
        See :meth:`processor_batch`.
        """
        for column in [key_col] if isinstance(key_col, str) else key_col:
            if column not in df.columns:
                raise InvalidArgumentError(
                    f"the DataFrame has no column {column!r} to group by (columns: {df.columns})"
                )
        mode = parse_time_mode(time_mode)
        if not isinstance(key_col, str):
            check_timer_grouping(df, key_col, mode)
        if mode == "EventTime" and event_time_column(df) is None:
            # Spark (4.3, measured) accepts this too: the watermark stays 0 and event-time timers wait for it.
            logger.warning(
                "job %s: time_mode 'EventTime' on a stream without withWatermark: the watermark stays 0, so "
                "event-time timers after 1970 never fire; call withWatermark on the event-time column first",
                self.job_id,
            )
        on_batch = self.processor_batch(
            processor,
            key_col=key_col,
            output_schema=output_schema,
            sink=sink,
            sink_format=sink_format,
            key_serializer=key_serializer_for(df, key_col) if isinstance(key_col, str) else "str",
            operator=operator,
            time_mode=time_mode,
            checkpoint=checkpoint,
            max_batch_attempts=max_batch_attempts,
            batch_timeout_s=batch_timeout_s,
            spark=df.sparkSession,
            initial_state=initial_state,
        )
        return df.writeStream.foreachBatch(on_batch)

    def executor_token_name(self, spark: Any) -> str | None:
        """The token file name executors resolve (shipped once per runtime); None: their environment."""
        if self._executor_token is None:
            self._executor_token = (executor_token_name(spark, self.executor_token_file),)
        return self._executor_token[0]

    def close(self) -> None:
        """Close the driver's client; a batch waiting to try again gives up at once."""
        self._closing.set()
        self.client.close()


class _TryAgain(Exception):
    """Internal: the batch is not durable yet; ``wait``: the cluster is not ready, so pause before the next pass."""

    def __init__(self, reason: str, wait: bool) -> None:
        super().__init__(reason)
        self.wait = wait


def _is_try_again(exc: BaseException) -> bool:
    return isinstance(exc, _TryAgain)


def _is_try_again_now(exc: BaseException) -> bool:
    """A re-run or a new commit goes at once: what failed has already taken its time."""
    return isinstance(exc, _TryAgain) and not exc.wait


@dataclass
class _BatchAttempt:
    """Where one ``foreachBatch`` call stands across its passes."""

    batch_id: int
    query_id: str
    deadline_ms: int
    runs: int = 0
    tasks_s: float = 0.0
    commit_s: float = 0.0
    sink_s: float = 0.0
    last: str = "none"

    def again(self, reason: str, *, wait: bool = False) -> _TryAgain:
        self.last = reason
        return _TryAgain(reason, wait)


class _BatchRunner:
    """One ``foreachBatch`` function (see :meth:`KeyedStateRuntime.foreach_batch`)."""

    def __init__(self, runtime: KeyedStateRuntime, process: ProcessFn, options: BatchOptions) -> None:
        self._rt = runtime
        self._process = process
        self._o = options
        self._times: BatchTimes | None = None

    @property
    def options(self) -> BatchOptions:
        """How this function runs batches."""
        return self._o

    def __call__(self, df: Any, batch_id: int) -> None:
        started = time.perf_counter()
        # Read once per call: every run of the batch fires timers at the same times.
        wants_times = self._o.on_timer is not None or self._o.read_times
        self._times = batch_times(df, batch_id, _query_id(df), self._rt.clock) if wants_times else None
        if self._o.drop_late_events and self._times is not None and self._times.late_watermark_ms is not None:
            column = event_time_column(df)
            if column is not None:
                df = drop_late_rows(df, column, self._times.late_watermark_ms)
        if not self._o.exactly_once:
            self._rt.batch_attempts += 1
            routing = self._rt.client.routing(self._rt.job_id, refresh=True)
            _, output = self._run_tasks(df, batch_id, None, routing)
            tasks_s = time.perf_counter() - started
            sink_s = self._sink(output, batch_id)
            self._done(batch_id, started, tasks_s, 0.0, None, sink_s=sink_s)
            return
        self._run_exactly_once(df, batch_id, _query_id(df), started)

    def _run_exactly_once(self, df: Any, batch_id: int, query_id: str, started: float) -> None:
        """Run the batch until a completed checkpoint holds it, within ``batch_timeout_s`` and ``max_batch_attempts`` runs."""
        clock, options = self._rt.clock, self._o
        attempt = _BatchAttempt(batch_id, query_id, clock.monotonic_ms() + int(options.batch_timeout_s * 1000))
        policy = RetryPolicy.polling(_WAIT_S, deadline_s=options.batch_timeout_s)
        try:
            response, start = call_with_retries(
                lambda: self._try_batch(df, attempt),
                what=f"job {self._rt.job_id}: batch {batch_id}",
                policy=policy,
                waiter=self._rt.waiter,
                is_transient=_is_try_again,
                immediate=_is_try_again_now,
                clock=clock,
                log_level=logging.DEBUG,
            )
        except _TryAgain:
            raise BatchTimeoutError(
                f"job {self._rt.job_id!r}: batch {batch_id} did not become durable within {options.batch_timeout_s:.0f} s "
                f"(batch_timeout_s) after {attempt.runs} run(s); the last reason: {attempt.last}"
            ) from None
        skipped = start.action is BatchAction.ALREADY_COMMITTED and attempt.runs == 0
        if skipped:
            logger.info(
                "job %s: batch %d (epoch %d) was already committed; it is durable",
                self._rt.job_id,
                batch_id,
                start.epoch,
            )
        self._done(
            batch_id,
            started,
            attempt.tasks_s,
            attempt.commit_s,
            response.checkpoint,
            skipped=skipped,
            sink_s=attempt.sink_s,
        )

    def _try_batch(self, df: Any, attempt: _BatchAttempt) -> tuple[EpochCommitted, BatchStart]:
        """One pass: where the batch stands, its Spark job when it must run, the commit; _TryAgain otherwise."""
        rt, job_id, batch_id = self._rt, self._rt.job_id, attempt.batch_id
        try:
            start = rt.client.begin_batch(job_id, attempt.query_id, batch_id)
        except (UnavailableError, JobStateError) as exc:
            raise attempt.again(f"the JobManager did not answer BeginBatch: {exc.message}", wait=True) from exc
        if start.action is BatchAction.STOP:
            raise JobStateError(
                f"job {job_id!r} is {status_name(start.job_status)}: {start.failure_cause or 'no cause recorded'}; the query stops "
                f"at batch {batch_id} (restore the job from its latest checkpoint to go on)"
            )
        if start.action is BatchAction.WAIT:
            raise attempt.again(f"job {status_name(start.job_status)}: {start.failure_cause}", wait=True)
        winners: list[Winner] = []
        if start.action is BatchAction.RUN:
            winners, output = self._run_batch_job(df, start, attempt)
            # Before the commit: once the state holds the batch, a re-run (after a driver restart)
            # is only made durable, so this is the one point every committed batch's output passed.
            attempt.sink_s += self._sink(output, attempt.batch_id)
        # (not RUN: the state holds the batch already; only make it durable)
        return self._commit(start, winners, attempt), start

    def _sink(self, output: Any, batch_id: int) -> float:
        """Hand the batch's output to the user's sink; the seconds it took (0 without a sink)."""
        if self._o.sink is None:
            return 0.0
        t0 = time.perf_counter()
        self._o.sink(output, batch_id)
        return time.perf_counter() - t0

    def _run_batch_job(self, df: Any, start: BatchStart, attempt: _BatchAttempt) -> tuple[list[Winner], Any]:
        if attempt.runs >= self._o.max_batch_attempts:
            raise BatchTimeoutError(
                f"job {self._rt.job_id!r}: batch {attempt.batch_id} ran {attempt.runs} times (max_batch_attempts) "
                f"without becoming durable; the last reason: {attempt.last}"
            )
        attempt.runs += 1
        self._rt.batch_attempts += 1
        t0 = time.perf_counter()
        try:
            return self._run_tasks(df, attempt.batch_id, start, start.routing)
        except Exception as exc:
            cause = _state_path_cause(exc)
            if cause is None:
                raise  # the user's code failed: Spark reports it as the query's error
            last = f"a task failed on the state path ({cause})"
            logger.warning(
                "job %s: batch %d run %d: %s; running it again", self._rt.job_id, attempt.batch_id, attempt.runs, last
            )
            raise attempt.again(last) from exc
        finally:
            attempt.tasks_s += time.perf_counter() - t0

    def _commit(self, start: BatchStart, winners: list[Winner], attempt: _BatchAttempt) -> EpochCommitted:
        rt, job_id = self._rt, self._rt.job_id
        t1 = time.perf_counter()
        try:
            response = rt.client.commit_epoch(
                job_id,
                start.epoch,
                winners,
                query_id=attempt.query_id,
                batch_id=attempt.batch_id,
                expected_routing_version=start.routing.version,
                checkpoint=self._o.checkpoint,
                wait_for_checkpoint=True,
                timeout_s=max(1.0, (attempt.deadline_ms - rt.clock.monotonic_ms()) / 1000.0),
            )
        except EpochGapError:
            raise
        except (EpochConflictError, JobStateError, UnavailableError, CheckpointError) as exc:
            logger.warning(
                "job %s: batch %d (epoch %d): %s; trying again", job_id, attempt.batch_id, start.epoch, exc.message
            )
            raise attempt.again(exc.message) from exc
        finally:
            attempt.commit_s += time.perf_counter() - t1
        cp = response.checkpoint
        if response.decided and response.committed_epoch >= start.epoch:
            return response  # overlapped commits: the decision in checkpoint storage makes the epoch durable
        if cp is None or not cp.completed or cp.epoch < start.epoch:
            # Defence in depth: the JobManager answers only with a completed checkpoint.
            last = f"the JobManager answered without a completed checkpoint holding epoch {start.epoch} ({status_name(cp.status if cp is not None else None)})"
            logger.error("job %s: batch %d: %s", job_id, attempt.batch_id, last)
            raise attempt.again(last)
        return response

    def _done(
        self,
        batch_id: int,
        started: float,
        tasks_s: float,
        commit_s: float,
        checkpoint: CheckpointSummary | None,
        skipped: bool = False,
        sink_s: float = 0.0,
    ) -> None:
        rt = self._rt
        if skipped:
            rt.batches_skipped += 1
        else:
            rt.batches_run += 1
        rt.last_batch_id = batch_id
        rt.last_checkpoint = checkpoint
        if skipped:
            return  # a replayed batch did no work worth timing
        checkpoint_s = checkpoint.duration_ms / 1000.0 if checkpoint is not None else 0.0
        rt.timings.append(BatchTiming(batch_id, tasks_s, commit_s, time.perf_counter() - started, checkpoint_s, sink_s))

    def _run_tasks(
        self, df: Any, batch_id: int, start: BatchStart | None, routing: Routing
    ) -> tuple[list[Winner], Any]:
        """Run ``process`` on every partition: the winners (with ledgers; none in direct mode) and the output table."""
        from pyspark.sql.types import BinaryType, IntegerType, LongType, StructField, StructType

        o = self._o
        if o.mode is BatchMode.KEYED:
            from keyedstate.common.spark._keygroups import repartition_by_key_group

            # The job's current parallelism, read every batch: a rescale changes it.
            parallelism = routing.operator(o.operator_id).parallelism
            assert o.key_col is not None  # foreach_batch refuses the keyed mode without one
            df = repartition_by_key_group(df, o.key_col, self._rt.max_parallelism, parallelism, o.key_serializer)
        task = _task_function(
            _TaskPlan(
                self._rt.jobmanager,
                self._rt.security,
                self._rt.executor_token_name(df.sparkSession),
                self._rt.job_id,
                o.operator_id,
                self._rt.driver_nonce,
                batch_id,
                start.epoch if start is not None else -1,
                start.routing.version if start is not None else 0,
                o.output_schema,
                self._times,
                o.timers_state,
                o.key_serializer,
            ),
            self._process,
            o.on_timer,
        )
        schema = StructType(
            [
                StructField("partition", IntegerType()),
                StructField("attempt", LongType()),
                StructField("winner", BinaryType()),
                StructField("output", BinaryType()),
            ]
        )
        rows = sorted(df.mapInArrow(task, schema).collect(), key=lambda r: r.partition)
        output = _decode_output([bytes(r.output) for r in rows], o.output_schema) if o.output_schema else None
        if start is None:
            return [], output
        return [winner_from_bytes(bytes(r.winner)) for r in rows], output


@dataclass(frozen=True)
class _TaskPlan:
    """What every task of one batch run needs, shipped to the executors with the task function."""

    address: str
    security: ChannelSecurity | None
    token_name: str | None
    job_id: str
    operator_id: str
    nonce: int
    batch_id: int
    epoch: int
    """-1: direct mode (no epoch transaction)."""
    routing_version: int
    output_schema: Any
    times: BatchTimes | None = None
    """When the batch fires timers: its watermark and timestamp."""
    timers_state: str = "timers"
    key_serializer: str = "str"


def _task_function(
    plan: _TaskPlan, process: ProcessFn, on_timer: TimerFn | None = None
) -> Callable[[Iterable[Any]], Iterator[Any]]:
    """The ``mapInArrow`` function of one batch run: ``process`` under the task's epoch scope, then one
    row with the task's partition, attempt, winner (with its ledger) and output."""

    def task(batches: Iterable[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if ctx is None:
            raise RuntimeError("keyedstate: the batch task runs outside a Spark task (no TaskContext)")
        partition, attempt = ctx.partitionId(), (plan.nonce << 32) | (ctx.taskAttemptId() & 0xFFFFFFFF)
        scope = None
        if plan.epoch >= 0:
            scope = EpochScope.for_task(plan.epoch, partition, attempt, routing_version=plan.routing_version)
        client = worker_client(plan.address, plan.security, plan.token_name)
        state = PartitionState(
            client, plan.job_id, plan.operator_id, scope, batch_id=plan.batch_id, times=plan.times, partition=partition
        )
        # The output is drained before the winner is read: a generator ``process`` writes state as it yields.
        if on_timer is None or plan.times is None:
            output = _encode_output(process(iter(batches), state), plan.output_schema)
        else:
            output = _encode_output(_rows_then_timers(plan, process, on_timer, batches, state), plan.output_schema)
        winner = winner_to_bytes(scope.winner()) if scope is not None else b""
        yield pa.RecordBatch.from_pydict(
            {"partition": [partition], "attempt": [attempt], "winner": [winner], "output": [output]},
            schema=pa.schema(
                [("partition", pa.int32()), ("attempt", pa.int64()), ("winner", pa.binary()), ("output", pa.binary())]
            ),
        )

    return task


def _rows_then_timers(
    plan: _TaskPlan,
    process: ProcessFn,
    on_timer: TimerFn,
    batches: Iterable[Any],
    state: PartitionState,
) -> Iterator[Any]:
    """Spark's order: the task's input rows through ``process`` first, then its due timers through ``on_timer``."""
    result = process(iter(batches), state)
    if result is not None:
        yield from result
    assert plan.times is not None
    # Partition i holds the keys of subtask i (keyed mode), so it fires the timers of that subtask's key groups.
    timers = state.timers(plan.timers_state, key_serializer=plan.key_serializer)
    fired = fire_due(timers, plan.times, state.key_groups())
    if fired:
        handled = on_timer(iter(fired), state)
        if handled is not None:
            yield from handled


def _check_schema(schema: Any) -> None:
    import pyarrow as pa

    if not isinstance(schema, pa.Schema):
        raise InvalidArgumentError(
            f"foreach_batch: output_schema must be a pyarrow.Schema (pa.schema([...])), not {type(schema).__name__}"
        )


def _encode_output(result: Iterable[Any] | None, schema: Any) -> bytes:
    """``process``'s return value as one Arrow IPC stream of ``schema`` (b"" without an output schema).

    Without a schema a returned iterator is still drained (a generator writes state as it runs) and
    must yield nothing.
    """
    if result is None:
        return b""
    if schema is None:
        if isinstance(result, Iterator):
            for _ in result:
                raise InvalidArgumentError(
                    "foreach_batch: process yielded output but foreach_batch was given no output_schema and sink"
                )
        return b""
    import pyarrow as pa

    if not isinstance(result, Iterable):
        raise InvalidArgumentError(
            f"foreach_batch: process must return an iterable of pyarrow.RecordBatch (or None), not {type(result).__name__}"
        )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        for item in result:
            writer.write_table(_as_output(item, schema))
    return bytes(sink.getvalue().to_pybytes())


def _as_output(item: Any, schema: Any) -> Any:
    """One yielded RecordBatch (or Table) as a Table of exactly ``schema``; InvalidArgumentError when it cannot be."""
    import pyarrow as pa

    if isinstance(item, pa.RecordBatch):
        item = pa.Table.from_batches([item])
    if not isinstance(item, pa.Table):
        raise InvalidArgumentError(
            f"foreach_batch: process yielded a {type(item).__name__}; it must yield pyarrow.RecordBatch (or Table)"
        )
    if item.schema.equals(schema):
        return item
    try:
        return item.select(schema.names).cast(schema)
    except (KeyError, ValueError, pa.ArrowException) as exc:
        raise InvalidArgumentError(
            f"foreach_batch: process yielded columns {item.schema} that do not fit output_schema {schema}: {exc}"
        ) from exc


def _decode_output(streams: Sequence[bytes], schema: Any) -> Any:
    """The winners' output streams as one ``pyarrow.Table`` of ``schema``, partitions ascending."""
    import pyarrow as pa

    tables = [pa.ipc.open_stream(raw).read_all() for raw in streams if raw]
    return pa.concat_tables(tables) if tables else schema.empty_table()


def _query_id(df: Any) -> str:
    """The streaming query's id (stable for its checkpointLocation); "" outside a streaming query."""
    try:
        return df.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId") or ""
    except Exception:  # Spark Connect has no SparkContext; batches then count as one unnamed query
        return ""


def _state_path_cause(exc: BaseException) -> str | None:
    """The runtime error behind a failed Spark job, if the failure came from the state path."""
    if isinstance(exc, (EpochConflictError, UnavailableError, JobStateError)):
        return type(exc).__name__
    text = str(exc)
    for marker in _STATE_PATH_ERRORS:
        if marker in text:
            return marker
    return None
