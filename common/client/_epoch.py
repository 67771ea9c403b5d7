"""One task attempt's epoch transaction, as the client sees it.

An :class:`EpochScope` is what a Spark task passes to its state handles in exactly-once mode:

* the ``EpochContext`` (job epoch, partition, attempt) every request carries;
* the routing version the driver began the batch under: the client sends every call with it,
  so a write can only be staged on a slot of that deployment (a slot of another version
  refuses it, and the task fails instead of staging where the commit will not look);
* a sequence number per write request and slot, and the *ledger*: how many write requests each
  slot acknowledged. A retried request reuses its number, so a slot stages it once; the commit
  sends the ledger, and a slot that staged a different count refuses the epoch.
"""

from __future__ import annotations

import threading

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common.batches import Winner


class EpochScope:
    """The transaction of one task attempt (thread-safe)."""

    def __init__(self, context: pb.EpochContext, routing_version: int = 0, *, numbered: bool = True) -> None:
        """``routing_version`` 0: not pinned (the client routes with whatever table it has).

        ``numbered`` False: write requests carry no sequence number (no ledger, no retry
        safety); what a bare ``EpochContext`` gets, since handles made from one do not share a
        scope and their numbers would collide.
        """
        self.context = pb.EpochContext(epoch=context.epoch, partition=context.partition, attempt=context.attempt)
        self.routing_version = routing_version
        self.numbered = numbered
        self._issued: dict[tuple[str, int], int] = {}
        self._acknowledged: dict[tuple[str, int], set[int]] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_task(cls, epoch: int, partition: int, attempt: int, *, routing_version: int = 0) -> EpochScope:
        """The transaction of one task attempt (``attempt``) on ``partition``, writing into job epoch ``epoch``."""
        return cls(pb.EpochContext(epoch=epoch, partition=partition, attempt=attempt), routing_version)

    @property
    def epoch(self) -> int:
        """The job epoch this transaction writes into."""
        return self.context.epoch

    def next_sequence(self, operator_id: str, subtask_index: int) -> int:
        """A new sequence number for one write request to ``(operator_id, subtask_index)``."""
        key = (operator_id, subtask_index)
        with self._lock:
            n = self._issued.get(key, 0) + 1
            self._issued[key] = n
            return n

    def acknowledged(self, operator_id: str, subtask_index: int, sequence: int) -> None:
        """Record that slot ``(operator_id, subtask_index)`` acknowledged write ``sequence`` (see :meth:`ledger`)."""
        with self._lock:
            self._acknowledged.setdefault((operator_id, subtask_index), set()).add(sequence)

    def context_for(self, sequence: int) -> pb.EpochContext:
        """The EpochContext that one write request carrying ``sequence`` sends."""
        return pb.EpochContext(
            epoch=self.context.epoch, partition=self.context.partition, attempt=self.context.attempt, sequence=sequence
        )

    def ledger(self) -> dict[tuple[str, int], int]:
        """``(operator_id, subtask_index)`` -> write requests that slot acknowledged."""
        with self._lock:
            return {k: len(v) for k, v in self._acknowledged.items()}

    def unacknowledged(self) -> dict[tuple[str, int], int]:
        """Write requests issued but never acknowledged, per slot (a task must not win with any)."""
        with self._lock:
            return {
                k: n - len(self._acknowledged.get(k, ()))
                for k, n in self._issued.items()
                if n != len(self._acknowledged.get(k, ()))
            }

    def winner(self) -> Winner:
        """This attempt as a commit's winner, with its ledger."""
        return Winner(self.context.partition, self.context.attempt, self.ledger())

    def __repr__(self) -> str:
        c = self.context
        return f"EpochScope(epoch={c.epoch}, partition={c.partition}, attempt={c.attempt}, routing v{self.routing_version})"


def as_scope(epoch: pb.EpochContext | EpochScope | None) -> EpochScope | None:
    """Accept a bare ``EpochContext`` (no pinned routing) where a scope is expected."""
    if epoch is None or isinstance(epoch, EpochScope):
        return epoch
    return EpochScope(epoch, numbered=False)
