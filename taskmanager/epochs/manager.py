"""Exactly-once epoch transactions on a TaskManager: routing epoch-scoped calls, commits and aborts.

Every write a Spark task makes with an ``EpochContext`` is staged per slot under its
(epoch, partition, attempt). When the driver knows which attempt of each partition won, the
JobManager sends ``CommitEpoch(job, epoch, winners)`` to every TaskManager of the job: each slot
applies the winners' staged writes in one atomic ``backend.apply`` that also records the
committed epoch, and discards everything else staged up to that epoch. A commit of an epoch
already committed is a no-op, so a retried commit (or a re-run micro-batch) never applies twice,
and writes for an epoch already committed are refused.

A commit is atomic per slot, not across slots: if one slot fails, the slots before it stay
committed and a retried commit applies the rest.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from keyedstate.common.batches import Winner
from keyedstate.common.changesets import ChangeSetFile
from keyedstate.common.errors import InvalidArgumentError, NotFoundError, Reason, UnavailableError
from keyedstate.common.faults import crash_point
from keyedstate.common.ids import JobId, SubtaskId, validate_id
from keyedstate.taskmanager.changelog.change_sets import ChangeSetStore
from keyedstate.taskmanager.epochs.attempt import TaskAttempt
from keyedstate.taskmanager.epochs.slot import ChangeSetUpload, SlotEpochs
from keyedstate.taskmanager.epochs.staging import STAGING_DIR, StagingOptions
from keyedstate.taskmanager.epochs.transaction import EpochTransaction
from keyedstate.taskmanager.slots import Slot, SlotTable
from keyedstate.taskmanager.state.mutation import Mutation

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommitResult:
    committed_epoch: int
    """The lowest committed epoch over the job's slots here (every slot has committed at least it)."""
    applied: int
    """Mutations applied, over all slots."""
    slots: int


class AttemptContext(Protocol):
    """Who is calling inside an epoch: the fields of the wire's ``EpochContext``."""

    @property
    def epoch(self) -> int: ...
    @property
    def partition(self) -> int: ...
    @property
    def attempt(self) -> int: ...
    @property
    def sequence(self) -> int: ...


def as_winners(winners: Mapping[int, int | Winner]) -> dict[int, Winner]:
    """Accept ``{partition: attempt}`` (no ledgers) as well as ``{partition: Winner}``."""
    return {p: w if isinstance(w, Winner) else Winner(p, w) for p, w in winners.items()}


class EpochManager:
    """The epoch layer of one TaskManager: one :class:`SlotEpochs` per deployed slot.

    Staging belongs to one deployment of a slot. When the slot is released or redeployed
    (restore, rescale) its staged writes are dropped: found stale on the next call for the same
    subtask, and swept on every commit.
    """

    def __init__(
        self,
        slots: SlotTable,
        instance_dir: Callable[[SubtaskId], Path],
        options: StagingOptions | None = None,
        change_sets: ChangeSetStore | None = None,
    ) -> None:
        """``change_sets`` writes the change sets of overlapped commits (None: Prepare refuses to)."""
        self._slots = slots
        self._change_sets = change_sets
        self._instance_dir = instance_dir
        self._options = options
        self._entries: dict[SubtaskId, SlotEpochs] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- staging calls ------------------------------------------------------------------------
    def view(self, slot: Slot, context: AttemptContext | TaskAttempt, fence_wait_s: float = 0.0) -> EpochTransaction:
        """The state calls of the task attempt ``context`` on ``slot`` (writes staged, reads merged).

        On a slot that commits overlapped (it wrote a change set at a Prepare), the read fence
        holds the call until the slot holds the previous epoch, up to ``fence_wait_s``
        (:meth:`SlotEpochs.await_previous_epoch`). A synchronous commit applies an epoch before
        the driver returns, so there the fence never waits and is not applied: a stale call keeps
        its old answer (staged, never committed).
        """
        entry = self.slot_epochs(slot)
        if entry.overlapped and context.epoch - 1 > entry.committed_epoch:
            entry.await_previous_epoch(context.epoch, fence_wait_s)
        if isinstance(context, TaskAttempt):
            return EpochTransaction(entry, context)
        attempt = TaskAttempt(context.epoch, context.partition, context.attempt)
        return EpochTransaction(entry, attempt, context.sequence)

    def slot_epochs(self, slot: Slot) -> SlotEpochs:
        """The epoch state of a running slot (created on first use)."""
        backend = slot.require_backend()
        with self._lock:
            if self._closed:
                raise UnavailableError(
                    "the TaskManager is shutting down; retry against the new owner", reason=Reason.SHUTTING_DOWN
                )
            entry = self._entries.get(slot.subtask)
            if entry is not None and entry.slot is slot and entry.backend is backend:
                return entry
            if entry is not None:
                # The subtask was redeployed: the old deployment's staging is not this one's.
                del self._entries[slot.subtask]
                entry.close()
            self._sweep_locked()
            entry = SlotEpochs(
                slot, backend, self._instance_dir(slot.subtask) / STAGING_DIR, self._options, changelog=slot.changelog
            )
            self._entries[slot.subtask] = entry
            return entry

    # -- commits ------------------------------------------------------------------------------
    def _job_slots(self, job_id: JobId, epoch: int) -> list[Slot]:
        validate_id("job id", job_id)
        if epoch < 0:
            raise InvalidArgumentError(f"epoch must be >= 0 (the job epoch of the micro-batch), got {epoch}")
        slots = sorted(self._slots.of_job(job_id), key=lambda s: s.subtask)
        if not slots:
            raise NotFoundError(
                f"this TaskManager hosts no slot of job {job_id!r}; send the commit to the TaskManagers of the job's "
                "current routing table",
                reason=Reason.UNKNOWN_JOB,
            )
        return slots

    def prepare_epoch(
        self,
        job_id: JobId,
        epoch: int,
        winners: Mapping[int, int | Winner],
        routing_version: int = 0,
        *,
        upload_change_set: bool = False,
    ) -> list[ChangeSetFile]:
        """Check on every slot of the job that ``epoch`` can be committed (see :meth:`SlotEpochs.check_commit`).

        ``upload_change_set`` (overlapped commits): each slot also writes its change set of the
        epoch to checkpoint storage; the files written, durable when this returns.
        """
        slots = self._job_slots(job_id, epoch)
        resolved = as_winners(winners)
        if upload_change_set and self._change_sets is None:
            raise InvalidArgumentError("this TaskManager cannot write change sets (no checkpoint storage configured)")
        written: list[ChangeSetFile] = []
        for slot in slots:
            upload = self._uploader(slot) if upload_change_set else None
            ref = self.slot_epochs(slot).prepare(epoch, resolved, routing_version, upload)
            if ref is not None:
                written.append(ref)
        if upload_change_set:
            crash_point("taskmanager.epoch.change-set-written")
        return written

    def _uploader(self, slot: Slot) -> ChangeSetUpload:
        store = self._change_sets
        assert store is not None
        backend = slot.require_backend()

        def upload(epoch: int, timestamp_ms: int, mutations: Sequence[Mutation]) -> ChangeSetFile:
            return store.upload(
                slot.checkpoint_base,
                slot.subtask,
                slot.routing_version,
                epoch,
                timestamp_ms,
                mutations,
                backend.max_parallelism,
            )

        return upload

    def commit_epoch(
        self,
        job_id: JobId,
        epoch: int,
        winners: Mapping[int, int | Winner],
        *,
        abort: bool = False,
        routing_version: int = 0,
    ) -> CommitResult:
        """Apply the staged writes of ``winners`` (partition -> attempt or Winner) of ``epoch`` on every slot of the job.

        Every slot is checked before any applies, so a refusal on this TaskManager applies
        nothing here; the JobManager's prepare round makes that hold across TaskManagers.
        """
        slots = self._job_slots(job_id, epoch)
        resolved = as_winners(winners)
        self.sweep()
        if not abort:
            for slot in slots:
                self.slot_epochs(slot).prepare(epoch, resolved, routing_version)
            crash_point("taskmanager.epoch.before-commit")
        committed: list[int] = []
        applied = 0
        for slot in slots:
            entry = self.slot_epochs(slot)
            if abort:
                committed.append(entry.abort(epoch))
            else:
                c, n = entry.commit(epoch, resolved, routing_version)
                committed.append(c)
                applied += n
        result = CommitResult(min(committed), applied, len(slots))
        if not abort:
            crash_point("taskmanager.epoch.committed")
        logger.info(
            "%s epoch %d of job %s on %d slots: committed epoch %d, %d mutations applied",
            "aborted" if abort else "committed",
            epoch,
            job_id,
            len(slots),
            result.committed_epoch,
            applied,
        )
        return result

    # -- lifecycle ----------------------------------------------------------------------------
    def sweep(self) -> int:
        """Drop the staging of slots no longer deployed here; returns how many were dropped."""
        with self._lock:
            return self._sweep_locked()

    def _sweep_locked(self) -> int:
        current = {s.subtask: s for s in self._slots.all()}
        stale = [
            subtask
            for subtask, entry in self._entries.items()
            if current.get(subtask) is not entry.slot or entry.backend.closed
        ]
        for subtask in stale:
            self._entries.pop(subtask).close()
        return len(stale)

    def close(self) -> None:
        """Drop every slot's staging (the TaskManager stops). Idempotent."""
        with self._lock:
            self._closed = True
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            try:
                entry.close()
            except Exception:
                logger.exception("dropping the epoch staging of %s failed", entry.subtask)
