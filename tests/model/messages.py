"""The messages of the model: one frozen type per RPC request or answer of docs/exactly-once.md.

A message names its receiver and carries everything its handler reads, so that the network is
a plain set of values. Answers to the JobManager carry its HA session (`session`): an answer
addressed to a dead leader is dropped, as the call it answers died with that process.
"""

from __future__ import annotations

from dataclasses import dataclass

Version = tuple[int, int]
"""A routing version: (JobManager HA session, deployment counter), unique across restarts."""

Aid = tuple[int, int, int]
"""A task attempt id: (driver incarnation, run of the batch, attempt number of the partition)."""

Entry = tuple[int, str, int, int]
"""One applied write in a slot's backend: (epoch, query, batch, partition); the key group is the slot's."""

Data = tuple[Entry, ...]
"""A slot's backend: the sorted multiset of its applied writes."""

Lineage = tuple[tuple[str, int], ...]
"""The epoch lineage: bindings (query, offset); batch b of query q is epoch b + offset_q."""

Counts = tuple[tuple[int, Aid, int], ...]
"""Per winner: (partition, attempt, how many write requests this slot acknowledged) (the ledger)."""

Winners = tuple[tuple[int, Aid], ...]
"""Per partition, the attempt Spark kept."""


def _v(v: Version) -> str:
    return f"{v[0]}.{v[1]}"


def _a(aid: Aid) -> str:
    return f"a{aid[0]}.{aid[1]}.{aid[2]}"


@dataclass(frozen=True, slots=True)
class Message:
    """Base of every message; `kind` names the RPC in traces and in the fault menus."""

    @property
    def kind(self) -> str:
        return type(self).__name__


# -- driver <-> JobManager ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BeginBatch(Message):
    inc: int
    query: str
    batch: int

    def __str__(self) -> str:
        return f"BeginBatch({self.query}#{self.batch}, driver {self.inc})"


@dataclass(frozen=True, slots=True)
class BeginAnswer(Message):
    """`verdict`: RUN, DURABLE (E <= C), WAIT (job restarting), REFUSED (EpochGapError)."""

    inc: int
    query: str
    batch: int
    verdict: str
    epoch: int
    version: Version
    routing: tuple[int, ...]

    def __str__(self) -> str:
        return f"BeginAnswer({self.query}#{self.batch}: {self.verdict} E={self.epoch} v={_v(self.version)})"


@dataclass(frozen=True, slots=True)
class CommitRequest(Message):
    inc: int
    query: str
    batch: int
    epoch: int
    version: Version
    winners: tuple[tuple[int, Aid, tuple[tuple[int, int], ...]], ...]  # (partition, attempt, ((kg, acked),...))

    def __str__(self) -> str:
        ws = ",".join(f"p{p}:{_a(a)}" for p, a, _ in self.winners)
        return f"Commit({self.query}#{self.batch} E={self.epoch} v={_v(self.version)} winners {ws})"


@dataclass(frozen=True, slots=True)
class DurableRequest(Message):
    """The re-run of a batch whose epoch is already committed: only wait for its checkpoint."""

    inc: int
    query: str
    batch: int
    epoch: int

    def __str__(self) -> str:
        return f"Durable({self.query}#{self.batch} E={self.epoch})"


@dataclass(frozen=True, slots=True)
class BatchAnswer(Message):
    """`status`: COMPLETED (a checkpoint holds epoch >= E), CHECKPOINT_FAILED (the epoch is
    committed but no checkpoint holds it yet), RETRY (nothing applied: run the batch again),
    JOB_RESTARTING (a job-state error: the job is failing over), REFUSED (EpochGapError)."""

    inc: int
    query: str
    batch: int
    status: str
    epoch: int

    def __str__(self) -> str:
        return f"BatchAnswer({self.query}#{self.batch}: {self.status} epoch {self.epoch})"


# -- executor <-> TaskManager -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stage(Message):
    tm: int
    kg: int
    epoch: int
    query: str
    batch: int
    partition: int
    aid: Aid
    seq: int
    version: Version

    def __str__(self) -> str:
        return f"Stage(E={self.epoch} p{self.partition} {_a(self.aid)} seq {self.seq} kg{self.kg} v={_v(self.version)} -> tm{self.tm})"


@dataclass(frozen=True, slots=True)
class StageAck(Message):
    tm: int
    kg: int
    aid: Aid
    seq: int
    ok: bool

    def __str__(self) -> str:
        return f"StageAck({_a(self.aid)} seq {self.seq} from tm{self.tm}: {'ok' if self.ok else 'refused'})"


# -- JobManager <-> TaskManager ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Prepare(Message):
    session: int
    tm: int
    kg: int
    epoch: int
    version: Version
    counts: Counts

    def __str__(self) -> str:
        return f"Prepare(E={self.epoch} v={_v(self.version)} kg{self.kg} -> tm{self.tm})"


@dataclass(frozen=True, slots=True)
class PrepareAnswer(Message):
    session: int
    tm: int
    kg: int
    epoch: int
    version: Version
    counts: Counts
    ok: bool

    def __str__(self) -> str:
        return f"PrepareAnswer(E={self.epoch} kg{self.kg} from tm{self.tm}: {'ok' if self.ok else 'refused'})"


@dataclass(frozen=True, slots=True)
class Apply(Message):
    session: int
    tm: int
    kg: int
    epoch: int
    version: Version
    winners: Winners

    def __str__(self) -> str:
        return f"Apply(E={self.epoch} v={_v(self.version)} kg{self.kg} -> tm{self.tm})"


@dataclass(frozen=True, slots=True)
class ApplyAnswer(Message):
    session: int
    tm: int
    kg: int
    epoch: int
    version: Version
    winners: Winners
    ok: bool

    def __str__(self) -> str:
        return f"ApplyAnswer(E={self.epoch} kg{self.kg} from tm{self.tm}: {'ok' if self.ok else 'refused'})"


@dataclass(frozen=True, slots=True)
class Barrier(Message):
    session: int
    tm: int
    kg: int
    epoch: int
    version: Version

    def __str__(self) -> str:
        return f"Barrier(epoch {self.epoch} v={_v(self.version)} kg{self.kg} -> tm{self.tm})"


@dataclass(frozen=True, slots=True)
class BarrierAck(Message):
    session: int
    tm: int
    kg: int
    epoch: int
    version: Version
    ok: bool
    committed: int
    applied: tuple[int, ...]
    data: Data
    leased: bool = True
    """False: refused because the TaskManager holds no lease (not a decline that counts)."""

    def __str__(self) -> str:
        verdict = f"snapshot at epoch {self.committed}" if self.ok else "declined" if self.leased else "no lease"
        return f"BarrierAck(epoch {self.epoch} kg{self.kg} from tm{self.tm}: {verdict})"


@dataclass(frozen=True, slots=True)
class Release(Message):
    """Release every slot of the job deployed under a version older than `version`."""

    session: int
    tm: int
    version: Version

    def __str__(self) -> str:
        return f"Release(below v={_v(self.version)} -> tm{self.tm})"


@dataclass(frozen=True, slots=True)
class Released(Message):
    session: int
    tm: int
    version: Version

    def __str__(self) -> str:
        return f"Released(tm{self.tm} below v={_v(self.version)})"


@dataclass(frozen=True, slots=True)
class Deploy(Message):
    session: int
    tm: int
    kg: int
    version: Version
    committed: int
    applied: tuple[int, ...]
    data: Data

    def __str__(self) -> str:
        return f"Deploy(kg{self.kg} v={_v(self.version)} at epoch {self.committed} -> tm{self.tm})"


@dataclass(frozen=True, slots=True)
class Deployed(Message):
    session: int
    tm: int
    kg: int
    version: Version
    committed: int

    def __str__(self) -> str:
        return f"Deployed(kg{self.kg} v={_v(self.version)} on tm{self.tm} at epoch {self.committed})"


@dataclass(frozen=True, slots=True)
class Register(Message):
    tm: int

    def __str__(self) -> str:
        return f"Register(tm{self.tm})"


@dataclass(frozen=True, slots=True)
class Registered(Message):
    """The registration answer; the TaskManager may keep only slots of routing version `version`
    or newer (the JobManager's current deployment), and releases the others first."""

    session: int
    tm: int
    version: Version

    def __str__(self) -> str:
        return f"Registered(tm{self.tm} with session {self.session}, keeps slots of v={_v(self.version)})"


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    tm: int

    def __str__(self) -> str:
        return f"Heartbeat(tm{self.tm})"


@dataclass(frozen=True, slots=True)
class HeartbeatAnswer(Message):
    session: int
    tm: int
    known: bool

    def __str__(self) -> str:
        return f"HeartbeatAnswer(tm{self.tm}: {'known' if self.known else 'unknown'})"


# -- JobManager <-> checkpoint storage (overlapped commits) -------------------------------------


@dataclass(frozen=True, slots=True)
class DecisionWrite(Message):
    """The create-only write of epoch `epoch`'s decision record at `changelog/g<gen>/<epoch>.<n>`.

    It travels to storage on its own: a storage request outlives the JobManager that sent it
    (a crash or a failover does not recall it)."""

    session: int
    gen: int
    epoch: int
    n: int
    query: str
    batch: int
    version: Version

    def __str__(self) -> str:
        return (
            f"DecisionWrite(g{self.gen} E={self.epoch}.{self.n}: {self.query}#{self.batch} v={_v(self.version)}, "
            f"session {self.session})"
        )


@dataclass(frozen=True, slots=True)
class DecisionWritten(Message):
    """Storage's answer: `ok` False when the name was taken (by a seal or another decision)."""

    session: int
    epoch: int
    version: Version
    ok: bool

    def __str__(self) -> str:
        return f"DecisionWritten(E={self.epoch} v={_v(self.version)}: {'ok' if self.ok else 'name taken'})"


TO_JOBMANAGER = (
    BeginBatch,
    CommitRequest,
    DurableRequest,
    PrepareAnswer,
    ApplyAnswer,
    BarrierAck,
    Released,
    Deployed,
    Register,
    Heartbeat,
    DecisionWritten,
)
"""Messages a JobManager receives; a JobManager crash loses every one of them in flight."""

JM_TM = (
    Prepare,
    PrepareAnswer,
    Apply,
    ApplyAnswer,
    Barrier,
    BarrierAck,
    Release,
    Released,
    Deploy,
    Deployed,
    Register,
    Registered,
    Heartbeat,
    HeartbeatAnswer,
)
"""Messages between the JobManager and a TaskManager: the ones a cut-off TaskManager loses."""

TO_TASKMANAGER = (Stage, Prepare, Apply, Barrier, Release, Deploy, Registered, HeartbeatAnswer)
"""Messages a TaskManager receives; a crash loses them (the new process has new connections)."""

TO_DRIVER = (BeginAnswer, BatchAnswer, StageAck)
"""Messages the driver or its executors receive."""

TO_STORAGE = (DecisionWrite,)
"""Messages checkpoint storage receives; it never crashes (it is the durable party)."""
