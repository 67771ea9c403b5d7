"""The garbage-collector policy of the daemons.

CPython's default thresholds (700, 10, 10) start a full collection, a scan of every tracked object,
after about 70,000 net new objects once survivors grew by a quarter. A JobManager's model grows with
the job (a checkpoint of 10,000 slots keeps some 70,000 objects), so with the defaults a checkpoint's
share of full collections, and the cost of each, grew with the job: time per slot at 10,000 slots was
1.24x that at 1,000 (bench coordinator_scale). Almost everything a daemon allocates is freed by
reference counting; the collector is only for cycles, which short-lived ones (exceptions and their
tracebacks, futures) die young and the first two generations still find at once.

:func:`apply` raises the thresholds so full collections come rarely, and freezes what start-up made
(configuration, generated protobuf modules, gRPC) so no collection scans it again.
"""

from __future__ import annotations

import gc

THRESHOLDS = (10_000, 20, 100)
"""Generation 0 after 10,000 net allocations; generation 1 every 20 of those; generation 2 every 100 of
generation 1 (and only once survivors grew by 25%, CPython's own rule)."""


def apply() -> None:
    """Set the daemons' thresholds and freeze the objects alive now (call once start-up is done)."""
    gc.collect()
    gc.set_threshold(*THRESHOLDS)
    gc.freeze()
