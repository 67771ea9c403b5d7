"""Exactly-once epochs on the JobManager: the lineage of Spark batches, commits, and durability.

See docs/exactly-once.md for the protocol.
"""

from keyedstate.jobmanager.epochs.lineage import EMPTY_LINEAGE, EpochLineage, LineageEntry

__all__ = ["EMPTY_LINEAGE", "EpochLineage", "LineageEntry"]
