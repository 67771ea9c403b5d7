"""foreachBatch integration: each micro-batch is one epoch, committed exactly once.

Driver side::

    runtime = KeyedStateRuntime("127.0.0.1:6123", "sessions", operators)
    query = (events.writeStream
             .foreachBatch(runtime.foreach_batch(process, key_col="user", operator="sessions"))
             .option("checkpointLocation", spark_checkpoint_dir).start())

``process(batches, state)`` runs once per Spark partition on an executor: ``batches`` is an
iterator of ``pyarrow.RecordBatch`` (the partition's rows, Arrow-native: no per-Row conversion)
and ``state`` a :class:`PartitionState` whose handles stage every write in the task's epoch
transaction. Reads see the state committed through the previous batch plus the task's own
writes.

How one batch runs (batch id = epoch):

1. If the runtime has already committed the epoch (Spark re-runs a batch after a driver
   restart), the batch is skipped: its effects are already in the state.
2. The DataFrame is repartitioned by key group, so Spark partition ``i`` talks to subtask
   ``i`` only, and ``process`` runs in ``mapInArrow``; each task returns its
   ``(partition, attempt)``. Spark keeps the result of exactly one successful attempt per
   partition, so failed, killed and losing speculative attempts are never named.
3. The driver commits the epoch with those winners: every TaskManager applies the winning
   attempts' staged writes atomically and drops the rest, and the checkpoint of the epoch is
   taken right after (waited for, so Spark records the batch as done only once it is durable).
4. If the job restarted while the batch ran (a TaskManager died), the commit is refused and
   the batch runs again from the restored state.

Direct mode (``exactly_once=False``) writes straight to the state: lower latency, but a
retried or re-executed task applies its writes again (at-least-once).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common.client import ListState, MapState, ReducingState, StateClient, ValueState
from keyedstate.common.descriptors import OperatorSpec
from keyedstate.common.errors import EpochConflictError, KeyedStateError, UnavailableError

logger = logging.getLogger(__name__)

_CLIENTS: dict[str, StateClient] = {}
_CLIENTS_LOCK = threading.Lock()


def worker_client(address: str) -> StateClient:
    """One client per worker process and JobManager (Spark reuses Python workers)."""
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(address)
        if client is None:
            client = StateClient(address)
            _CLIENTS[address] = client
        return client


class PartitionState:
    """State handles for one Spark task, bound to its epoch transaction (or direct)."""

    def __init__(self, client: StateClient, job_id: str, operator_id: str, epoch: pb.EpochContext | None) -> None:
        self.client = client
        self.job_id = job_id
        self.operator_id = operator_id
        self.epoch = epoch
        self._handles: dict[tuple[Any, ...], Any] = {}

    def _get(self, cls: type, name: str, operator: str | None, **kw: Any) -> Any:
        key = (cls, name, operator, tuple(sorted(kw.items())))
        handle = self._handles.get(key)
        if handle is None:
            handle = cls(self.client, self.job_id, operator or self.operator_id, name, epoch=self.epoch, **kw)
            self._handles[key] = handle
        return handle

    def value(self, name: str, *, operator: str | None = None, key_serializer: str = "str",
              value_serializer: str = "pickle") -> ValueState[Any, Any]:
        return self._get(ValueState, name, operator, key_serializer=key_serializer, value_serializer=value_serializer)

    def list(self, name: str, *, operator: str | None = None, key_serializer: str = "str",
             value_serializer: str = "pickle") -> ListState[Any, Any]:
        return self._get(ListState, name, operator, key_serializer=key_serializer, value_serializer=value_serializer)

    def map(self, name: str, *, operator: str | None = None, key_serializer: str = "str",
            user_key_serializer: str = "str", value_serializer: str = "pickle") -> MapState[Any, Any, Any]:
        return self._get(MapState, name, operator, key_serializer=key_serializer,
                         user_key_serializer=user_key_serializer, value_serializer=value_serializer)

    def reducing(self, name: str, *, operator: str | None = None, key_serializer: str = "str") -> ReducingState[Any]:
        return self._get(ReducingState, name, operator, key_serializer=key_serializer)


ProcessFn = Callable[[Iterator[Any], PartitionState], None]


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
    ) -> None:
        self.jobmanager = jobmanager
        self.job_id = job_id
        self.operators = list(operators)
        self.client = StateClient(jobmanager)
        routing = self.client.submit_job(job_id, self.operators, max_parallelism=max_parallelism,
                                         restore_path=restore_path, config=job_config)
        self.max_parallelism = routing.max_parallelism
        # Spark task attempt ids restart at 0 in a new SparkContext. Folding a random per-driver
        # number into every attempt id keeps a restarted driver's attempts distinct from
        # writes an earlier driver staged for the same (uncommitted) epoch.
        self.driver_nonce = secrets.randbits(30) + 1
        self.batches_run = 0
        self.batches_skipped = 0
        self.batch_attempts = 0
        self.last_checkpoint: Any = None
        self.timings: list[BatchTiming] = []

    def committed_epoch(self) -> int:
        return self.client.job_info(self.job_id).committed_epoch

    def parallelism(self, operator_id: str) -> int:
        return next(o.parallelism for o in self.operators if o.operator_id == operator_id)

    def foreach_batch(
        self,
        process: ProcessFn,
        *,
        key_col: str,
        operator: str | None = None,
        key_serializer: str = "str",
        exactly_once: bool = True,
        checkpoint: bool = True,
        max_batch_attempts: int = 5,
    ) -> Callable[[Any, int], None]:
        """A ``foreachBatch`` function that runs ``process`` per partition, one epoch per batch.

        Per-batch timings are appended to :attr:`timings`.
        """
        operator_id = operator or self.operators[0].operator_id
        parallelism = self.parallelism(operator_id)
        address = self.jobmanager
        job_id = self.job_id
        nonce = self.driver_nonce

        def run_partitions(df: Any, epoch: int) -> dict[int, int]:
            from pyspark.sql.types import LongType, StructField, StructType, IntegerType

            from keyedstate.common.spark._keygroups import repartition_by_key_group

            parted = repartition_by_key_group(df, key_col, self.max_parallelism, parallelism, key_serializer)

            def task(batches: Iterable[Any]) -> Iterator[Any]:
                import pyarrow as pa
                from pyspark import TaskContext

                ctx = TaskContext.get()
                partition, attempt = ctx.partitionId(), (nonce << 32) | (ctx.taskAttemptId() & 0xFFFFFFFF)
                context = pb.EpochContext(epoch=epoch, partition=partition, attempt=attempt) if exactly_once else None
                state = PartitionState(worker_client(address), job_id, operator_id, context)
                process(iter(batches), state)
                yield pa.RecordBatch.from_pydict({"partition": [partition], "attempt": [attempt]},
                                                 schema=pa.schema([("partition", pa.int32()), ("attempt", pa.int64())]))

            schema = StructType([StructField("partition", IntegerType()), StructField("attempt", LongType())])
            return {r.partition: r.attempt for r in parted.mapInArrow(task, schema).collect()}

        def on_batch(df: Any, batch_id: int) -> None:
            started = time.perf_counter()
            tasks_s = commit_s = checkpoint_s = 0.0
            if exactly_once and batch_id <= self.committed_epoch():
                logger.info("job %s: batch %d is already committed; skipping it", job_id, batch_id)
                self.batches_skipped += 1
                self._ensure_checkpoint(batch_id, checkpoint)
                return
            for attempt in range(1, max_batch_attempts + 1):
                self.batch_attempts += 1
                routing_version = self.client.routing(job_id, refresh=True).version
                try:
                    t0 = time.perf_counter()
                    winners = run_partitions(df, batch_id)
                    t1 = time.perf_counter()
                    tasks_s += t1 - t0
                    if not exactly_once:
                        break
                    response = self.client.commit_epoch(
                        job_id, batch_id, winners, checkpoint=checkpoint, wait_for_checkpoint=checkpoint,
                        expected_routing_version=routing_version,
                    )
                    commit_s += time.perf_counter() - t1
                    self.last_checkpoint = response.checkpoint if response.HasField("checkpoint") else None
                    if self.last_checkpoint is not None:
                        checkpoint_s += self.last_checkpoint.duration_ms / 1000.0
                    if checkpoint and (self.last_checkpoint is None or self.last_checkpoint.status != "COMPLETED"):
                        reason = self.last_checkpoint.failure_reason if self.last_checkpoint is not None else "none taken"
                        raise UnavailableError(f"the checkpoint of epoch {batch_id} did not complete: {reason}")
                    break
                except (EpochConflictError, UnavailableError) as exc:
                    if attempt == max_batch_attempts:
                        raise
                    logger.warning("job %s: batch %d attempt %d: %s; running it again", job_id, batch_id, attempt, exc)
                    self._wait_running()
                    if batch_id <= self.committed_epoch():
                        self._ensure_checkpoint(batch_id, checkpoint)
                        break
                except Exception as exc:
                    cause = _keyed_state_cause(exc)
                    if cause is None or attempt == max_batch_attempts:
                        raise
                    logger.warning("job %s: batch %d attempt %d failed in a task: %s; running it again",
                                   job_id, batch_id, attempt, cause)
                    self._wait_running()
            self.batches_run += 1
            self.timings.append(BatchTiming(batch_id, tasks_s, commit_s, time.perf_counter() - started, checkpoint_s))

        return on_batch

    def _ensure_checkpoint(self, batch_id: int, checkpoint: bool) -> None:
        response = self.client.commit_epoch(self.job_id, batch_id, {}, checkpoint=checkpoint, wait_for_checkpoint=checkpoint)
        self.last_checkpoint = response.checkpoint if response.HasField("checkpoint") else None

    def _wait_running(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.client.job_info(self.job_id).status == "RUNNING":
                    self.client.routing(self.job_id, refresh=True)
                    return
            except KeyedStateError:
                pass
            time.sleep(0.2)
        raise UnavailableError(f"job {self.job_id} did not return to RUNNING within {timeout_s:.0f} s")

    def close(self) -> None:
        self.client.close()


def _keyed_state_cause(exc: BaseException) -> str | None:
    """The runtime error behind a failed Spark job, if the failure came from the state path."""
    text = str(exc)
    for marker in ("UnavailableError", "EpochConflictError", "StaleRoutingError", "JobStateError", "RESTARTING"):
        if marker in text:
            return marker
    return None
