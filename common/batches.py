"""What the epoch protocol decides per micro-batch, shared by the Spark helper, the JobManager and the TaskManagers.

A micro-batch commits once per partition: the attempt Spark kept (the winner) and its ledger of
write requests per slot. The Spark helper builds winners from its tasks' scopes, the JobManager
passes them on to every TaskManager in ``CommitEpoch``, and each slot checks the ledger against
what it staged. ``common.rpc.convert`` turns them into ``PartitionAttempt`` messages and back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Winner:
    """The attempt Spark kept for one partition, and its ledger.

    ``ledger`` maps ``(operator_id, subtask_index)`` to the number of write requests that slot
    acknowledged to the attempt; None when the caller keeps no ledger (nothing is counted).
    """

    partition: int
    attempt: int
    ledger: Mapping[tuple[str, int], int] | None = None

    def expected_requests(self, operator_id: str, subtask_index: int) -> int | None:
        """How many write requests the slot acknowledged to the winning attempt (0 if none); None without a ledger."""
        if self.ledger is None:
            return None
        return self.ledger.get((operator_id, subtask_index), 0)
