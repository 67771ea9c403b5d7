"""The epoch transactions of one slot: its staging store, committed epoch, locks, commit and abort."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import rocksdict

from keyedstate.common.batches import Winner
from keyedstate.common.changesets import ChangeSetFile
from keyedstate.common.errors import (
    EpochConflictError,
    EpochGapError,
    InvalidArgumentError,
    KeyedStateError,
    Reason,
    UnavailableError,
)
from keyedstate.taskmanager.changelog import SlotChangelog, pinned_clock
from keyedstate.taskmanager.epochs import records
from keyedstate.taskmanager.epochs.attempt import TaskAttempt
from keyedstate.taskmanager.epochs.fast_commit import commit_fast
from keyedstate.taskmanager.epochs.fold import fold_attempt
from keyedstate.taskmanager.epochs.locks import SharedExclusiveLock
from keyedstate.taskmanager.epochs.staging import StagingOptions, StagingStore
from keyedstate.taskmanager.slots import Slot
from keyedstate.taskmanager.state import KeyedStateBackend
from keyedstate.taskmanager.state.metadata import COMMITTED_EPOCH
from keyedstate.taskmanager.state.mutation import Mutation

logger = logging.getLogger(__name__)

NO_EPOCH = -1
_ATTEMPT_LOCK_STRIPES = 16


class ChangeSetUpload(Protocol):
    """Writes one slot's change set of ``epoch`` (its mutations, applied at ``timestamp_ms``) durably."""

    def __call__(self, epoch: int, timestamp_ms: int, mutations: Sequence[Mutation]) -> ChangeSetFile: ...


class EpochCommitError(KeyedStateError):
    """Applying an epoch's staged writes failed on a slot; nothing of the epoch was applied there.

    The reason is the cause's (a size limit, storage, ...). The staged writes are kept, so the
    commit can be retried; abort the epoch to discard them.
    """

    def __init__(self, message: str, *, reason: Reason) -> None:
        super().__init__(message, reason=reason)


def read_committed_epoch(backend: KeyedStateBackend) -> int:
    """The slot's committed epoch (kept for callers of the epoch package; see ``KeyedStateBackend.committed_epoch``)."""
    return backend.committed_epoch()


class Stager:
    """Stages one write request: reads through :attr:`store`, one atomic :meth:`write` with its marker."""

    def __init__(self, store: StagingStore, marker: bytes | None) -> None:
        self.store = store
        self._marker = marker

    def write(self, batch: rocksdict.WriteBatch) -> None:
        """Stage ``batch`` and the request's marker in one atomic write."""
        if self._marker is not None:
            batch.put(self._marker, b"")
        self.store.write(batch)


class SlotEpochs:
    """Epoch state of one deployed slot (one backend instance).

    Staging calls hold :attr:`lock` shared and a commit holds it exclusively, so a commit never
    sees half a staged batch and a write racing a commit either lands before it (and is then
    applied or discarded by it) or is refused after it. Writes of one attempt are serialized,
    because some (reduce, list append) read what the attempt staged before writing; attempts
    stage different keys, so different attempts write in parallel.

    With a ``changelog`` (``state.changelog.enabled``) each commit's staged records are folded into
    the change set's mutations and appended to the slot's changelog before they are applied.

    ``fast_commit`` (on by default) applies a commit's staged records as staged
    (:func:`.fast_commit.commit_fast`, every state kind, both backends); off, every commit takes
    the general path that folds them into Mutations and validates them again (:mod:`.fold`, the
    reference the differential test compares the fast path with).
    """

    def __init__(
        self,
        slot: Slot,
        backend: KeyedStateBackend,
        path: Path,
        options: StagingOptions | None = None,
        *,
        fast_commit: bool = True,
        changelog: SlotChangelog | None = None,
    ) -> None:
        self.slot = slot
        self._fast_commit = fast_commit
        self.changelog = changelog
        self.backend = backend
        self.subtask = slot.subtask
        self.path = path
        self.lock = SharedExclusiveLock()
        self._options = options
        self._open_lock = threading.Lock()
        self._attempt_locks = [threading.Lock() for _ in range(_ATTEMPT_LOCK_STRIPES)]
        self._store: StagingStore | None = None
        self._closed = False
        descriptors = backend.descriptors()
        if len(descriptors) > records.MAX_STATES:
            raise InvalidArgumentError(
                f"{self.subtask} declares {len(descriptors)} states; epoch transactions support at most {records.MAX_STATES}"
            )
        self.state_ids = {d.name: i for i, d in enumerate(descriptors)}
        self.states = [(d.name, d.kind.storage_kind) for d in descriptors]
        self.committed_epoch = read_committed_epoch(backend)
        self._prepared_stamp: tuple[int, int, int] | None = None
        """(epoch, routing version, timestamp) of the last change set uploaded at Prepare."""
        self._applied = threading.Condition()

    def __repr__(self) -> str:
        return f"SlotEpochs({self.subtask}, committed_epoch={self.committed_epoch})"

    @property
    def store(self) -> StagingStore | None:
        """The staging store, None until the slot's first staged write."""
        return self._store

    def _check_open(self) -> None:
        if self._closed:
            raise UnavailableError(
                f"{self.subtask} was released from this TaskManager; refresh the routing table and retry",
                reason=Reason.SHUTTING_DOWN,
            )

    def _check_epoch(self, attempt: TaskAttempt) -> None:
        if attempt.epoch <= self.committed_epoch:
            raise EpochConflictError(
                f"{attempt} writes to {self.subtask}, which has already committed epoch {self.committed_epoch}; the write is "
                "refused because this task attempt is stale (a zombie, or a re-run of a committed micro-batch) and its "
                "result must not be applied twice"
            )

    @property
    def overlapped(self) -> bool:
        """Whether this deployment of the slot commits overlapped (it wrote a change set at a Prepare)."""
        return self._prepared_stamp is not None

    def await_previous_epoch(self, epoch: int, timeout_s: float) -> None:
        """The read fence: return once the slot holds ``epoch - 1`` (or later), waiting up to ``timeout_s``.

        With overlapped commits a task of epoch ``E`` may reach the slot before the apply of
        ``E - 1`` (the driver returned on the decision); serving it earlier would read state
        without the previous batch. Raises UnavailableError (reason EPOCH_NOT_APPLIED, the client
        retries it within its retry policy) when the apply does not come in time.
        """
        with self._applied:
            if self._applied.wait_for(lambda: self._closed or self.committed_epoch >= epoch - 1, max(0.0, timeout_s)):
                return
        raise UnavailableError(
            f"{self.subtask} holds epoch {self.committed_epoch}, and a call of epoch {epoch} waited {timeout_s:.1f} s for "
            f"epoch {epoch - 1} to be applied here; retry (the JobManager applies decided epochs asynchronously, or "
            "the job is restarting)",
            reason=Reason.EPOCH_NOT_APPLIED,
        )

    def _epoch_applied(self) -> None:
        with self._applied:
            self._applied.notify_all()

    @contextmanager
    def writing(self, attempt: TaskAttempt, sequence: int = 0) -> Iterator[Stager | None]:
        """Stage one write request of ``attempt``, with its other writes and commits kept out.

        Yields a :class:`Stager` (read the staged values through ``.store``, write with
        ``.write``), or None when request ``sequence`` of this attempt was staged before: a
        retried request whose first answer was lost, which must not be staged twice.
        """
        if sequence < 0:
            raise InvalidArgumentError(f"EpochContext.sequence must be 0 or more, got {sequence}")
        with self.lock.shared():
            self._check_open()
            self._check_epoch(attempt)
            store = self._store
            if store is None:
                with self._open_lock:
                    if self._store is None:
                        self._store = StagingStore(self.path, str(self.subtask), self._options)
                    store = self._store
            with self._attempt_locks[hash((attempt.partition, attempt.attempt)) % _ATTEMPT_LOCK_STRIPES]:
                marker = records.request_marker(attempt.prefix, sequence) if sequence else None
                if marker is not None and store.get([marker])[0] is not None:
                    logger.debug(
                        "%s: request %d of %s was staged before; not staged again", self.subtask, sequence, attempt
                    )
                    yield None
                    return
                yield Stager(store, marker)

    @contextmanager
    def reading(self) -> Iterator[StagingStore | None]:
        """The store to read staged writes from (None: nothing was ever staged), commits kept out."""
        with self.lock.shared():
            self._check_open()
            yield self._store

    def staged_requests(self, epoch: int, partition: int, attempt: int) -> int:
        """How many distinct write requests of the attempt were staged here."""
        store = self._store
        if store is None:
            return 0
        return sum(1 for _ in store.scan(*records.attempt_markers_range(epoch, partition, attempt)))

    # -- commit -------------------------------------------------------------------------------
    def check_commit(self, epoch: int, winners: Mapping[int, Winner], routing_version: int) -> bool:
        """Whether ``epoch`` can be applied here; False if it already is. Raises why it cannot.

        The slot must be the deployment of ``routing_version``, hold exactly ``epoch - 1``
        (epochs are contiguous), and have staged exactly the write requests each winner's
        ledger says this slot acknowledged. Call with :attr:`lock` held.
        """
        self._check_open()
        if routing_version <= 0:
            raise InvalidArgumentError(
                f"the commit of epoch {epoch} names no routing version; a commit must carry the routing version the "
                "batch ran under"
            )
        if routing_version != self.slot.routing_version:
            raise EpochConflictError(
                f"{self.subtask} is deployed under routing version {self.slot.routing_version}, the commit of epoch {epoch} "
                f"is for version {routing_version}: the job was redeployed while the batch ran; run it again"
            )
        committed = read_committed_epoch(self.backend)
        self.committed_epoch = committed
        if committed == epoch:
            return False
        if committed > epoch:
            raise EpochConflictError(
                f"{self.subtask} already holds epoch {committed}; epoch {epoch} is stale and must not be applied again"
            )
        if committed != epoch - 1:
            raise EpochGapError(
                f"{self.subtask} holds epoch {committed}, so epoch {epoch} cannot be applied on top of it: epochs "
                f"{committed + 1}..{epoch - 1} are missing from its state (an older checkpoint was restored?)"
            )
        op, index = self.subtask.operator_id, self.subtask.subtask_index
        for w in winners.values():
            expected = w.expected_requests(op, index)
            if expected is None:
                continue
            staged = self.staged_requests(epoch, w.partition, w.attempt)
            if staged != expected:
                raise EpochConflictError(
                    f"partition {w.partition} attempt {w.attempt} of epoch {epoch} had {expected} write request(s) "
                    f"acknowledged by {self.subtask}, but {staged} are staged here: its writes did not all reach this "
                    "slot (routed to an old owner, or lost with a restarted slot); the batch must run again"
                )
        return True

    def prepare(
        self,
        epoch: int,
        winners: Mapping[int, Winner],
        routing_version: int,
        upload: ChangeSetUpload | None = None,
    ) -> ChangeSetFile | None:
        """Check that :meth:`commit` would apply ``epoch`` (or find it applied); apply nothing.

        With ``upload`` (overlapped commits) the winners' staged operations of the epoch are
        folded into the mutations the commit will apply and handed to ``upload`` with the
        commit's timestamp; the file it wrote is returned once durable. The commit of the epoch
        then applies at that same timestamp, so a replay of the file reproduces it (TTL stamps too).
        """
        with self.lock.exclusive():
            applicable = self.check_commit(epoch, winners, routing_version)
            if upload is None:
                return None
            if not applicable:
                raise EpochConflictError(
                    f"{self.subtask} already holds epoch {epoch}, so it has no staged writes of it to write a change set "
                    "from; the job restored meanwhile: run the batch again"
                )
            staged = self._winning_records(epoch, winners)
            mutations = [m for attempt_records in staged for m in fold_attempt(attempt_records, self.states)]
            try:
                # Once decided the epoch must apply: a limit its apply would meet (a list grown
                # past state.limits.list.max-elements) refuses the Prepare, before any decision.
                self.backend.check_applicable(mutations)
            except KeyedStateError as exc:
                raise EpochCommitError(
                    f"epoch {epoch} cannot be applied on {self.subtask}, so it is not prepared: {exc.message}. "
                    "Fix the cause, then run the micro-batch again",
                    reason=exc.reason,
                ) from exc
            stamp = self.backend.clock.now_ms()
            written = upload(epoch, stamp, mutations)
            self._prepared_stamp = (epoch, routing_version, stamp)
            return written

    def commit(self, epoch: int, winners: Mapping[int, Winner], routing_version: int = 0) -> tuple[int, int]:
        """Apply the winners' staged writes of ``epoch`` atomically; (committed epoch, mutations applied).

        ``winners`` maps partition -> winning attempt. Everything else staged for epochs up to
        ``epoch`` is discarded. An epoch already applied changes nothing; one that does not
        follow the slot's epoch, or whose winners' ledgers do not match, is refused
        (:meth:`check_commit`).
        """
        with self.lock.exclusive():
            if not self.check_commit(epoch, winners, routing_version):
                logger.info("epoch %d of %s is already committed; nothing to apply", epoch, self.subtask)
                self._discard(*records.through_epoch(epoch))
                return epoch, 0
            t0 = self.backend.clock.monotonic_ms()  # the slot's injected clock
            prepared = self._prepared_stamp
            stamp = prepared[2] if prepared is not None and prepared[:2] == (epoch, routing_version) else None
            try:
                if stamp is None:
                    applied = self._apply_winners(epoch, winners)
                else:
                    # The change set this slot uploaded at Prepare carries this timestamp.
                    with pinned_clock(self.backend, stamp):
                        applied = self._apply_winners(epoch, winners, stamp)
            except KeyedStateError as exc:
                logger.error(
                    "commit of epoch %d on %s failed (%s): %s", epoch, self.subtask, exc.reason.value, exc.message
                )
                raise EpochCommitError(
                    f"commit of epoch {epoch} on {self.subtask} failed, nothing of it was applied there: {exc.message}. "
                    "Its staged writes are kept: fix the cause and commit again, or abort the epoch and re-run the micro-batch",
                    reason=exc.reason,
                ) from exc
            self.committed_epoch = epoch
            self._epoch_applied()
            self._discard(*records.through_epoch(epoch))
            logger.info(
                "committed epoch %d on %s: %d mutations from %d winning attempts in %.0f ms",
                epoch,
                self.subtask,
                applied,
                len(winners),
                self.backend.clock.monotonic_ms() - t0,
            )
            return epoch, applied

    def _apply_winners(self, epoch: int, winners: Mapping[int, Winner], stamp: int | None = None) -> int:
        """Apply the winners' staged records with the committed-epoch marker in one atomic write; mutations applied.

        ``stamp``: the commit's time fixed at its Prepare (overlapped commits), which the changelog records too.
        """
        meta = {COMMITTED_EPOCH: str(epoch).encode("ascii")}
        staged = self._winning_records(epoch, winners)
        if self.changelog is not None:
            # The change set is durable in the log before any of it reaches the backend, and it
            # applies at the logged timestamp, so a replay reproduces the commit (TTL stamps too).
            logged = [m for attempt_records in staged for m in fold_attempt(attempt_records, self.states)]
            with self.changelog.lock:
                # An overlapped commit logs the time its Prepare's change set carries: a restore then
                # stamps TTL alike whether it replays the segment or the decided change set.
                stamp = self.changelog.append(epoch, logged, stamp)
                try:
                    with pinned_clock(self.backend, stamp):
                        # The fast path writes the same bytes as applying the logged mutations (the
                        # differential test holds them equal), which is what a replay does.
                        applied = commit_fast(self.backend, self.states, staged, meta) if self._fast_commit else None
                        return applied if applied is not None else self.backend.apply(logged, meta=meta)
                except BaseException:
                    self.changelog.retract(epoch)  # nothing of it was applied; a retried commit logs it again
                    raise
        if self._fast_commit:
            applied = commit_fast(self.backend, self.states, staged, meta)
            if applied is not None:
                return applied
        mutations = [m for attempt_records in staged for m in fold_attempt(attempt_records, self.states)]
        return self.backend.apply(mutations, meta=meta)

    def _winning_records(self, epoch: int, winners: Mapping[int, Winner]) -> list[list[tuple[bytes, bytes]]]:
        """The staged records of each winner, partitions ascending (two partitions writing one key apply in a
        deterministic order), each in staging order."""
        store = self._store
        if store is None:
            return []
        return [
            store.read_range(*records.attempt_data_range(epoch, partition, winners[partition].attempt))
            for partition in sorted(winners)
        ]

    def abort(self, epoch: int) -> int:
        """Discard everything staged for ``epoch``; returns the committed epoch."""
        with self.lock.exclusive():
            self._check_open()
            if self._store is not None:
                self._store.delete_range(*records.one_epoch(epoch))
            logger.info("aborted epoch %d on %s (committed epoch %d)", epoch, self.subtask, self.committed_epoch)
            return self.committed_epoch

    def _discard(self, begin: bytes, end: bytes) -> None:
        if self._store is None:
            return
        try:
            self._store.delete_range(begin, end)
        except KeyedStateError:
            # Harmless: epochs up to the committed one are refused and never applied again.
            logger.exception(
                "discarding staged epochs of %s failed; they stay on disk until the slot is released", self.subtask
            )

    def close(self) -> None:
        """Drop the staging data (slot released or restored, TaskManager stopping). Idempotent."""
        with self.lock.exclusive():
            if self._closed:
                return
            self._closed = True
            store, self._store = self._store, None
        self._epoch_applied()  # fenced calls stop waiting and find the slot released
        if store is not None:
            store.close(drop=True)
            logger.info("dropped the epoch staging of %s", self.subtask)
