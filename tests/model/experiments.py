"""The experiments the tests run: bounds and fault menus, each explored exhaustively.

Every experiment has two TaskManagers, two key groups (key group k lives on TaskManager k until
a failover or a rescale moves it) and three micro-batches, unless it says otherwise. Faults are
counted: ``faults=1`` means any single fault of the menu, at any step.
"""

from __future__ import annotations

from dataclasses import replace

from tests.model.protocol import Experiment

ALL_MESSAGES = frozenset(
    {
        "BeginBatch",
        "BeginAnswer",
        "CommitRequest",
        "DurableRequest",
        "BatchAnswer",
        "Stage",
        "StageAck",
        "Prepare",
        "PrepareAnswer",
        "Apply",
        "ApplyAnswer",
        "Barrier",
        "BarrierAck",
        "Release",
        "Released",
        "Deploy",
        "Deployed",
        "Register",
        "Registered",
        "Heartbeat",
        "HeartbeatAnswer",
    }
)

BASELINE = Experiment("baseline: no fault")
CRASH_TASKMANAGER = Experiment("a TaskManager crashes (and restarts)", faults=1, crash=frozenset({"taskmanager"}))
CRASH_JOBMANAGER = Experiment(
    "the JobManager crashes (a new leader takes over)", faults=1, crash=frozenset({"jobmanager"})
)
CRASH_DRIVER = Experiment("the driver or an executor crashes", faults=1, crash=frozenset({"driver", "executor"}))
CUT_OFF = Experiment("a TaskManager is cut off from the JobManager", faults=1, cut=True)
PAUSE = Experiment("a TaskManager pauses in a write call, longer than its lease", faults=1, pause=True)
MESSAGES = Experiment(
    "any message lost, duplicated or late past the driver's timeout",
    faults=1,
    drop=ALL_MESSAGES,
    duplicate=ALL_MESSAGES,
    driver_timeouts=True,
)
CHECKPOINT_FAILURES = Experiment(
    "two checkpoints fail (periodic checkpoints race the commits)",
    faults=2,
    checkpoint_failures=True,
    periodic_checkpoints=True,
)
SPECULATION = Experiment(
    "two partitions, speculative attempts and an executor crash",
    partitions=2,
    faults=1,
    speculation=2,
    crash=frozenset({"executor"}),
)
RESTORE_OLDER = Experiment("operator restores an older checkpoint", operator="restore_older", periodic_checkpoints=True)
CANCEL_RESUBMIT = Experiment("operator cancels, the driver resubmits the job", operator="cancel_resubmit")
RESCALE = Experiment("operator rescales (ownership moves)", operator="rescale")
NEW_QUERY = Experiment("the query restarts from a new checkpointLocation", operator="new_query")

DEFAULT = (
    BASELINE,
    CRASH_TASKMANAGER,
    CRASH_JOBMANAGER,
    CRASH_DRIVER,
    CUT_OFF,
    PAUSE,
    MESSAGES,
    CHECKPOINT_FAILURES,
    SPECULATION,
    RESTORE_OLDER,
    CANCEL_RESUBMIT,
    RESCALE,
    NEW_QUERY,
)
"""The experiments the default suite explores exhaustively with every protection on."""


def overlapped(experiment: Experiment, batches: int = 2) -> Experiment:
    """The same experiment with ``execution.checkpointing.commit-mode: overlapped``, over two
    batches by default (the least that shows a batch overlapping the previous one's apply; the
    overlap multiplies the interleavings)."""
    name = f"overlapped commits: {experiment.name}"
    if batches != experiment.batches:
        name += f", {batches} batches"
    return replace(experiment, name=name, overlapped=True, batches=batches)


_OVERLAPPED_HEAVY = (CRASH_TASKMANAGER, CRASH_JOBMANAGER, CUT_OFF, PAUSE, SPECULATION)
OVERLAPPED = tuple(overlapped(x) for x in DEFAULT if x not in _OVERLAPPED_HEAVY)
"""The default experiments again, the driver returning on the epoch's decision (docs/exactly-once.md,
"Overlapped commits"), the apply and the checkpoint overlapping the next batch."""
OVERLAPPED_SLOW = tuple(overlapped(x) for x in _OVERLAPPED_HEAVY)
"""The overlapped experiments of more than a minute on this machine (opt in with -m slow)."""

OVERLAPPED_NEW_QUERY_AND_CRASH = overlapped(
    Experiment(
        "the query restarts from a new checkpointLocation and the JobManager crashes, two batches",
        batches=2,
        operator="new_query",
        faults=1,
        crash=frozenset({"jobmanager"}),
    )
)
"""A decision write of the old query, in flight when its JobManager dies, racing the new query's epoch."""

# -- smaller bounds, for the protection-off runs that need a complete exploration (liveness) ---

CRASH_TASKMANAGER_ONE_BATCH = Experiment(
    "a TaskManager crashes, one batch", batches=1, faults=1, crash=frozenset({"taskmanager"})
)

# -- ownership alone (no query): the stale-Deploy hole of the document -------------------------

OWNERSHIP_TWO_CRASHES = Experiment(
    "ownership only: two TaskManager crashes, no query", driver=False, faults=2, crash=frozenset({"taskmanager"})
)
RESCALE_AND_CRASH = Experiment(
    "operator rescales and a TaskManager crashes", operator="rescale", faults=1, crash=frozenset({"taskmanager"})
)
RESCALE_AND_CRASH_ONE_BATCH = Experiment(
    "operator rescales and a TaskManager crashes, one batch",
    batches=1,
    operator="rescale",
    faults=1,
    crash=frozenset({"taskmanager"}),
)

# -- larger bounds (opt in with -m slow) ------------------------------------------------------

SLOW = (
    Experiment(
        "any process crashes, periodic checkpoints",
        faults=1,
        periodic_checkpoints=True,
        crash=frozenset({"driver", "jobmanager", "taskmanager", "executor"}),
    ),
    Experiment(
        "two messages lost, duplicated or late",
        faults=2,
        drop=ALL_MESSAGES,
        duplicate=ALL_MESSAGES,
        driver_timeouts=True,
    ),
    Experiment("two partitions, a TaskManager crashes", partitions=2, faults=1, crash=frozenset({"taskmanager"})),
    Experiment(
        "a checkpoint fails and a TaskManager crashes, one batch",
        batches=1,
        faults=2,
        checkpoint_failures=True,
        crash=frozenset({"taskmanager"}),
    ),
)
"""Experiments too large for the default suite (every protection and the proposed fix on)."""
