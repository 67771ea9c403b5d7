"""Timers in ``foreach_batch``: the batch's watermark and timestamp, and firing the due timers of a task.

Spark decides, for every micro-batch, an event-time watermark (``batchWatermarkMs``: from the
``withWatermark`` columns of the batches before it) and a batch timestamp (``batchTimestampMs``:
the processing time of the batch), and records both in the query's offset log, so a batch
re-run after a driver restart sees the same values. ``foreachBatch`` does not pass them to
Python; :func:`batch_times` reads them from the query's current ``IncrementalExecution``
through the JVM.

Firing follows Spark's ``transformWithState``: each task first runs ``process`` on its input
rows, then hands the timers that are due in its key groups (event-time timers at or before the
watermark, processing-time timers at or before the batch timestamp) to the timer handler.
Firing deletes the timer in the task's epoch, with the handler's writes, so a timer fires once
across retried tasks, re-run batches and failovers. Timers the handler registers at or before
the current time fire in the next batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from keyedstate.common.client import TimeDomain, Timer, TimerService
from keyedstate.common.clock import Clock

logger = logging.getLogger(__name__)

TimerFn = Callable[[Iterator[Timer[Any]], Any], "Iterable[Any] | None"]
"""``on_timer(timers, state)``: the task's fired timers and its :class:`PartitionState`; returns None or
(with ``output_schema``) an iterable of ``pyarrow.RecordBatch``, like ``process``."""


@dataclass(frozen=True)
class BatchTimes:
    """The times one micro-batch fires timers at (Spark's ``TimerValues``)."""

    watermark_ms: int | None
    """The event-time watermark (None: no streaming query, so no event time; event-time timers wait)."""
    timestamp_ms: int
    """The batch's processing time."""
    from_query: bool
    """Both came from Spark's offset log (a re-run batch gets the same values)."""
    late_watermark_ms: int | None = None
    """The previous batch's watermark (Spark's watermark for late events; None: the first batch, or no query)."""


def batch_times(df: Any, batch_id: int, query_id: str, clock: Clock) -> BatchTimes:
    """The watermark and timestamp Spark chose for batch ``batch_id`` of the streaming query ``query_id``.

    Outside a streaming query (a DataFrame handed to the ``foreachBatch`` function by hand) there
    is no watermark, and the processing time is ``clock``'s.
    """
    execution = _current_execution(df, query_id)
    if execution is not None and int(execution.currentBatchId()) == batch_id:
        meta = execution.offsetSeqMetadata()
        late = None
        try:
            previous = execution.prevOffsetSeqMetadata()
            late = int(previous.get().batchWatermarkMs()) if previous.isDefined() else None
        except Exception:  # a Spark without it: late rows are not dropped
            logger.warning("query %s: Spark does not expose the previous batch's watermark", query_id, exc_info=True)
        return BatchTimes(int(meta.batchWatermarkMs()), int(meta.batchTimestampMs()), True, late)
    if query_id:
        logger.warning(
            "query %s batch %d: could not read the batch's watermark from Spark; event-time timers wait for the next batch",
            query_id,
            batch_id,
        )
    return BatchTimes(None, clock.now_ms(), False)


def _current_execution(df: Any, query_id: str) -> Any:
    """The ``IncrementalExecution`` of the query's running batch, or None."""
    if not query_id:
        return None
    from pyspark.sql import SparkSession

    # foreachBatch runs on a clone of the query's session, whose StreamingQueryManager does not
    # know the query; the session that started it (the default one) does.
    sessions = [SparkSession.getActiveSession(), df.sparkSession]
    try:
        # PySpark has no public API for the JVM session; the watermark is only on the JVM side.
        default = df.sparkSession._jvm.org.apache.spark.sql.classic.SparkSession.getDefaultSession()  # noqa: SLF001
        if default.isDefined():
            sessions.insert(0, default.get())
    except Exception:  # another Spark version names the class differently: the Python sessions remain
        logger.debug("no JVM default session", exc_info=True)
    for session in sessions:
        if session is None:
            continue
        try:
            jsession = getattr(session, "_jsparkSession", session)
            query = jsession.streams().get(query_id)
            if query is not None:
                return query.streamingQuery().lastExecution()
        except Exception:
            logger.debug("session %r does not know query %s", session, query_id, exc_info=True)
    return None


def fire_due(timers: TimerService[Any], times: BatchTimes, key_groups: Iterable[int]) -> list[Timer[Any]]:
    """Pop the timers of ``key_groups`` due at ``times``: event time first, then processing time."""
    groups = list(key_groups)
    fired: list[Timer[Any]] = []
    if times.watermark_ms is not None:
        fired += timers.pop_due(TimeDomain.EVENT_TIME, times.watermark_ms, groups)
    fired += timers.pop_due(TimeDomain.PROCESSING_TIME, times.timestamp_ms, groups)
    return fired
