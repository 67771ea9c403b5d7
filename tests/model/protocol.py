"""An explicit-state model of the exactly-once protocol of docs/exactly-once.md.

A :class:`State` is an immutable value holding every party of the document: the Spark driver
and its task attempts, the JobManager, the TaskManagers and their slots, checkpoint storage,
and the network (the set of messages in flight). :meth:`Model.successors` yields every step any
party can take from a state, including every fault of the experiment's menu, and
:meth:`Model.violation` checks the document's invariants in a state. ``checker.py`` explores the
graph exhaustively.

Abstractions (each is sound for the invariants checked; the reasons are next to the code):

* Data. A write is its identity: partition ``p`` of batch ``b`` of query ``q`` writes one
  element to every key group, and an applied write is stored as ``(epoch, q, b, p)`` in the
  slot of its key group. Values and keys are not modeled: losing, doubling or misplacing a
  write is visible on identities, and the protocol never looks at values.
* Time. Clocks are not modeled; the clock argument of the document ("the JobManager's
  lease_bound ends after the TaskManager's lease") becomes an ordering constraint: the
  JobManager can see a TaskManager's lease bound pass only once that TaskManager's lease
  has run out. Timeouts are steps that are enabled when what they wait for was lost.
* The network is a set: a message is delivered at most once unless duplicated by a fault;
  any message in flight can be delivered next (delays and reordering are free).
* Calls. Every answer a party can no longer act on (an answer to a dead driver, to an
  abandoned call, to an aborted commit or checkpoint, to a dead JobManager session) is
  removed from the network at once (:meth:`Model._collect`): delivering it would change
  nothing, so removing it only merges states.
* One slot per key group: a TaskManager hosts at most one slot of the job per key group.
  Key group ``k``'s preferred TaskManager is ``k`` (parallelism = number of TaskManagers);
  a failover puts a key group on another TaskManager when its own is unavailable, and a
  rescale puts every key group on TaskManager 0, so ownership moves are visible.
* One job, one driver process at a time (plus the messages of its dead predecessors), and
  one query, or two with the ``new_query`` experiment.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple

from tests.model.messages import (
    JM_TM,
    TO_DRIVER,
    TO_JOBMANAGER,
    TO_TASKMANAGER,
    Aid,
    Apply,
    ApplyAnswer,
    Barrier,
    BarrierAck,
    BatchAnswer,
    BeginAnswer,
    BeginBatch,
    CommitRequest,
    Counts,
    Data,
    DecisionWrite,
    DecisionWritten,
    Deploy,
    Deployed,
    DurableRequest,
    Entry,
    Heartbeat,
    HeartbeatAnswer,
    Lineage,
    Message,
    Prepare,
    PrepareAnswer,
    Register,
    Registered,
    Release,
    Released,
    Stage,
    StageAck,
    Version,
    Winners,
)

Q1, Q2 = "q1", "q2"

# Driver phases.
BEGIN, RUN, COMMIT, DURABLE, FINISHED, STOPPED = "BEGIN", "RUN", "COMMIT", "DURABLE", "FINISHED", "STOPPED"
# Job status.
RUNNING, RESTARTING, FAILED = "RUNNING", "RESTARTING", "FAILED"

# Invariant names, as in the document's "Invariants" section.
CONTIGUITY = "1 contiguity"
LOST_OR_DOUBLED = "2 no lost or doubled epoch"
DURABILITY = "3 durability before acknowledgement"
WINNERS_ONLY = "4 winners only"
ONE_OWNER = "5 one owner"
CONSISTENT_CUT = "6 consistent cut"
READS_SEE_PREVIOUS = "7 reads see the previous batch"
LIVENESS = "liveness (the query can always still finish)"


@dataclass(frozen=True)
class Protections:
    """The protections of the document; each can be switched off to show what it protects."""

    rollback_committed_on_restore: bool = True
    """A restore sets the job's committed epoch (and lineage) from what it restores, and a
    deployed slot reporting another epoch fails the deploy."""
    driver_checks_checkpoint_status: bool = True
    """The driver returns only on a COMPLETED checkpoint answer (not on a failed one)."""
    taskmanager_gap_check: bool = True
    """A slot prepares and applies epoch E only on top of E-1."""
    epoch_gap_refusal: bool = True
    """The JobManager refuses a batch whose epoch is beyond C+1 (EpochGapError) and commits
    only E == C+1."""
    lineage_epochs: bool = True
    """BeginBatch maps batches to epochs through the lineage; off: the epoch is the Spark batch id."""
    lease_fencing: bool = True
    """A TaskManager whose lease ran out refuses every state call, commit and barrier."""
    lease_recheck_before_answer: bool = True
    """A state call checks the lease again after it applied, before it answers (a process paused
    in the middle of a call cannot acknowledge after its lease ran out)."""
    reassign_after_fencing: bool = True
    """The JobManager redeploys a lost TaskManager's key groups only once it is certainly fenced."""
    routing_version_check: bool = True
    """Slots refuse calls of another routing version; the JobManager refuses a commit of one."""
    ledger_check: bool = True
    """Prepare compares what a slot staged for each winner with the winner's ledger."""
    seq_dedup: bool = True
    """A slot stages each (epoch, partition, attempt, sequence number) once."""
    cut_under_commit_lock: bool = True
    """Checkpoint barriers are sent while epoch commits are held back (the job lock)."""
    barrier_epoch_check: bool = True
    """A slot refuses a barrier of another epoch; the coordinator refuses an ack of another epoch."""
    retry_job_state_errors: bool = True
    """The driver waits for a RESTARTING job and runs the batch again instead of raising."""
    taskmanager_version_floor: bool = True
    """A TaskManager remembers the highest routing version it was told of (by a Release, a
    Deploy or its registration answer) and refuses a Deploy below it, so a Deploy that arrives
    after a newer Release cannot bring a deposed slot back. (This model found the hole it
    closes; the document and the product have it since.)"""

    # -- overlapped commits (docs/exactly-once.md, "Overlapped commits") ----------------------
    upload_before_decision: bool = True
    """(overlapped) A slot answers a Prepare only once the winners' staged writes of the epoch
    (its change set) are in checkpoint storage; the decision is written only after every slot
    prepared."""
    replay_decisions_on_restore: bool = True
    """(overlapped) A restore continues the restored checkpoint with the decided epochs above it,
    folding their change sets into the restored slots."""
    seal_on_restore: bool = True
    """(overlapped) A restore create-only writes a seal at the first free name of the epoch after
    the last decision it replays, so a decision write still in flight can never land behind it."""
    read_fence: bool = True
    """(overlapped) A slot serves a call of epoch E only once it holds E-1 (it waits for the
    asynchronous apply of E-1)."""

    def without(self, *names: str) -> Protections:
        """These protections, with the named ones switched off."""
        known = {f.name for f in fields(self)}
        unknown = set(names) - known
        if unknown:
            raise ValueError(f"unknown protections {sorted(unknown)}; known: {sorted(known)}")
        return replace(self, **dict.fromkeys(names, False))


DOCUMENTED = Protections()
"""The protocol exactly as docs/exactly-once.md describes it."""


@dataclass(frozen=True)
class Experiment:
    """The bounds and the fault menu of one exhaustive run."""

    name: str
    batches: int = 3
    partitions: int = 1
    taskmanagers: int = 2
    key_groups: int = 2
    retained_checkpoints: int = 2
    faults: int = 0
    """How many faults (crashes, lost/duplicated messages, cuts, failed checkpoints) a run may have."""
    drop: frozenset[str] = frozenset()
    """Message kinds the network may lose."""
    duplicate: frozenset[str] = frozenset()
    """Message kinds the network may deliver twice."""
    driver_timeouts: bool = False
    """The driver may give up waiting for an answer that is only late (its request still in flight)."""
    crash: frozenset[str] = frozenset()
    """Processes that may crash: driver, jobmanager, taskmanager, executor."""
    cut: bool = False
    """A TaskManager may be cut off from the JobManager (and healed); heartbeats and leases are modeled."""
    pause: bool = False
    """A TaskManager may be paused (SIGSTOP, GC, VM freeze) longer than its lease in the middle of
    a write call (after staging, before answering); heartbeats and leases are modeled."""
    checkpoint_failures: bool = False
    """A pending checkpoint may fail (expired, declined, upload failed)."""
    tolerable_failed_checkpoints: int = 1
    speculation: int = 0
    """How many speculative task attempts Spark may launch in a run."""
    operator: str | None = None
    """One operator action: restore_older, cancel_resubmit, rescale, new_query."""
    periodic_checkpoints: bool = False
    """The JobManager may also take checkpoints on its own (not only for a waiting driver)."""
    driver: bool = True
    """Whether a query runs at all (off: only the JobManager and TaskManagers act, to study
    ownership alone; such an experiment has no intended end, so liveness is not checked)."""
    max_restarts: int = 4
    """The restart strategy: the job FAILS after this many failovers under one JobManager leader."""
    overlapped: bool = False
    """``execution.checkpointing.commit-mode: overlapped``: the driver returns once the epoch's
    decision is in checkpoint storage; the apply and the checkpoint overlap the next batch."""


# ---------------------------------------------------------------------------------------------
# The state
# ---------------------------------------------------------------------------------------------

Staged = tuple[int, int, Aid, int, str, int]
"""A staged write: (epoch, partition, attempt, sequence number, query, batch)."""


class Slot(NamedTuple):
    kg: int
    version: Version
    committed: int
    data: Data
    staged: tuple[Staged, ...]
    applied: tuple[int, ...] = ()
    """(Ghost) the epochs whose commit this slot's backend went through, in order; a restore
    brings back the snapshot's. Contiguity is that this is 0, 1, ..., committed."""


LogEntry = tuple[int, int, str, str, int, Version]
"""A record of the changelog in checkpoint storage: (epoch, n, kind, query, batch, routing version),
at ``changelog/g<gen>/<epoch>.<n>``; kind DECIDED (a decision) or SEALED (a restore's seal)."""
DECIDED, SEALED = "DECIDED", "SEALED"

ChangeSet = tuple[int, Version, int, Data]
"""A slot's uploaded change set: (epoch, routing version, key group, the winners' writes)."""


class Snapshot(NamedTuple):
    """One slot's state in a checkpoint (and in a deploy that restores it)."""

    kg: int
    committed: int
    applied: tuple[int, ...]
    data: Data


class TaskManager(NamedTuple):
    up: bool = True
    lease: bool = True
    cut: bool = False
    session: int = 0
    """The JobManager session it is registered with; -1 while (re)registering."""
    slots: tuple[Slot, ...] = ()
    floor: Version = (0, 0)
    """The highest routing version it was told of (kept only with `taskmanager_version_floor`)."""
    paused: bool = False
    in_call: Stage | None = None
    """(pause experiment) A write call that has staged but not answered yet."""

    def slot(self, kg: int) -> Slot | None:
        for s in self.slots:
            if s.kg == kg:
                return s
        return None


class Attempt(NamedTuple):
    partition: int
    aid: Aid
    acked: frozenset[int]
    """Sequence numbers the slots acknowledged; request ``k`` writes key group ``k``."""


class Driver(NamedTuple):
    query: str = Q1
    done: int = 0
    """Batches of `query` Spark recorded as done (durable in the checkpointLocation)."""
    incarnation: int = 0
    phase: str = BEGIN
    epoch: int = -1
    version: Version = (0, 0)
    routing: tuple[int, ...] = ()
    run: int = 0
    attempts: tuple[Attempt, ...] = ()
    """Running attempts of partitions that have no winner yet."""
    spawned: int = 0
    """Attempts launched in this run; the next attempt's number (unique across partitions, as
    Spark's task attempt ids are)."""
    winners: tuple[tuple[int, Aid, tuple[tuple[int, int], ...]], ...] = ()
    stop_reason: str = ""
    returned_total: int = 0


class Pending(NamedTuple):
    epoch: int
    version: Version
    lineage: Lineage
    acks: tuple[Snapshot, ...]
    """The snapshots of the slots that acknowledged, by key group."""
    rescale: bool = False


class Checkpoint(NamedTuple):
    epoch: int
    lineage: Lineage
    snapshots: tuple[Snapshot, ...]


class CommitInProgress(NamedTuple):
    inc: int
    query: str
    batch: int
    epoch: int
    version: Version
    winners: tuple[tuple[int, Aid, tuple[tuple[int, int], ...]], ...]
    applying: bool
    answered: frozenset[int]
    deciding: bool = False
    """(overlapped) Every slot prepared; the decision write is in flight."""


class Waiter(NamedTuple):
    inc: int
    query: str
    batch: int
    epoch: int


class JobManager(NamedTuple):
    up: bool = True
    session: int = 0
    status: str = RUNNING
    version: Version = (0, 0)
    home: tuple[int, ...] = ()
    assign: tuple[int, ...] = ()
    deployed: frozenset[int] = frozenset()
    restoring: bool = False
    committed: int = -1
    lineage: Lineage = ()
    commit: CommitInProgress | None = None
    pending: Pending | None = None
    waiters: frozenset[Waiter] = frozenset()
    registered: frozenset[int] = frozenset()
    lost: frozenset[int] = frozenset()
    unfenced: frozenset[int] = frozenset()
    """Previous owners that must be fenced before the next deploy."""
    payload: tuple[Snapshot, ...] = ()
    """Per key group, what the current deploy restores."""
    restore_empty: bool = False
    failed_checkpoints: int = 0


class Budget(NamedTuple):
    faults: int = 0
    speculation: int = 0
    operator: int = 0


class Ghost(NamedTuple):
    """Facts the checker records for the invariants; no party reads them."""

    returned: frozenset[tuple[str, int]] = frozenset()
    operator_gap: bool = False
    """An operator restored an older checkpoint or cancelled the job: returned batches may be
    missing from now on, but only a refusal may follow, never a batch applied over the gap."""
    bad_return: tuple[str, int] | None = None
    """A batch the driver returned from while no completed checkpoint held it."""
    stale_answer: str | None = None
    """A TaskManager acknowledged a call after its lease ran out."""
    stale_read: str | None = None
    """A slot served a call of epoch E while it held an epoch below E-1."""


class State(NamedTuple):
    driver: Driver
    jm: JobManager
    tms: tuple[TaskManager, ...]
    store: tuple[Checkpoint, ...]
    net: frozenset[Message]
    budget: Budget
    ghost: Ghost
    log: tuple[LogEntry, ...] = ()
    """(overlapped) The changelog's records of the current generation, sorted."""
    changes: frozenset[ChangeSet] = frozenset()
    """(overlapped) The change sets in checkpoint storage."""
    gen: int = 0
    """(overlapped) The changelog generation (an operator restore or a new job starts a new one)."""


@dataclass(frozen=True)
class Violation:
    invariant: str
    detail: str


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


_TEXT: dict[Message, str] = {}


def _text(m: Message) -> str:
    """The text of a message, computed once (it is also the delivery order, for reproducible traces)."""
    t = _TEXT.get(m)
    if t is None:
        t = _TEXT[m] = str(m)
    return t


def _insert(data: tuple[Any, ...], *items: object) -> tuple[Any, ...]:
    return tuple(sorted(data + items))


class Model:
    """The protocol under one experiment and one set of protections."""

    def __init__(
        self, experiment: Experiment, protections: Protections = DOCUMENTED, ignore: frozenset[str] = frozenset()
    ) -> None:
        self.x = experiment
        self.p = protections
        self.ignore = ignore
        """Invariants not to report (to see what a violation of one of them leads to)."""
        self._slot_verdicts: dict[tuple[int, tuple[int, ...], Data], tuple[str, str] | None] = {}
        self.kgs = tuple(range(experiment.key_groups))
        self.tm_ids = tuple(range(experiment.taskmanagers))
        self.partitions = tuple(range(experiment.partitions))
        # Partial-order reduction. Receiving a write ack (an executor) or a BeginBatch answer
        # (the driver) changes only the receiver's own bookkeeping, which no other party reads
        # and no invariant looks at, and it commutes with every step of every other party; the
        # only steps of the receiver it races with are its crash and its timeout, and a crash
        # before or after it leads to the same state (a dead driver's or attempt's messages are
        # collected). So when the experiment can neither lose, duplicate nor time out on these
        # messages, delivering them at once explores the same behaviours with fewer states.
        menu = experiment.drop | experiment.duplicate
        self.eager: frozenset[type] = frozenset(
            t
            for t in (StageAck, BeginAnswer)
            if t.__name__ not in menu and not (t is BeginAnswer and experiment.driver_timeouts)
        )

    # -- initial state ------------------------------------------------------------------------
    def initial(self) -> State:
        home = tuple(kg % self.x.taskmanagers for kg in self.kgs)
        v0: Version = (0, 0)
        tms = tuple(
            TaskManager(slots=tuple(Slot(kg, v0, -1, (), ()) for kg in self.kgs if home[kg] == t)) for t in self.tm_ids
        )
        jm = JobManager(home=home, assign=home, deployed=frozenset(self.kgs), registered=frozenset(self.tm_ids))
        budget = Budget(self.x.faults, self.x.speculation, 1 if self.x.operator else 0)
        s = State(Driver(), jm, tms, (), frozenset(), budget, Ghost())
        return self._begin(s, s.driver) if self.x.driver else s

    # -- small helpers ------------------------------------------------------------------------
    def _tm(self, s: State, t: int, tm: TaskManager) -> State:
        return s._replace(tms=s.tms[:t] + (tm,) + s.tms[t + 1 :])

    def _send(self, s: State, *msgs: Message) -> State:
        """Put messages on the network; a message to a down process or over a cut link is lost
        at once (the connection is refused or times out)."""
        keep = []
        for m in msgs:
            if type(m) in self.eager:
                s = self._eager_delivery(s, m)
                continue
            if isinstance(m, TO_JOBMANAGER) and not s.jm.up:
                continue
            if isinstance(m, JM_TM):
                tm = s.tms[m.tm]
                if tm.cut:
                    continue
                if isinstance(m, TO_TASKMANAGER) and not tm.up:
                    continue
            keep.append(m)
        if not keep:
            return s
        return s._replace(net=s.net | frozenset(keep))

    def _epoch_of(self, jm: JobManager, query: str, batch: int) -> int | None:
        """The job epoch of a batch (BeginBatch's rule), or None if the batch is refused."""
        if not self.p.lineage_epochs:
            return batch
        current = jm.lineage[-1] if jm.lineage else None
        if current is not None and current[0] == query:
            return batch + current[1]
        if any(q == query for q, _ in jm.lineage):
            return None  # the state has moved on to another query
        if batch == 0 or not self.p.epoch_gap_refusal:
            return jm.committed + 1  # a new query binds at C+1 (when its first epoch commits)
        return None  # a new query at batch > 0: the state lacks its first batches

    def _holds(self, ck: Checkpoint, query: str, batch: int, epoch: int) -> bool:
        """Whether a completed checkpoint holds this batch (epoch >= E of the same lineage)."""
        if ck.epoch < epoch:
            return False
        return not self.p.lineage_epochs or (query, epoch - batch) in ck.lineage

    def _decision(self, s: State, epoch: int) -> LogEntry | None:
        """The decision a restore takes for ``epoch``: the first DECIDED record by name, if any."""
        for entry in s.log:
            if entry[0] == epoch and entry[2] == DECIDED:
                return entry
        return None

    def _decided(self, s: State, query: str, batch: int, epoch: int) -> bool:
        """(overlapped) Whether the changelog holds the decision of this batch as this epoch."""
        d = self._decision(s, epoch) if self.x.overlapped else None
        return d is not None and (d[3], d[4]) == (query, batch)

    def _replay(
        self, s: State, committed: int, lineage: Lineage, snaps: dict[int, Snapshot]
    ) -> tuple[int, Lineage, dict[int, Snapshot]]:
        """(overlapped) A restore's continuation: the decided epochs above ``committed``, in order,
        each folded from its change sets, up to the first epoch without a usable decision."""
        if not (self.x.overlapped and self.p.replay_decisions_on_restore):
            return committed, lineage, snaps
        while True:
            epoch = committed + 1
            d = self._decision(s, epoch)
            if d is None:
                return committed, lineage, snaps
            found = {cs[2]: cs[3] for cs in s.changes if cs[0] == epoch and cs[1] == d[5]}
            if set(found) != set(self.kgs):
                return committed, lineage, snaps  # a decision without its data cannot be replayed
            snaps = {
                kg: Snapshot(kg, epoch, snaps[kg].applied + (epoch,), _insert(snaps[kg].data, *found[kg]))
                for kg in self.kgs
            }
            query, batch = d[3], d[4]
            if self.p.lineage_epochs and not any(q == query for q, _ in lineage):
                lineage = lineage + ((query, epoch - batch),)
            committed = epoch

    def _recovered(self, s: State) -> dict[int, Snapshot]:
        """(overlapped) What a restore would deploy now: the latest checkpoint and the decisions above it."""
        if s.store:
            ck = s.store[-1]
            committed, lineage, snaps = ck.epoch, ck.lineage, {x.kg: x for x in ck.snapshots}
        else:
            committed, lineage, snaps = -1, (), {kg: Snapshot(kg, -1, (), ()) for kg in self.kgs}
        return self._replay(s, committed, lineage, snaps)[2]

    # -- the driver ---------------------------------------------------------------------------
    def _begin(self, s: State, d: Driver) -> State:
        """The driver (re)starts the current batch: BeginBatch, or FINISHED."""
        if d.returned_total >= self.x.batches:
            return s._replace(driver=d._replace(phase=FINISHED, attempts=(), winners=()))
        d = d._replace(phase=BEGIN, attempts=(), winners=(), spawned=0)
        return self._send(s._replace(driver=d), BeginBatch(d.incarnation, d.query, d.done))

    def _stop(self, s: State, reason: str) -> State:
        return s._replace(driver=s.driver._replace(phase=STOPPED, stop_reason=reason, attempts=(), winners=()))

    def _launch(self, s: State, d: Driver, partition: int) -> tuple[State, Driver]:
        """Spark launches a new attempt of a partition; it sends all its write requests."""
        aid: Aid = (d.incarnation, d.run, d.spawned)
        d = d._replace(attempts=d.attempts + (Attempt(partition, aid, frozenset()),), spawned=d.spawned + 1)
        msgs = [Stage(d.routing[kg], kg, d.epoch, d.query, d.done, partition, aid, kg, d.version) for kg in self.kgs]
        return self._send(s._replace(driver=d), *msgs), d

    def _on_begin_answer(self, s: State, m: BeginAnswer) -> State:
        d = s.driver
        if m.verdict == "RUN":
            # Attempt ids are only compared for equality, and every id of a dead attempt is
            # collected (normalize), so the run takes the smallest run number not in use: the
            # same behaviour as a fresh nonce, with a finite state space.
            used = {aid[1] for aid in self._live_aids(s) if aid[0] == d.incarnation}
            run = next(r for r in range(1, len(used) + 2) if r not in used)
            d = d._replace(
                phase=RUN,
                epoch=m.epoch,
                version=m.version,
                routing=m.routing,
                run=run,
                attempts=(),
                spawned=0,
                winners=(),
            )
            for p in self.partitions:
                s, d = self._launch(s, d, p)
            return s
        if m.verdict == "DURABLE":
            d = d._replace(phase=DURABLE, epoch=m.epoch)
            return self._send(s._replace(driver=d), DurableRequest(d.incarnation, d.query, d.done, m.epoch))
        if m.verdict == "WAIT":
            if not self.p.retry_job_state_errors:
                return self._stop(s, "JobStateError: job RESTARTING")
            return self._begin(s, d)
        if m.verdict == "FAILED":
            return self._stop(s, "JobStateError: job FAILED")
        return self._stop(s, "EpochGapError")

    def _on_stage_ack(self, s: State, m: StageAck) -> State:
        d = s.driver
        att = next(a for a in d.attempts if a.aid == m.aid)
        if not m.ok:
            # A task whose write is refused (stale routing, lease expired, dead TaskManager)
            # fails, and so does the batch: it runs again from BeginBatch.
            return self._begin(s, d)
        att = att._replace(acked=att.acked | {m.seq})
        if len(att.acked) < len(self.kgs):
            return s._replace(driver=d._replace(attempts=tuple(att if a.aid == m.aid else a for a in d.attempts)))
        # The attempt succeeded and is the first of its partition: Spark keeps it. Its
        # speculative siblings are forgotten; their writes still in flight keep staging.
        ledger = tuple((kg, 1) for kg in sorted(att.acked))
        winners = tuple(sorted(d.winners + ((att.partition, att.aid, ledger),)))
        d = d._replace(winners=winners, attempts=tuple(a for a in d.attempts if a.partition != att.partition))
        if len(winners) < len(self.partitions):
            return s._replace(driver=d)
        d = d._replace(phase=COMMIT)
        return self._send(
            s._replace(driver=d), CommitRequest(d.incarnation, d.query, d.done, d.epoch, d.version, winners)
        )

    def _on_batch_answer(self, s: State, m: BatchAnswer) -> State:
        d = s.driver
        if m.status == "REFUSED":
            return self._stop(s, "EpochGapError")
        completed = m.status == "COMPLETED" and m.epoch >= d.epoch
        if not self.p.driver_checks_checkpoint_status and m.status == "CHECKPOINT_FAILED":
            completed = True  # the bug: a commit whose checkpoint failed counted as done
        if not completed:
            if m.status == "JOB_RESTARTING" and not self.p.retry_job_state_errors:
                return self._stop(s, "JobStateError: job restarted")
            return self._begin(s, d)
        # foreachBatch returns; Spark records the batch as done.
        ghost = s.ghost
        key = (d.query, d.done)
        # (An operator restore may have removed the checkpoint that answered: then the query
        # must be refused later, which the other invariants check.)
        if (
            ghost.bad_return is None
            and not ghost.operator_gap
            and not any(self._holds(ck, d.query, d.done, d.epoch) for ck in s.store)
            and not self._decided(s, d.query, d.done, d.epoch)
        ):
            ghost = ghost._replace(bad_return=key)
        ghost = ghost._replace(returned=ghost.returned | {key})
        d = d._replace(done=d.done + 1, returned_total=d.returned_total + 1)
        return self._begin(s._replace(ghost=ghost), d)

    def _driver_waits_on(self, s: State) -> bool:
        """Whether the driver's current call is still alive somewhere (request, answer or JobManager)."""
        d = s.driver
        key = (d.incarnation, d.query, d.done)
        kinds = (BeginBatch, BeginAnswer) if d.phase == BEGIN else (CommitRequest, DurableRequest, BatchAnswer)
        for m in s.net:
            if isinstance(m, kinds) and (m.inc, m.query, m.batch) == key:
                return True
        jm = s.jm
        if jm.up and d.phase in (COMMIT, DURABLE):
            c = jm.commit
            if c is not None and (c.inc, c.query, c.batch) == key:
                return True
            if any((w.inc, w.query, w.batch) == key for w in jm.waiters):
                return True
        return False

    # -- the TaskManagers ---------------------------------------------------------------------
    def _serving(self, tm: TaskManager) -> bool:
        return tm.up and (tm.lease or not self.p.lease_fencing)

    def _version_ok(self, slot: Slot, version: Version) -> bool:
        return slot.version == version or not self.p.routing_version_check

    def _on_stage(self, s: State, m: Stage, pause: bool = False) -> State:
        tm = s.tms[m.tm]
        slot = tm.slot(m.kg)
        refuse = StageAck(m.tm, m.kg, m.aid, m.seq, False)
        if not tm.up or not self._serving(tm) or slot is None or not self._version_ok(slot, m.version):
            return self._send(s, refuse)
        if m.epoch <= slot.committed:
            return self._send(s, refuse)  # a stale attempt (zombie or re-run of a committed batch)
        if slot.committed < m.epoch - 1 and s.ghost.stale_read is None and not s.ghost.operator_gap:
            s = s._replace(
                ghost=s.ghost._replace(
                    stale_read=f"tm{m.tm} kg{m.kg} served a call of epoch {m.epoch} holding epoch {slot.committed}"
                )
            )
        entry: Staged = (m.epoch, m.partition, m.aid, m.seq, m.query, m.batch)
        if not (self.p.seq_dedup and entry in slot.staged):
            slot = slot._replace(staged=_insert(slot.staged, entry))
            tm = tm._replace(slots=tuple(slot if x.kg == m.kg else x for x in tm.slots))
            s = self._tm(s, m.tm, tm)
        if pause:
            # The process stops after staging, before answering, for longer than its lease.
            return self._tm(s, m.tm, tm._replace(in_call=m, paused=True, lease=False))
        return self._send(s, StageAck(m.tm, m.kg, m.aid, m.seq, True))

    def _answer_call(self, s: State, t: int) -> State:
        """The second half of a write call: check the lease again, then answer."""
        tm = s.tms[t]
        m = tm.in_call
        assert m is not None
        s = self._tm(s, t, tm._replace(in_call=None))
        if self.p.lease_recheck_before_answer and not self._serving(tm):
            return self._send(s, StageAck(t, m.kg, m.aid, m.seq, False))
        if not tm.lease and s.ghost.stale_answer is None:
            owners = [o for o in self.servers(s, m.kg) if o != t]
            who = f"; tm{owners[0]} owns kg{m.kg} now" if owners else ""
            s = s._replace(
                ghost=s.ghost._replace(
                    stale_answer=f"tm{t} acknowledged a write to kg{m.kg} after its lease ran out{who}"
                )
            )
        return self._send(s, StageAck(t, m.kg, m.aid, m.seq, True))

    def _on_prepare(self, s: State, m: Prepare) -> State:
        tm = s.tms[m.tm]
        slot = tm.slot(m.kg)
        ok = self._serving(tm) and slot is not None and self._version_ok(slot, m.version)
        if ok and self.p.taskmanager_gap_check:
            ok = slot.committed == m.epoch - 1  # type: ignore[union-attr]
        if ok and self.p.ledger_check:
            for p, aid, count in m.counts:
                staged = len([e for e in slot.staged if e[0] == m.epoch and e[1] == p and e[2] == aid])  # type: ignore[union-attr]
                ok = ok and staged == count
        if ok and self.x.overlapped and self.p.upload_before_decision:
            # The change set is durable in checkpoint storage before the slot answers.
            assert slot is not None  # ok implies a slot
            chosen = {(p, aid) for p, aid, _ in m.counts}
            data: Data = tuple(
                sorted((e[0], e[4], e[5], e[1]) for e in slot.staged if e[0] == m.epoch and (e[1], e[2]) in chosen)
            )
            key = (m.epoch, m.version, m.kg)
            changes = frozenset(cs for cs in s.changes if cs[:3] != key) | {(m.epoch, m.version, m.kg, data)}
            s = s._replace(changes=changes)
        return self._send(s, PrepareAnswer(m.session, m.tm, m.kg, m.epoch, m.version, m.counts, ok))

    def _on_apply(self, s: State, m: Apply) -> State:
        tm = s.tms[m.tm]
        slot = tm.slot(m.kg)
        ok = self._serving(tm) and slot is not None and self._version_ok(slot, m.version)
        if ok and slot.committed < m.epoch:  # type: ignore[union-attr]
            if self.p.taskmanager_gap_check and slot.committed != m.epoch - 1:  # type: ignore[union-attr]
                ok = False
            else:
                # One atomic write batch: the winners' staged writes and COMMITTED_EPOCH = E;
                # everything else staged up to E is dropped.
                assert slot is not None  # ok implies a slot
                chosen = set(m.winners)
                new: list[Entry] = [
                    (e[0], e[4], e[5], e[1]) for e in slot.staged if e[0] == m.epoch and (e[1], e[2]) in chosen
                ]
                slot = slot._replace(
                    committed=m.epoch,
                    data=_insert(slot.data, *new),
                    applied=slot.applied + (m.epoch,),
                    staged=tuple(e for e in slot.staged if e[0] > m.epoch),
                )
                tm = tm._replace(slots=tuple(slot if x.kg == m.kg else x for x in tm.slots))
                s = self._tm(s, m.tm, tm)
        return self._send(s, ApplyAnswer(m.session, m.tm, m.kg, m.epoch, m.version, m.winners, ok))

    def _on_barrier(self, s: State, m: Barrier) -> State:
        tm = s.tms[m.tm]
        slot = tm.slot(m.kg)
        ok = self._serving(tm) and slot is not None and self._version_ok(slot, m.version)
        if ok and self.p.barrier_epoch_check:
            ok = slot.committed == m.epoch  # type: ignore[union-attr]
        snap = (slot.committed, slot.applied, slot.data) if slot is not None else (-1, (), ())
        return self._send(s, BarrierAck(m.session, m.tm, m.kg, m.epoch, m.version, ok, *snap, self._serving(tm)))

    def _raise_floor(self, tm: TaskManager, version: Version) -> TaskManager:
        if self.p.taskmanager_version_floor and version > tm.floor:
            return tm._replace(floor=version)
        return tm

    def _on_release(self, s: State, m: Release) -> State:
        tm = s.tms[m.tm]
        tm = self._raise_floor(tm, m.version)._replace(slots=tuple(x for x in tm.slots if x.version >= m.version))
        return self._send(self._tm(s, m.tm, tm), Released(m.session, m.tm, m.version))

    def _on_deploy(self, s: State, m: Deploy) -> State:
        tm = s.tms[m.tm]
        old = tm.slot(m.kg)
        if (old is not None and old.version > m.version) or m.version < tm.floor:
            return s
        slots = [x for x in tm.slots if x.kg != m.kg] + [Slot(m.kg, m.version, m.committed, m.data, (), m.applied)]
        tm = self._raise_floor(tm, m.version)._replace(slots=tuple(sorted(slots, key=lambda x: x.kg)))
        return self._send(self._tm(s, m.tm, tm), Deployed(m.session, m.tm, m.kg, m.version, m.committed))

    def _revoke_and_register(self, s: State, t: int) -> State:
        """A TaskManager revokes its own lease, drops its slots and registers again."""
        tm = s.tms[t]._replace(lease=False, session=-1, slots=())
        return self._send(self._tm(s, t, tm), Register(t))

    # -- the JobManager -----------------------------------------------------------------------
    def _answer(self, s: State, inc: int, query: str, batch: int, status: str, epoch: int) -> State:
        return self._send(s, BatchAnswer(inc, query, batch, status, epoch))

    def _on_begin(self, s: State, m: BeginBatch) -> State:
        jm = s.jm
        epoch = -1
        if jm.status == FAILED:
            verdict = "FAILED"
        elif jm.status != RUNNING:
            verdict = "WAIT"
        else:
            e = self._epoch_of(jm, m.query, m.batch)
            if e is None:
                verdict = "REFUSED"
            else:
                epoch = e
                if e <= jm.committed:
                    verdict = "DURABLE"
                elif e == jm.committed + 1 or not self.p.epoch_gap_refusal:
                    verdict = "RUN"
                else:
                    verdict = "REFUSED"
        return self._send(s, BeginAnswer(m.inc, m.query, m.batch, verdict, epoch, jm.version, jm.assign))

    def _wait_durable(self, s: State, inc: int, query: str, batch: int, epoch: int) -> State:
        """Answer COMPLETED if a completed checkpoint holds the batch, or wait for one."""
        for ck in reversed(s.store):
            if self._holds(ck, query, batch, epoch):
                return self._answer(s, inc, query, batch, "COMPLETED", ck.epoch)
        if self._decided(s, query, batch, epoch):
            return self._answer(s, inc, query, batch, "COMPLETED", epoch)
        return s._replace(jm=s.jm._replace(waiters=s.jm.waiters | {Waiter(inc, query, batch, epoch)}))

    def _on_commit(self, s: State, m: CommitRequest) -> State:
        jm = s.jm
        if jm.status != RUNNING:
            return self._answer(s, m.inc, m.query, m.batch, "JOB_RESTARTING", m.epoch)
        e = self._epoch_of(jm, m.query, m.batch)
        if e is None:
            return self._answer(s, m.inc, m.query, m.batch, "REFUSED", m.epoch)
        if e != m.epoch:
            return self._answer(s, m.inc, m.query, m.batch, "RETRY", m.epoch)
        if e <= jm.committed:
            return self._wait_durable(s, m.inc, m.query, m.batch, e)
        if e > jm.committed + 1 and self.p.epoch_gap_refusal:
            return self._answer(s, m.inc, m.query, m.batch, "REFUSED", m.epoch)
        if self.p.routing_version_check and m.version != jm.version:
            return self._answer(s, m.inc, m.query, m.batch, "RETRY", m.epoch)
        c = CommitInProgress(m.inc, m.query, m.batch, e, m.version, m.winners, False, frozenset())
        s = s._replace(jm=jm._replace(commit=c))
        return self._send(s, *(self._prepare_msg(s.jm, c, kg) for kg in self.kgs))

    def _prepare_msg(self, jm: JobManager, c: CommitInProgress, kg: int) -> Prepare:
        counts: Counts = tuple((p, aid, dict(ledger).get(kg, 0)) for p, aid, ledger in c.winners)
        return Prepare(jm.session, jm.assign[kg], kg, c.epoch, c.version, counts)

    def _apply_msg(self, jm: JobManager, c: CommitInProgress, kg: int) -> Apply:
        winners: Winners = tuple((p, aid) for p, aid, _ in c.winners)
        return Apply(jm.session, jm.assign[kg], kg, c.epoch, c.version, winners)

    def _on_prepare_answer(self, s: State, m: PrepareAnswer) -> State:
        jm = s.jm
        c = jm.commit
        assert c is not None
        if not m.ok:
            # A refused prepare applies nothing anywhere; the batch runs again.
            s = s._replace(jm=jm._replace(commit=None))
            return self._answer(s, c.inc, c.query, c.batch, "RETRY", c.epoch)
        c = c._replace(answered=c.answered | {m.kg})
        if len(c.answered) < len(self.kgs):
            return s._replace(jm=jm._replace(commit=c))
        if self.x.overlapped:
            # Create-only, at the first free name of the epoch (the JobManager lists it first).
            n = sum(1 for entry in s.log if entry[0] == c.epoch)
            c = c._replace(deciding=True, answered=frozenset())
            s = s._replace(jm=jm._replace(commit=c))
            return self._send(s, DecisionWrite(jm.session, s.gen, c.epoch, n, c.query, c.batch, c.version))
        c = c._replace(applying=True, answered=frozenset())
        s = s._replace(jm=jm._replace(commit=c))
        return self._send(s, *(self._apply_msg(s.jm, c, kg) for kg in self.kgs))

    def _on_decision_write(self, s: State, m: DecisionWrite) -> State:
        """Checkpoint storage takes a create-only decision write (first writer of a name wins)."""
        taken = m.gen != s.gen or any(entry[:2] == (m.epoch, m.n) for entry in s.log)
        if not taken:
            s = s._replace(log=_insert(s.log, (m.epoch, m.n, DECIDED, m.query, m.batch, m.version)))
        return self._send(s, DecisionWritten(m.session, m.epoch, m.version, not taken))

    def _on_decision_written(self, s: State, m: DecisionWritten) -> State:
        jm = s.jm
        c = jm.commit
        assert c is not None
        if not m.ok:
            s = s._replace(jm=jm._replace(commit=None))
            return self._answer(s, c.inc, c.query, c.batch, "RETRY", c.epoch)
        # The epoch is decided: C moves, the driver returns, the apply goes on behind it.
        lineage = jm.lineage
        if self.p.lineage_epochs and not any(q == c.query for q, _ in lineage):
            lineage = lineage + ((c.query, c.epoch - c.batch),)
        c = c._replace(deciding=False, applying=True, answered=frozenset())
        s = s._replace(jm=jm._replace(commit=c, committed=c.epoch, lineage=lineage))
        s = self._answer(s, c.inc, c.query, c.batch, "COMPLETED", c.epoch)
        return self._send(s, *(self._apply_msg(s.jm, c, kg) for kg in self.kgs))

    def _on_apply_answer(self, s: State, m: ApplyAnswer) -> State:
        jm = s.jm
        c = jm.commit
        assert c is not None
        if not m.ok:
            # Not applied everywhere: fail over before the lock is released.
            return self._failover(s, "an Apply was refused")
        c = c._replace(answered=c.answered | {m.kg})
        if len(c.answered) < len(self.kgs):
            return s._replace(jm=jm._replace(commit=c))
        if self.x.overlapped:
            return s._replace(jm=jm._replace(commit=None))  # decided and answered already
        lineage = jm.lineage
        if self.p.lineage_epochs and not any(q == c.query for q, _ in lineage):
            lineage = lineage + ((c.query, c.epoch - c.batch),)
        s = s._replace(jm=jm._replace(commit=None, committed=c.epoch, lineage=lineage))
        return self._wait_durable(s, c.inc, c.query, c.batch, c.epoch)

    def _checkpoint_failed(self, s: State, counted: bool = True) -> State:
        """A pending checkpoint failed; ``counted`` False: a TaskManager without a lease refused its
        barrier (NOT_ALL_REQUIRED_TASKS_RUNNING, which tolerable-failed-checkpoints does not count,
        as in Flink: the heartbeat timeout, not the checkpoint count, fails such a TaskManager over)."""
        jm = s.jm
        failed = jm.failed_checkpoints + (1 if counted else 0)
        s = s._replace(jm=jm._replace(pending=None, failed_checkpoints=failed))
        s = self._fail_waiters(s)
        if counted and failed > self.x.tolerable_failed_checkpoints:
            return self._failover(s, "too many failed checkpoints")
        return s  # (a failed rescale checkpoint gives the rescale up)

    def _fail_waiters(self, s: State) -> State:
        for w in sorted(s.jm.waiters, key=lambda w: (w.inc, w.query, w.batch, w.epoch)):
            s = self._answer(s, w.inc, w.query, w.batch, "CHECKPOINT_FAILED", w.epoch)
        return s._replace(jm=s.jm._replace(waiters=frozenset()))

    def _on_barrier_ack(self, s: State, m: BarrierAck) -> State:
        jm = s.jm
        pc = jm.pending
        assert pc is not None
        if not m.ok or (self.p.barrier_epoch_check and m.committed != pc.epoch):
            return self._checkpoint_failed(s, counted=m.leased)
        pc = pc._replace(acks=tuple(sorted(pc.acks + (Snapshot(m.kg, m.committed, m.applied, m.data),))))
        if len(pc.acks) < len(self.kgs):
            return s._replace(jm=jm._replace(pending=pc))
        # _metadata is written last: only now the checkpoint is complete.
        ck = Checkpoint(pc.epoch, pc.lineage, pc.acks)
        store = (s.store + (ck,))[-self.x.retained_checkpoints :]
        s = s._replace(store=store, jm=jm._replace(pending=None, failed_checkpoints=0))
        waiting = set()
        for w in sorted(s.jm.waiters, key=lambda w: (w.inc, w.query, w.batch, w.epoch)):
            if self._holds(ck, w.query, w.batch, w.epoch):
                s = self._answer(s, w.inc, w.query, w.batch, "COMPLETED", ck.epoch)
            else:
                waiting.add(w)
        s = s._replace(jm=s.jm._replace(waiters=frozenset(waiting)))
        if pc.rescale:
            return self._failover(s, "rescale", new_home=tuple(0 for _ in self.kgs))
        return s

    def _on_released(self, s: State, m: Released) -> State:
        return s._replace(jm=s.jm._replace(unfenced=s.jm.unfenced - {m.tm}))

    def _on_deployed(self, s: State, m: Deployed) -> State:
        jm = s.jm
        if self.p.rollback_committed_on_restore and m.committed != jm.committed:
            return self._failover(s, "a deployed slot reported another epoch")
        jm = jm._replace(deployed=jm.deployed | {m.kg})
        if len(jm.deployed) == len(self.kgs):
            jm = jm._replace(status=RUNNING, restoring=False)
        return s._replace(jm=jm)

    def _on_register(self, s: State, m: Register) -> State:
        jm = s.jm
        if m.tm in jm.assign and (jm.status == RUNNING or jm.restoring):
            # A fresh TaskManager process: the slots it hosted are gone.
            s = self._failover(s, f"tm{m.tm} registered again without its slots")
        # It revoked its own lease before registering: it is fenced.
        jm = s.jm
        s = s._replace(
            jm=jm._replace(registered=jm.registered | {m.tm}, lost=jm.lost - {m.tm}, unfenced=jm.unfenced - {m.tm})
        )
        return self._send(s, Registered(jm.session, m.tm, s.jm.version))

    def _failover(self, s: State, why: str, new_home: tuple[int, ...] | None = None, empty: bool = False) -> State:
        """Abort the pending checkpoint and commit, move the routing version, release the
        slots; the deploy waits for every previous owner to be fenced."""
        jm = s.jm
        if jm.status == FAILED:
            return s
        c = jm.commit
        if c is not None:
            s = self._answer(s, c.inc, c.query, c.batch, "JOB_RESTARTING", c.epoch)
        s = self._fail_waiters(s)
        jm = s.jm
        if jm.version[1] >= self.x.max_restarts:
            # The restart strategy gives up (this also bounds the routing versions).
            return s._replace(jm=jm._replace(status=FAILED, commit=None, pending=None, restoring=False))
        version = (jm.session, jm.version[1] + 1)
        previous = frozenset(jm.assign)
        jm = jm._replace(
            status=RESTARTING,
            version=version,
            commit=None,
            pending=None,
            deployed=frozenset(),
            restoring=False,
            assign=(),
            unfenced=jm.unfenced | previous,
            home=new_home or jm.home,
            restore_empty=empty,
            payload=(),
        )
        s = s._replace(jm=jm)
        return self._send(s, *(Release(jm.session, t, version) for t in sorted(previous)))

    def _restore_and_deploy(self, s: State) -> State:
        jm = s.jm
        lineage: tuple[tuple[str, int], ...]
        if jm.restore_empty or not s.store:
            committed, lineage, snaps = -1, (), {kg: Snapshot(kg, -1, (), ()) for kg in self.kgs}
        else:
            ck = s.store[-1]
            committed, lineage = ck.epoch, ck.lineage
            snaps = {x.kg: x for x in ck.snapshots}
        committed, lineage, snaps = self._replay(s, committed, lineage, snaps)
        if self.x.overlapped and self.p.seal_on_restore:
            # Seal the next epoch: a decision write still in flight can no longer land there.
            n = sum(1 for entry in s.log if entry[0] == committed + 1)
            s = s._replace(log=_insert(s.log, (committed + 1, n, SEALED, "", -1, jm.version)))
        if not self.p.rollback_committed_on_restore:
            committed, lineage = jm.committed, jm.lineage  # the bug: C kept from before the restore
        available = sorted(jm.registered - jm.lost)
        assign = tuple(jm.home[kg] if jm.home[kg] in available else available[0] for kg in self.kgs)
        payload = tuple(snaps[kg] for kg in self.kgs)
        jm = jm._replace(
            committed=committed, lineage=lineage, assign=assign, restoring=True, restore_empty=False, payload=payload
        )
        s = s._replace(jm=jm)
        return self._send(s, *(Deploy(jm.session, assign[kg], kg, jm.version, *payload[kg][1:]) for kg in self.kgs))

    def _declare_lost(self, s: State, t: int, why: str) -> State:
        jm = s.jm
        s = s._replace(jm=jm._replace(lost=jm.lost | {t}, registered=jm.registered - {t}))
        if t in jm.assign and (jm.status == RUNNING or jm.restoring):
            s = self._failover(s, why)
        return s

    def _jm_restart(self, s: State) -> State:
        old = s.jm
        session = old.session + 1
        # The new leader reloads the job from the HA store; C and the lineage come back only
        # with the restore of the latest completed checkpoint.
        jm = JobManager(
            session=session,
            status=FAILED if old.status == FAILED else RESTARTING,
            version=(session, 0),
            home=old.home,
            registered=frozenset(),
            unfenced=frozenset(self.tm_ids),
        )
        return s._replace(jm=jm)

    # -- successors ---------------------------------------------------------------------------
    def successors(self, s: State) -> Iterator[tuple[str, State]]:
        """Every step from `s`, labelled for traces."""
        d = s.driver
        if d.phase in (FINISHED, STOPPED):
            return
        for steps in (
            self._deliveries,
            self._driver_steps,
            self._jobmanager_steps,
            self._taskmanager_steps,
            self._faults,
        ):
            if steps == self._driver_steps and not self.x.driver:
                continue
            for label, ns in steps(s):
                yield label, self.normalize(ns)

    def _eager_delivery(self, s: State, m: Message) -> State:
        """Deliver a message at once (see `eager`), unless it is already an answer nobody awaits."""
        if self._garbage(s, m, self._live_aids(s)):
            return s
        return self._deliver(s, m)

    def _deliverable(self, s: State, m: Message) -> bool:
        if isinstance(m, CommitRequest) and s.jm.commit is not None:
            return False  # it waits for the job lock
        if isinstance(m, TO_TASKMANAGER):
            tm = s.tms[m.tm]
            if tm.paused or (isinstance(m, Stage) and tm.in_call is not None):
                return False  # it waits in the socket until the process runs (one call at a time)
            if isinstance(m, Stage) and self.x.overlapped and self.p.read_fence:
                slot = tm.slot(m.kg)
                if (
                    slot is not None
                    and self._serving(tm)
                    and self._version_ok(slot, m.version)
                    and slot.committed < m.epoch - 1
                ):
                    return False  # the read fence: it waits until the slot applied the previous epoch
        return True

    def _deliver(self, s: State, m: Message) -> State:
        """The receiver of `m` handles it; `m` is already off the network."""
        if isinstance(m, DecisionWrite):
            return self._on_decision_write(s, m)
        if isinstance(m, TO_JOBMANAGER):
            if not s.jm.up:
                return s
            if isinstance(m, BeginBatch):
                return self._on_begin(s, m)
            if isinstance(m, CommitRequest):
                return self._on_commit(s, m)
            if isinstance(m, DurableRequest):
                jm = s.jm
                if jm.status != RUNNING:
                    return self._answer(s, m.inc, m.query, m.batch, "JOB_RESTARTING", m.epoch)
                e = self._epoch_of(jm, m.query, m.batch)
                if e is None:
                    return self._answer(s, m.inc, m.query, m.batch, "REFUSED", m.epoch)
                if e > jm.committed or e != m.epoch:
                    return self._answer(s, m.inc, m.query, m.batch, "RETRY", m.epoch)
                return self._wait_durable(s, m.inc, m.query, m.batch, e)
            if isinstance(m, PrepareAnswer):
                return self._on_prepare_answer(s, m)
            if isinstance(m, ApplyAnswer):
                return self._on_apply_answer(s, m)
            if isinstance(m, DecisionWritten):
                return self._on_decision_written(s, m)
            if isinstance(m, BarrierAck):
                return self._on_barrier_ack(s, m)
            if isinstance(m, Released):
                return self._on_released(s, m)
            if isinstance(m, Deployed):
                return self._on_deployed(s, m)
            if isinstance(m, Register):
                return self._on_register(s, m)
            if isinstance(m, Heartbeat):
                jm = s.jm
                known = m.tm in jm.registered and m.tm not in jm.lost
                return self._send(s, HeartbeatAnswer(jm.session, m.tm, known))
            raise AssertionError(m)
        if isinstance(m, Stage):
            if not s.tms[m.tm].up:
                return self._send(s, StageAck(m.tm, m.kg, m.aid, m.seq, False))  # connection refused
            return self._on_stage(s, m)
        if isinstance(m, TO_TASKMANAGER):
            if not s.tms[m.tm].up:
                return s
            if isinstance(m, Prepare):
                return self._on_prepare(s, m)
            if isinstance(m, Apply):
                return self._on_apply(s, m)
            if isinstance(m, Barrier):
                return self._on_barrier(s, m)
            if isinstance(m, Release):
                return self._on_release(s, m)
            if isinstance(m, Deploy):
                return self._on_deploy(s, m)
            if isinstance(m, Registered):
                tm = s.tms[m.tm]
                if tm.session != -1 or m.session != s.jm.session:
                    return s
                keep = tuple(x for x in tm.slots if x.version >= m.version)
                tm = self._raise_floor(tm, m.version)._replace(session=m.session, lease=True, slots=keep)
                return self._tm(s, m.tm, tm)
            if isinstance(m, HeartbeatAnswer):
                tm = s.tms[m.tm]
                if tm.session != m.session:
                    return s
                if m.known:
                    return self._tm(s, m.tm, tm._replace(lease=True))
                return self._revoke_and_register(s, m.tm)
            raise AssertionError(m)
        if isinstance(m, BeginAnswer):
            return self._on_begin_answer(s, m)
        if isinstance(m, BatchAnswer):
            return self._on_batch_answer(s, m)
        if isinstance(m, StageAck):
            return self._on_stage_ack(s, m)
        raise AssertionError(m)

    def _deliveries(self, s: State) -> Iterator[tuple[str, State]]:
        x = self.x
        for m in sorted(s.net, key=_text):
            if not self._deliverable(s, m):
                continue
            rest = s._replace(net=s.net - {m})
            yield f"deliver {_text(m)}", self._deliver(rest, m)
            if s.budget.faults > 0:
                spent = rest._replace(budget=s.budget._replace(faults=s.budget.faults - 1))
                if x.pause and isinstance(m, Stage) and self._serving(s.tms[m.tm]):
                    yield (
                        f"deliver {_text(m)}, and PAUSE tm{m.tm} before it answers, for longer than its lease",
                        self._on_stage(spent, m, pause=True),
                    )
                if m.kind in x.drop:
                    yield f"LOSE {_text(m)}", spent
                if m.kind in x.duplicate:
                    yield (
                        f"DUPLICATE {_text(m)} (delivered, a copy stays in flight)",
                        self._deliver(spent._replace(net=s.net), m),
                    )

    def _driver_steps(self, s: State) -> Iterator[tuple[str, State]]:
        d = s.driver
        if d.phase in (BEGIN, COMMIT, DURABLE) and not self._driver_waits_on(s):
            yield "driver: its call was lost; runs the batch again", self._begin(s, d)
        if d.phase == RUN:
            for a in d.attempts:
                for kg in self.kgs:
                    if kg in a.acked:
                        continue
                    req = Stage(d.routing[kg], kg, d.epoch, d.query, d.done, a.partition, a.aid, kg, d.version)
                    if req in s.net or any(isinstance(m, StageAck) and m.aid == a.aid and m.seq == kg for m in s.net):
                        continue
                    yield f"executor: resend {req}", self._send(s, req)

    def _jobmanager_steps(self, s: State) -> Iterator[tuple[str, State]]:
        jm = s.jm
        if not jm.up:
            yield "jobmanager: a new leader takes over", self._jm_restart(s)
            return
        c = jm.commit
        if c is not None and not c.deciding:
            for kg in self.kgs:
                if kg in c.answered:
                    continue
                req: Message = self._apply_msg(jm, c, kg) if c.applying else self._prepare_msg(jm, c, kg)
                if req in s.net or any(isinstance(m, (PrepareAnswer, ApplyAnswer)) and m.kg == kg for m in s.net):
                    continue
                if s.tms[req.tm].up and not s.tms[req.tm].cut:  # type: ignore[attr-defined]
                    yield f"jobmanager: resend {req}", self._send(s, req)
        if jm.status == RESTARTING and not jm.restoring:
            ready = not jm.unfenced or not self.p.reassign_after_fencing
            if ready and jm.registered - jm.lost:
                yield "jobmanager: restore and deploy", self._restore_and_deploy(s)
            for t in sorted(jm.unfenced):
                tm = s.tms[t]
                # Only a TaskManager registered with this leader can be called; the others fence
                # themselves by registering again (or their lease bound passes).
                if (
                    tm.up
                    and not tm.cut
                    and tm.session == jm.session
                    and not any(isinstance(m, (Release, Released)) and m.tm == t for m in s.net)
                ):
                    yield f"jobmanager: resend Release to tm{t}", self._send(s, Release(jm.session, t, jm.version))
        if jm.restoring:
            for kg in self.kgs:
                t = jm.assign[kg]
                if kg in jm.deployed or not s.tms[t].up or s.tms[t].cut:
                    continue
                if any(isinstance(m, (Deploy, Deployed)) and m.kg == kg for m in s.net):
                    continue
                yield (
                    f"jobmanager: resend Deploy kg{kg}",
                    self._send(s, Deploy(jm.session, t, kg, jm.version, *jm.payload[kg][1:])),
                )
        if jm.status == RUNNING and jm.pending is None and (jm.commit is None or not self.p.cut_under_commit_lock):
            latest = s.store[-1].epoch if s.store else -1
            wanted = any(w.epoch > latest for w in jm.waiters) or (
                (self.x.periodic_checkpoints or self.x.overlapped) and jm.committed > latest
            )
            if wanted:
                yield f"jobmanager: trigger checkpoint at epoch {jm.committed}", self._trigger(s)
        if jm.pending is not None:
            for kg in self.kgs:
                if any(a.kg == kg for a in jm.pending.acks):
                    continue
                if not any(isinstance(m, (Barrier, BarrierAck)) and m.kg == kg for m in s.net):
                    yield (
                        "jobmanager: the checkpoint expires (a barrier or its ack was lost)",
                        self._checkpoint_failed(s),
                    )
                    break
        for t in self.tm_ids:
            tm = s.tms[t]
            if (not tm.up or tm.cut or tm.paused) and t not in jm.lost and (t in jm.assign or t in jm.registered):
                # The connection was refused (or timed out): declared lost early; the deploy
                # still waits until the TaskManager is fenced.
                yield f"jobmanager: declares tm{t} lost (connection failed)", self._declare_lost(s, t, f"tm{t} lost")
            if (not tm.up or not tm.lease) and (t in jm.unfenced or (t in jm.assign and t not in jm.lost)):
                if self._silent(s, t):
                    yield f"jobmanager: lease_bound of tm{t} passed", self._lease_bound_passed(s, t)
                elif s.budget.faults > 0 and (self.x.cut or self.x.pause):
                    spent = s._replace(budget=s.budget._replace(faults=s.budget.faults - 1))
                    yield f"DELAY tm{t}'s registration past its lease_bound", self._lease_bound_passed(spent, t)

    def _silent(self, s: State, t: int) -> bool:
        """Whether the JobManager cannot hear from TaskManager `t` (so time alone lets its lease
        bound pass); while a registration with this leader is under way it can, and only a
        delay (a fault) can make the bound pass."""
        tm = s.tms[t]
        if not tm.up or tm.cut or tm.paused:
            return True
        if tm.session == s.jm.session:
            return False
        return not any(isinstance(m, (Register, Registered)) and m.tm == t for m in s.net)

    def _lease_bound_passed(self, s: State, t: int) -> State:
        # By the clock argument every lease the TaskManager could still be granted by an answer
        # in flight (a heartbeat answer, a registration answer) ends before now: delivering
        # one would change nothing, so they are dropped.
        net = frozenset(m for m in s.net if not (isinstance(m, (HeartbeatAnswer, Registered)) and m.tm == t))
        s = s._replace(net=net)
        if t not in s.jm.lost:
            s = self._declare_lost(s, t, f"tm{t} heartbeat timeout")
        return s._replace(jm=s.jm._replace(unfenced=s.jm.unfenced - {t}))

    def _trigger(self, s: State) -> State:
        jm = s.jm
        pc = Pending(jm.committed, jm.version, jm.lineage, ())
        s = s._replace(jm=jm._replace(pending=pc))
        return self._send(s, *(Barrier(jm.session, jm.assign[kg], kg, jm.committed, jm.version) for kg in self.kgs))

    def _taskmanager_steps(self, s: State) -> Iterator[tuple[str, State]]:
        jm = s.jm
        for t in self.tm_ids:
            tm = s.tms[t]
            if not tm.up:
                yield (
                    f"tm{t}: restarts (empty) and registers",
                    self._send(self._tm(s, t, TaskManager(up=True, lease=False, session=-1)), Register(t)),
                )
                continue
            if tm.paused:
                yield f"tm{t}: wakes up (its lease ran out meanwhile)", self._tm(s, t, tm._replace(paused=False))
                continue
            if tm.in_call is not None:
                yield f"tm{t}: finishes the write call {_text(tm.in_call)}", self._answer_call(s, t)
            if tm.lease and (tm.cut or not jm.up or tm.session != jm.session):
                yield f"tm{t}: its lease runs out", self._tm(s, t, tm._replace(lease=False))
            if tm.cut:
                continue
            if self.x.cut or self.x.pause:
                # A heartbeat of a TaskManager the JobManager knows, with a valid lease, is
                # answered "known" and changes nothing: only the others are explored.
                useful = not tm.lease or t in jm.lost or t not in jm.registered
                if (
                    tm.session >= 0
                    and useful
                    and not any(isinstance(m, (Heartbeat, HeartbeatAnswer)) and m.tm == t for m in s.net)
                ):
                    yield f"tm{t}: heartbeat", self._send(s, Heartbeat(t))
            elif jm.up and tm.session >= 0 and tm.session != jm.session:
                # (A heartbeat answered "unknown" by the new leader.)
                yield (
                    f"tm{t}: learns of the new leader; revokes its lease and registers",
                    self._revoke_and_register(s, t),
                )
            if tm.session == -1 and not any(isinstance(m, (Register, Registered)) and m.tm == t for m in s.net):
                yield f"tm{t}: registers again", self._send(s, Register(t))

    def _faults(self, s: State) -> Iterator[tuple[str, State]]:
        x, b, d, jm = self.x, s.budget, s.driver, s.jm
        if b.faults > 0:
            spent = s._replace(budget=b._replace(faults=b.faults - 1))
            if "driver" in x.crash:
                nd = Driver(query=d.query, done=d.done, incarnation=d.incarnation + 1, returned_total=d.returned_total)
                yield "CRASH driver (a new driver re-runs the batch Spark had not recorded)", self._begin(spent, nd)
            if x.driver_timeouts and d.phase in (BEGIN, COMMIT, DURABLE) and self._driver_waits_on(s):
                yield "TIMEOUT driver gives up waiting (its call is only late)", self._begin(spent, d)
            if "executor" in x.crash:
                for a in d.attempts:
                    ns = spent._replace(driver=d._replace(attempts=tuple(y for y in d.attempts if y.aid != a.aid)))
                    ns, _ = self._launch(ns, ns.driver, a.partition)
                    yield f"CRASH executor running a{a.aid}; Spark retries p{a.partition}", ns
            if "jobmanager" in x.crash and jm.up:
                net = frozenset(m for m in s.net if not isinstance(m, TO_JOBMANAGER))
                yield "CRASH jobmanager", spent._replace(jm=jm._replace(up=False), net=net)
            for t in self.tm_ids:
                tm = s.tms[t]
                if "taskmanager" in x.crash and tm.up:
                    net = frozenset(m for m in s.net if not (isinstance(m, TO_TASKMANAGER) and m.tm == t))
                    yield (
                        f"CRASH tm{t}",
                        self._tm(spent._replace(net=net), t, TaskManager(up=False, lease=False, session=-1)),
                    )
                if x.cut and tm.up and not tm.cut:
                    net = frozenset(m for m in s.net if not (isinstance(m, JM_TM) and m.tm == t))
                    yield (
                        f"CUT tm{t} off from the jobmanager",
                        self._tm(spent._replace(net=net), t, tm._replace(cut=True)),
                    )
            if x.checkpoint_failures and jm.pending is not None:
                yield "CHECKPOINT FAILS (expired/declined)", self._checkpoint_failed(spent)
        for t in self.tm_ids:
            if s.tms[t].cut:
                yield f"tm{t}: the network heals", self._tm(s, t, s.tms[t]._replace(cut=False))
        if b.speculation > 0 and d.phase == RUN:
            for p in self.partitions:
                if sum(1 for a in d.attempts if a.partition == p) == 1:
                    ns = s._replace(budget=b._replace(speculation=b.speculation - 1))
                    ns, _ = self._launch(ns, d, p)
                    yield f"spark: speculative attempt of p{p}", ns
        if b.operator > 0:
            yield from self._operator(s._replace(budget=b._replace(operator=0)))

    def _operator(self, s: State) -> Iterator[tuple[str, State]]:
        x, jm, d = self.x, s.jm, s.driver
        if not jm.up:
            return
        gap = s.ghost._replace(operator_gap=True)
        if x.operator == "restore_older" and jm.status == RUNNING and jm.commit is None:
            latest = s.store[-1].epoch if s.store else -1
            for i, ck in enumerate(s.store):
                if ck.epoch < latest:
                    ns = s._replace(store=s.store[: i + 1], ghost=gap, log=(), changes=frozenset(), gen=s.gen + 1)
                    yield (
                        f"OPERATOR restores the older checkpoint at epoch {ck.epoch}",
                        self._failover(ns, "operator restore"),
                    )
        if x.operator == "cancel_resubmit" and d.done > 0:
            # The job is cancelled, the driver's application resubmits it: the new job starts
            # from empty state with no checkpoints, and the driver restarts.
            ns = s._replace(store=(), ghost=gap, log=(), changes=frozenset(), gen=s.gen + 1)
            ns = self._failover(ns, "cancelled and resubmitted", empty=True)
            ns = ns._replace(jm=ns.jm._replace(lineage=(), committed=-1))
            nd = Driver(query=d.query, done=d.done, incarnation=d.incarnation + 1, returned_total=d.returned_total)
            yield "OPERATOR cancels the job; the driver resubmits it", self._begin(ns, nd)
        if x.operator == "rescale" and jm.status == RUNNING and jm.pending is None and jm.commit is None:
            # A rescale takes a checkpoint, then redeploys at the new parallelism.
            ns = self._trigger(s)
            ns = ns._replace(jm=ns.jm._replace(pending=ns.jm.pending._replace(rescale=True)))  # type: ignore[union-attr]  # _trigger just started one
            yield "OPERATOR rescales to parallelism 1 (checkpoint, then redeploy)", ns
        if x.operator == "new_query" and d.query == Q1 and d.done > 0:
            nd = Driver(query=Q2, done=0, incarnation=d.incarnation + 1, returned_total=d.returned_total)
            yield "USER starts the query again from a new checkpointLocation (new query at batch 0)", self._begin(s, nd)

    # -- normalization ------------------------------------------------------------------------
    def _live_aids(self, s: State) -> set[Aid]:
        """Attempts whose writes may still be applied: running, or named by a commit anywhere."""
        d, jm = s.driver, s.jm
        live = {a.aid for a in d.attempts}
        live.update(aid for _, aid, _ in d.winners)
        if jm.commit is not None:
            live.update(aid for _, aid, _ in jm.commit.winners)
        for m in s.net:
            if isinstance(m, CommitRequest):
                live.update(aid for _, aid, _ in m.winners)
            elif isinstance(m, Prepare):
                live.update(aid for _, aid, _ in m.counts)
            elif isinstance(m, Apply):
                live.update(aid for _, aid in m.winners)
        return live

    def normalize(self, s: State) -> State:
        """Drop what can no longer change anything (see the module docstring): answers to
        abandoned calls, dead sessions, aborted commits and checkpoints, and the writes (in
        flight or staged) of attempts no commit can ever name: only a winner's staged writes
        are ever read (by Prepare's ledger check and by Apply)."""
        live = self._live_aids(s)
        keep = []
        changed = False
        for m in s.net:
            if self._garbage(s, m, live):
                changed = True
            else:
                keep.append(m)
        if changed:
            s = s._replace(net=frozenset(keep))
        if self.x.overlapped:
            s = self._collect_changelog(s)
        for t, tm in enumerate(s.tms):
            if any(e[2] not in live for x in tm.slots for e in x.staged):
                slots = tuple(x._replace(staged=tuple(e for e in x.staged if e[2] in live)) for x in tm.slots)
                s = self._tm(s, t, tm._replace(slots=slots))
        return s

    def _collect_changelog(self, s: State) -> State:
        """The changelog's cleaner, and what nothing reads any more: records and change sets of
        epochs a completed checkpoint holds (restores start above the latest one; an operator's
        older restore starts a new generation), and change sets no decision names and no commit
        in progress can name (a refused or aborted Prepare's)."""
        floor = s.store[-1].epoch if s.store else -1
        jm = s.jm
        named = {(e[0], e[5]) for e in s.log if e[2] == DECIDED}
        named |= {(m.epoch, m.version) for m in s.net if isinstance(m, DecisionWrite) and m.gen == s.gen}
        if jm.up and jm.commit is not None:
            named.add((jm.commit.epoch, jm.commit.version))
        log = tuple(e for e in s.log if e[0] > floor)
        changes = frozenset(cs for cs in s.changes if cs[0] > floor and (cs[0], cs[1]) in named)
        if log != s.log or changes != s.changes:
            s = s._replace(log=log, changes=changes)
        return s

    def _garbage(self, s: State, m: Message, live: set[Aid]) -> bool:
        d, jm = s.driver, s.jm
        if isinstance(m, TO_DRIVER):
            if d.phase in (FINISHED, STOPPED):
                return True
            if isinstance(m, StageAck):
                return d.phase != RUN or not any(a.aid == m.aid for a in d.attempts)
            key = (d.incarnation, d.query, d.done)
            if (m.inc, m.query, m.batch) != key:
                return True
            if isinstance(m, BeginAnswer):
                return d.phase != BEGIN
            return d.phase not in (COMMIT, DURABLE)
        if isinstance(m, Stage):
            return m.aid not in live
        if isinstance(m, (PrepareAnswer, ApplyAnswer, BarrierAck, Released, Deployed, DecisionWritten)):
            if not jm.up or m.session != jm.session:
                return True
            if isinstance(m, DecisionWritten):
                c = jm.commit
                return c is None or not c.deciding or (c.epoch, c.version) != (m.epoch, m.version)
            if isinstance(m, PrepareAnswer):
                c = jm.commit
                return (
                    c is None
                    or c.applying
                    or c.deciding
                    or (c.epoch, c.version) != (m.epoch, m.version)
                    or m.kg in c.answered
                    or m.counts != self._prepare_msg(jm, c, m.kg).counts
                )
            if isinstance(m, ApplyAnswer):
                c = jm.commit
                return (
                    c is None
                    or not c.applying
                    or (c.epoch, c.version) != (m.epoch, m.version)
                    or m.kg in c.answered
                    or m.winners != self._apply_msg(jm, c, m.kg).winners
                )
            if isinstance(m, BarrierAck):
                pc = jm.pending
                return (
                    pc is None or (pc.epoch, pc.version) != (m.epoch, m.version) or any(a.kg == m.kg for a in pc.acks)
                )
            if isinstance(m, Released):
                return m.version != jm.version or m.tm not in jm.unfenced
            return m.version != jm.version or not jm.restoring or m.kg in jm.deployed
        if isinstance(m, Prepare):
            # A prepare only reads the slot and answers: garbage once its commit is over.
            c = jm.commit
            return (
                not jm.up
                or m.session != jm.session
                or c is None
                or c.applying
                or c.deciding
                or m.kg in c.answered
                or m != self._prepare_msg(jm, c, m.kg)
            )
        if isinstance(m, Barrier):
            # A barrier only produces an ack: garbage once its checkpoint is over.
            pc = jm.pending
            return pc is None or (pc.epoch, pc.version) != (m.epoch, m.version)
        return False

    # -- invariants ---------------------------------------------------------------------------
    def _slot_problem(self, committed: int, applied: tuple[int, ...], data: Data) -> tuple[str, str] | None:
        """What is wrong with one slot's (or one snapshot's) applied writes, if anything."""
        key = (committed, applied, data)
        if key not in self._slot_verdicts:  # the same contents recur in many states
            self._slot_verdicts[key] = self._check_slot(committed, applied, data)
        return self._slot_verdicts[key]

    def _check_slot(self, committed: int, applied: tuple[int, ...], data: Data) -> tuple[str, str] | None:
        if applied != tuple(range(committed + 1)):
            return CONTIGUITY, f"committed epoch {committed} reached by applying epochs {list(applied)}"
        by_epoch: dict[int, list[tuple[str, int, int]]] = {e: [] for e in applied}
        for e, q, b, p in data:
            by_epoch[e].append((q, b, p))
        offsets: dict[str, int] = {}
        seen: set[tuple[str, int]] = set()
        for e in applied:
            items = by_epoch[e]
            parts = [p for _, _, p in items]
            if len(parts) != len(set(parts)):
                return LOST_OR_DOUBLED, f"epoch {e} holds a write twice: {sorted(items)}"
            if set(parts) != set(self.partitions):
                missing = sorted(set(self.partitions) - set(parts))
                return WINNERS_ONLY, f"epoch {e} committed without the winners' writes of partitions {missing}"
            batches = {(q, b) for q, b, _ in items}
            if len(batches) != 1:
                return WINNERS_ONLY, f"epoch {e} holds writes of several batches {sorted(batches)}"
            ((q, b),) = batches
            if (q, b) in seen:
                return LOST_OR_DOUBLED, f"batch {q}#{b} applied twice (again as epoch {e})"
            seen.add((q, b))
            if offsets.setdefault(q, e - b) != e - b:
                return LOST_OR_DOUBLED, f"batch {q}#{b} applied as epoch {e}, over a gap in {q}'s batches"
        for q in offsets:
            bs = sorted(b for qq, b in seen if qq == q)
            if bs != list(range(len(bs))):
                return LOST_OR_DOUBLED, f"{q}'s batches {bs} applied over a gap (batches missing before them)"
        return None

    def servers(self, s: State, kg: int) -> list[int]:
        """The TaskManagers whose slot would answer a state call for key group `kg` now."""
        return [t for t, tm in enumerate(s.tms) if tm.slot(kg) is not None and self._serving(tm)]

    def violation(self, s: State) -> Violation | None:
        """The first invariant of the document `s` violates, or None."""
        for v in self._violations(s):
            if v.invariant not in self.ignore:
                return v
        return None

    def _violations(self, s: State) -> Iterator[Violation]:
        g = s.ghost
        if g.bad_return is not None:
            q, b = g.bad_return
            held = "no completed checkpoint nor decision" if self.x.overlapped else "no completed checkpoint"
            yield Violation(DURABILITY, f"the driver returned from {q}#{b} while {held} held it")
        if g.stale_answer is not None:
            yield Violation(ONE_OWNER, g.stale_answer)
        if g.stale_read is not None:
            yield Violation(READS_SEE_PREVIOUS, g.stale_read)
        for t, tm in enumerate(s.tms):
            for slot in tm.slots:
                bad = self._slot_problem(slot.committed, slot.applied, slot.data)
                if bad:
                    yield Violation(bad[0], f"tm{t} slot kg{slot.kg}: {bad[1]}")
        for ck in s.store:
            epochs = {x.committed for x in ck.snapshots}
            if epochs != {ck.epoch}:
                yield Violation(
                    CONSISTENT_CUT, f"completed checkpoint says epoch {ck.epoch}, its snapshots hold {sorted(epochs)}"
                )
            for x in ck.snapshots:
                bad = self._slot_problem(x.committed, x.applied, x.data)
                if bad:
                    yield Violation(bad[0], f"completed checkpoint (epoch {ck.epoch}) kg{x.kg}: {bad[1]}")
        for kg in self.kgs:
            owners = self.servers(s, kg)
            if len(owners) > 1:
                yield Violation(ONE_OWNER, f"key group {kg} served by tm{owners[0]} and tm{owners[1]} at once")
        if self.x.overlapped and not g.operator_gap and g.returned:
            # A slot may lag behind the decided epochs (the apply is asynchronous, and reads wait
            # for it: invariant 7); what must hold every returned batch is what a restore would
            # deploy now: the latest checkpoint and the decisions above it.
            for kg, snap in sorted(self._recovered(s).items()):
                bad = self._slot_problem(snap.committed, snap.applied, snap.data)
                if bad:
                    yield Violation(bad[0], f"a restore now (kg{kg}): {bad[1]}")
                have = {(q, b) for _, q, b, _ in snap.data}
                missing = sorted(g.returned - have)
                if missing:
                    yield Violation(LOST_OR_DOUBLED, f"a restore now (kg{kg}) would lack returned batches {missing}")
        elif not g.operator_gap and g.returned:
            if s.store:
                for kg, _, _, data in s.store[-1].snapshots:
                    have = {(q, b) for _, q, b, _ in data}
                    missing = sorted(g.returned - have)
                    if missing:
                        yield Violation(
                            LOST_OR_DOUBLED,
                            f"the latest completed checkpoint (kg{kg}) lacks returned batches {missing}",
                        )
            for kg in self.kgs:
                owners = self.servers(s, kg)
                if len(owners) == 1:
                    owned = s.tms[owners[0]].slot(kg)
                    have = {(q, b) for _, q, b, _ in owned.data}  # type: ignore[union-attr]  # one owner serves the slot
                    missing = sorted(g.returned - have)
                    if missing:
                        yield Violation(LOST_OR_DOUBLED, f"kg{kg} on tm{owners[0]} lacks returned batches {missing}")

    def goal(self, s: State) -> bool:
        """An intended end: every batch done, or the query refused after an operator action."""
        d = s.driver
        if d.phase == FINISHED:
            return True
        return d.phase == STOPPED and d.stop_reason == "EpochGapError" and s.ghost.operator_gap

    def describe(self, s: State) -> str:
        """A compact picture of a state for counterexample traces."""
        d, jm = s.driver, s.jm
        parts = [
            f"driver {d.query}#{d.done} {d.phase}{' ' + d.stop_reason if d.stop_reason else ''}"
            f" returned {sorted(s.ghost.returned)}"
        ]
        if jm.up:
            parts.append(
                f"jobmanager {jm.status} C={jm.committed} v={jm.version[0]}.{jm.version[1]} assign {list(jm.assign)}"
            )
        else:
            parts.append("jobmanager down")
        for t, tm in enumerate(s.tms):
            if not tm.up:
                parts.append(f"tm{t} down")
                continue
            slots = ", ".join(f"kg{x.kg}@v{x.version[0]}.{x.version[1]} E={x.committed}" for x in tm.slots)
            parts.append(f"tm{t}{' CUT' if tm.cut else ''}{'' if tm.lease else ' lease-expired'} [{slots}]")
        parts.append(f"checkpoints {[ck.epoch for ck in s.store]}")
        if self.x.overlapped:
            parts.append(f"changelog g{s.gen} {[f'{e[0]}.{e[1]} {e[2]} {e[3]}#{e[4]}' for e in s.log]}")
        return "; ".join(parts)
