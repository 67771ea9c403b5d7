"""Decision records of overlapped commits: the create-only commit point of an epoch, and restores' seals.

In ``execution.checkpointing.commit-mode: overlapped`` (docs/exactly-once.md, "Overlapped
commits") an epoch is part of the job's history once its *decision* exists in checkpoint
storage. The layout, under the job's checkpoint directory::

    changelog/<E>/v<version>-<operator>-<subtask>       change sets (written by the slots at Prepare)
    changelog/[g<generation>/]<E>.<n>/_decision          decisions and seals of epoch E, n = 0, 1, ...

Generation 0 (a job never restored by an operator) has no ``g`` component. Every record is
written with the storage's create-only primitive (the one ``_metadata`` uses), at the first
``n`` not taken for ``E``; a writer that loses the race for a name does not move on to the next
one: a decision that loses to a seal is refused for good (the batch runs again), and a restore
that loses a seal to a decision replays that decision and seals the epoch after it.

The decision a restore takes for ``E`` is the first DECIDED record by ``n`` whose routing
version is at least that of every seal before it: a leader that was deposed while it was alive
(not only dead) could list the epoch after a new leader sealed it and write at the next name;
its routing version is below the seal's (versions of a recovered job start above the new HA
session), so its decision is never replayed.
"""

from __future__ import annotations

import enum
import json
import logging
import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from keyedstate.common.batches import Winner
from keyedstate.common.changesets import CHANGELOG_DIR, ChangeSetFile
from keyedstate.common.errors import CorruptCheckpointError, EpochConflictError, InvalidArgumentError, KeyedStateError
from keyedstate.common.storage import CheckpointStorage
from keyedstate.jobmanager.checkpoint import _paths

logger = logging.getLogger(__name__)

DECISION_FILE = "_decision"
FORMAT_VERSION = 1
_RECORD_NAME = re.compile(r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$")
_GENERATION_NAME = re.compile(r"^g([1-9][0-9]*)$")
_EPOCH_NAME = re.compile(r"^(0|[1-9][0-9]*)$")


class RecordKind(enum.Enum):
    """What a record at ``<E>.<n>`` is."""

    DECIDED = "DECIDED"
    SEALED = "SEALED"


@dataclass(frozen=True)
class Decision:
    """The commit point of epoch ``epoch``: batch ``batch_id`` of ``query_id``, its winners and change sets."""

    epoch: int
    query_id: str
    batch_id: int
    routing_version: int
    winners: tuple[tuple[int, int], ...]
    """``(partition, attempt)`` of each winning attempt, partitions ascending."""
    change_sets: tuple[ChangeSetFile, ...]
    n: int = field(default=-1, compare=False)
    """The name's number it was found at (-1 before it is written)."""

    @classmethod
    def of(
        cls,
        epoch: int,
        query_id: str,
        batch_id: int,
        routing_version: int,
        winners: Iterable[Winner],
        change_sets: Iterable[ChangeSetFile],
    ) -> Decision:
        """A decision from the commit's winners (ledgers are not recorded: they were checked at Prepare)."""
        return cls(
            epoch,
            query_id,
            batch_id,
            routing_version,
            tuple(sorted((w.partition, w.attempt) for w in winners)),
            tuple(sorted(change_sets, key=lambda c: (c.operator_id, c.subtask_index))),
        )

    def to_bytes(self) -> bytes:
        return _dump(
            {
                "kind": RecordKind.DECIDED.value,
                "epoch": self.epoch,
                "query_id": self.query_id,
                "batch_id": self.batch_id,
                "routing_version": self.routing_version,
                "winners": [list(w) for w in self.winners],
                "change_sets": [_change_set_dict(c) for c in self.change_sets],
            }
        )


@dataclass(frozen=True)
class Seal:
    """A restore's claim on epoch ``epoch``: no decision written after it by an older deployment counts."""

    epoch: int
    routing_version: int
    n: int = field(default=-1, compare=False)

    def to_bytes(self) -> bytes:
        return _dump({"kind": RecordKind.SEALED.value, "epoch": self.epoch, "routing_version": self.routing_version})


Record = Decision | Seal


class DecisionRaceError(EpochConflictError):
    """The decision's name was taken (a restore sealed the epoch, or another writer decided it): nothing was decided."""


def _dump(body: dict[str, Any]) -> bytes:
    return json.dumps({"format_version": FORMAT_VERSION, **body}, sort_keys=True, separators=(",", ":")).encode()


def _change_set_dict(c: ChangeSetFile) -> dict[str, Any]:
    return {
        "path": c.path,
        "operator_id": c.operator_id,
        "subtask_index": c.subtask_index,
        "size": c.size,
        "sha256": c.sha256,
    }


def parse_record(data: bytes, source: str) -> Record:
    """A decision or seal from its bytes; CorruptCheckpointError naming ``source`` if it is not one."""
    try:
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        version = raw["format_version"]
        if version != FORMAT_VERSION:
            raise CorruptCheckpointError(
                f"{source} has decision format version {version}, this runtime reads version {FORMAT_VERSION}; "
                "restore it with the runtime version that wrote it"
            )
        kind = RecordKind(raw["kind"])
        epoch, version_ = int(raw["epoch"]), int(raw["routing_version"])
        if kind is RecordKind.SEALED:
            return Seal(epoch, version_)
        return Decision(
            epoch,
            str(raw["query_id"]),
            int(raw["batch_id"]),
            version_,
            tuple((int(p), int(a)) for p, a in raw["winners"]),
            tuple(
                ChangeSetFile(
                    epoch,
                    str(c["operator_id"]),
                    int(c["subtask_index"]),
                    str(c["path"]),
                    int(c["size"]),
                    str(c["sha256"]),
                )
                for c in raw["change_sets"]
            ),
        )
    except CorruptCheckpointError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(
            f"{source} is not a decision record ({exc!r}); restore from a checkpoint at or above its epoch, or "
            "delete the changelog directory to drop the decided epochs above the latest checkpoint"
        ) from exc


class DecisionLog:
    """The decisions and seals of one changelog generation of one job, in checkpoint storage.

    ``job_dir`` is the job's checkpoint directory (``state.checkpoints.dir/<job-id>``). Every
    method does its own I/O and holds no state between calls: several JobManagers (a deposed
    leader, its successor) may use the same log at once, and only create-only writes decide.
    """

    def __init__(self, storage: CheckpointStorage, job_dir: str, generation: int = 0) -> None:
        if generation < 0:
            raise InvalidArgumentError(f"a changelog generation is 0 or more, got {generation}")
        self.storage = storage
        self.job_dir = job_dir
        self.generation = generation
        base = _paths.join(job_dir, CHANGELOG_DIR)
        self.root = base
        self.directory = _paths.join(base, f"g{generation}") if generation else base

    def __repr__(self) -> str:
        return f"DecisionLog({self.directory})"

    def _record_path(self, epoch: int, n: int) -> str:
        return _paths.join(self.directory, f"{epoch}.{n}", DECISION_FILE)

    def names(self) -> dict[int, list[int]]:
        """The record numbers ``n`` taken per epoch, ascending (one listing)."""
        out: dict[int, list[int]] = {}
        for info in self.storage.list(self.directory):
            match = _RECORD_NAME.match(_paths.name(info.path))
            if match is not None:
                out.setdefault(int(match.group(1)), []).append(int(match.group(2)))
        return {e: sorted(ns) for e, ns in sorted(out.items())}

    def read(self, epoch: int, n: int) -> Record | None:
        """The record at ``<epoch>.<n>``; None when the name holds no record yet (a write in flight, a torn prefix)."""
        path = self._record_path(epoch, n)
        try:
            data = self.storage.read_bytes(path)
        except FileNotFoundError:
            return None
        record = parse_record(data, path)
        if record.epoch != epoch:
            raise CorruptCheckpointError(
                f"{path} holds a record of epoch {record.epoch}; it was moved or tampered with"
            )
        if isinstance(record, Seal):
            return Seal(record.epoch, record.routing_version, n)
        return Decision(
            record.epoch,
            record.query_id,
            record.batch_id,
            record.routing_version,
            record.winners,
            record.change_sets,
            n,
        )

    def records(self, epoch: int, taken: Sequence[int] | None = None) -> list[Record]:
        """Every record of ``epoch`` by ``n`` (``taken``: the numbers from :meth:`names`, else listed now)."""
        numbers = self.names().get(epoch, []) if taken is None else taken
        return [r for r in (self.read(epoch, n) for n in numbers) if r is not None]

    def decision(self, epoch: int, taken: Sequence[int] | None = None) -> Decision | None:
        """The decision a restore takes for ``epoch`` (see the module docstring), or None."""
        return _decision_of(self.records(epoch, taken))

    def _first_free(self, epoch: int) -> int:
        return _first_free(self.records(epoch))

    def decide(self, decision: Decision) -> Decision:
        """Write ``decision`` create-only at the first free name of its epoch; the decision as written (with ``n``).

        Raises :class:`DecisionRaceError` when the name was taken meanwhile (a restore's seal, or
        another writer): the epoch is then not decided by this call, and the batch must run again.
        Storage failures propagate; a decision whose write failed with an error may still have
        landed, which is why a restore seals the epoch after the last one it replays.
        """
        if decision.epoch < 0:
            raise InvalidArgumentError(f"a decision needs an epoch >= 0, got {decision.epoch}")
        n = self._first_free(decision.epoch)
        path = self._record_path(decision.epoch, n)
        try:
            self.storage.create_exclusive(path, decision.to_bytes())
        except FileExistsError as exc:
            raise DecisionRaceError(
                f"epoch {decision.epoch} (batch {decision.batch_id} of query {decision.query_id}) was not decided: "
                f"{path} was written by another JobManager or sealed by a restore meanwhile; run the batch again"
            ) from exc
        logger.info("%s: decided epoch %d at n=%d (routing v%d)", self, decision.epoch, n, decision.routing_version)
        return Decision(
            decision.epoch,
            decision.query_id,
            decision.batch_id,
            decision.routing_version,
            decision.winners,
            decision.change_sets,
            n,
        )

    def continuation(self, committed_epoch: int, routing_version: int) -> list[Decision]:
        """A restore's decided epochs above ``committed_epoch``, in order, and the seal after the last.

        For ``E = committed_epoch + 1, ...`` it takes the decision of ``E`` and stops at the first
        epoch without one, which it seals (create-only, at the first free name, carrying
        ``routing_version``, the version the restore deploys). If a decision write in flight wins
        that name, the epoch is decided after all: it is taken and the next one sealed instead.
        """
        out: list[Decision] = []
        names = self.names()
        epoch = committed_epoch + 1
        while True:
            records = self.records(epoch, names.get(epoch, []))
            decision = _decision_of(records)
            if decision is not None:
                out.append(decision)
                epoch += 1
                continue
            # The seal goes to the first name that held no record when the epoch showed no
            # decision: a record landing since then may be a decision, which must be read before
            # anything is sealed (and a listed name without a record yet is a write in flight,
            # which the seal may still beat).
            n = _first_free(records)
            try:
                self.storage.create_exclusive(self._record_path(epoch, n), Seal(epoch, routing_version).to_bytes())
            except FileExistsError:
                names = self.names()  # something landed at that name: look at the epoch again
                continue
            logger.info(
                "%s: restore at epoch %d replays %d decided epoch(s), sealed epoch %d at n=%d (routing v%d)",
                self,
                committed_epoch,
                len(out),
                epoch,
                n,
                routing_version,
            )
            return out

    def collect_covered(self, retained_epochs: Collection[int]) -> int:
        """:meth:`collect_garbage` through the oldest retained checkpoint's epoch (``retained_epochs``: the
        epochs of the retained checkpoints); 0 with none retained. Every retained checkpoint covers those
        epochs, so a restore of any of them never replays them."""
        return self.collect_garbage(min(retained_epochs)) if retained_epochs else 0

    def collect_after_checkpoint(self, retained_epochs: Collection[int]) -> int:
        """:meth:`collect_covered` after a checkpoint completed; a storage failure is logged, not raised.

        What it fails to delete now, the next completed checkpoint's collection deletes: nothing
        reads the covered records again, so leaving them a while costs only storage.
        """
        try:
            return self.collect_covered(retained_epochs)
        except (KeyedStateError, OSError):
            logger.warning(
                "%r: deleting covered changelog files failed; retried after the next checkpoint", self, exc_info=True
            )
            return 0

    def collect_garbage(self, through_epoch: int) -> int:
        """Delete change sets and records of epochs up to ``through_epoch`` and every older generation's
        records; how many directories were deleted. A completed checkpoint at or above that epoch covers them.
        """
        deleted = 0
        for info in self.storage.list(self.root):
            name = _paths.name(info.path)
            record = _RECORD_NAME.match(name)
            epoch_dir = _EPOCH_NAME.match(name)
            generation = _GENERATION_NAME.match(name)
            stale = (
                (epoch_dir is not None and int(name) <= through_epoch)
                or (generation is not None and int(generation.group(1)) < self.generation)
                or (record is not None and (self.generation > 0 or int(record.group(1)) <= through_epoch))
            )
            if stale:
                self.storage.delete_dir(info.path)
                deleted += 1
        if self.generation:
            for info in self.storage.list(self.directory):
                record = _RECORD_NAME.match(_paths.name(info.path))
                if record is not None and int(record.group(1)) <= through_epoch:
                    self.storage.delete_dir(info.path)
                    deleted += 1
        if deleted:
            logger.info("%s: deleted %d changelog directories through epoch %d", self, deleted, through_epoch)
        return deleted


def _decision_of(records: Sequence[Record]) -> Decision | None:
    """The first decision by ``n`` whose routing version is not below a seal before it."""
    floor = 0
    for record in records:
        if isinstance(record, Seal):
            floor = max(floor, record.routing_version)
        elif record.routing_version >= floor:
            return record
        else:
            logger.warning(
                "the decision of epoch %d at n=%d (routing v%d) was written after a seal of v%d by a deposed "
                "deployment; it is not replayed",
                record.epoch,
                record.n,
                record.routing_version,
                floor,
            )
    return None


def _first_free(records: Sequence[Record]) -> int:
    """The first ``n`` holding no record (a name listed without one is a write in flight, or a torn one)."""
    numbers = {r.n for r in records}
    n = 0
    while n in numbers:
        n += 1
    return n


def next_generation(storage: CheckpointStorage, job_dir: str, above: int = 0) -> int:
    """A changelog generation no record of ``job_dir`` uses yet (a new job, or an operator restore).

    Generation 0 is the ``changelog/`` directory itself, so the first new one is 1 whenever it holds
    any record; numbers only grow. ``above``: the job's current generation, which may hold no record
    yet while one is being written (a decision in flight), so the new one is above it too.
    """
    root = _paths.join(job_dir, CHANGELOG_DIR)
    highest = above
    for info in storage.list(root):
        generation = _GENERATION_NAME.match(_paths.name(info.path))
        if generation is not None:
            highest = max(highest, int(generation.group(1)))
    return highest + 1
