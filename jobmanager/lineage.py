"""Which Spark query's batches a job's epochs are: the epoch lineage.

Job epochs are contiguous integers; Spark batch ids belong to a query (``sql.streaming.queryId``,
stable for one ``checkpointLocation``). A lineage is a list of bindings: from ``first_epoch``
on, batch ``b`` of ``query_id`` is job epoch ``b + offset``. The last binding is the current
query. A new query (a new ``checkpointLocation``) binds at its batch 0, on top of the state as
it is; a query the state has moved on from, or a new query that is not at batch 0, is refused
(docs/exactly-once.md, "Epochs and the lineage").

The lineage travels with the state: it is part of every checkpoint's ``_metadata``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from keyedstate.common.errors import EpochGapError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LineageEntry:
    """From ``first_epoch`` on, batch ``b`` of ``query_id`` is job epoch ``b + offset``."""

    query_id: str
    offset: int
    first_epoch: int

    def to_dict(self) -> dict[str, Any]:
        return {"query_id": self.query_id, "offset": self.offset, "first_epoch": self.first_epoch}


LEGACY_QUERY = "\x00legacy"
"""Binds the epochs of a checkpoint written before lineages existed, when epoch = Spark batch id of
whatever query ran: the first query to commit on top of it continues with offset 0 and takes the
binding over."""


def _query(query_id: str) -> str:
    return f"query {query_id}" if query_id else "the unnamed query (batches run outside a streaming query)"


@dataclass(frozen=True)
class EpochLineage:
    """The bindings of a job's epochs to Spark queries, oldest first (immutable)."""

    entries: tuple[LineageEntry, ...] = ()

    @property
    def current(self) -> LineageEntry | None:
        return self.entries[-1] if self.entries else None

    def epoch_of(self, query_id: str, batch_id: int, committed_epoch: int) -> int:
        """The job epoch of ``batch_id`` of ``query_id`` on a state holding ``committed_epoch``.

        Raises EpochGapError when the state cannot take the batch at all: the query was
        superseded by another one, or a new query does not start at batch 0.
        """
        current = self.current
        if current is not None and current.query_id in (query_id, LEGACY_QUERY):
            return batch_id + current.offset
        if any(e.query_id == query_id for e in self.entries):
            assert current is not None
            raise EpochGapError(
                f"the job's state has moved on from {_query(query_id)} to {_query(current.query_id)} (since epoch "
                f"{current.first_epoch}); stop this query, or restore a checkpoint taken before epoch {current.first_epoch}"
            )
        if batch_id != 0:
            held = f"holds epoch {committed_epoch}" if committed_epoch >= 0 else "is empty"
            of = f" (of {_query(current.query_id)})" if current is not None else ""
            other_way = "start the query from a new checkpointLocation" if query_id else "start again from batch 0"
            raise EpochGapError(
                f"{_query(query_id)} is at batch {batch_id}, but the job's state {held}{of} and has none of this "
                f"query's batches 0..{batch_id - 1}: the job was resubmitted empty, or restored from a checkpoint of "
                "another query. Restore a checkpoint that holds this query's batch "
                f"{batch_id - 1} (statectl job restore JOB --from PATH), or {other_way}"
            )
        return committed_epoch + 1

    def bind(self, query_id: str, batch_id: int, epoch: int) -> EpochLineage:
        """The lineage once batch ``batch_id`` of ``query_id`` is committed as ``epoch``."""
        current = self.current
        if current is not None and current.query_id == query_id:
            return self
        if current is not None and current.query_id == LEGACY_QUERY:
            logger.info("epoch lineage: %s takes over the epochs of a checkpoint without a lineage", _query(query_id))
            return EpochLineage((*self.entries[:-1], LineageEntry(query_id, current.offset, current.first_epoch)))
        logger.info("epoch lineage: %s binds at epoch %d", _query(query_id), epoch)
        return EpochLineage((*self.entries, LineageEntry(query_id, epoch - batch_id, epoch)))

    def up_to(self, epoch: int) -> EpochLineage:
        """The bindings that cover epochs up to ``epoch`` (what a state holding ``epoch`` carries)."""
        return EpochLineage(tuple(e for e in self.entries if e.first_epoch <= epoch))

    def to_list(self) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self.entries]

    @classmethod
    def of(cls, entries: Iterable[LineageEntry]) -> EpochLineage:
        return cls(tuple(sorted(entries, key=lambda e: e.first_epoch)))


EMPTY_LINEAGE = EpochLineage()
