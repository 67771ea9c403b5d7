"""Checkpoints and restores on the TaskManager side.

On a barrier each slot of the job takes the synchronous part of its snapshot (a RocksDB native
checkpoint of hard links, or a consistent copy of a HashMap) and hands the rest to a worker:
upload, then acknowledge to the JobManager (or decline with the reason). Serving continues
while the upload runs. The bytes are moved by :class:`FileMover` objects the TaskManager's assembly
chooses: by default its low-priority transfer processes (``transfer_process.py``) for
checkpoints, so an upload does not share the serving process's GIL, and a transfer process at
the TaskManager's own priority for restores, which are on the recovery's critical path.

Where files go (``base`` = ``<state.checkpoints.dir>/<job-id>``, ``target`` = ``base/chk-<n>``):

* incremental checkpoint, RocksDB: SST files not uploaded before go to
  ``base/shared/chk-<n>/<operator>-<subtask>-<uuid>-<name>``; SST files that the last *completed*
  checkpoint already uploaded are referenced again, not uploaded; everything else (MANIFEST,
  CURRENT, OPTIONS, the snapshot manifest) goes to ``target/<operator>-<subtask>/``.
* full checkpoint: every file goes to ``target/<operator>-<subtask>/``.
* savepoint: every file goes under the savepoint directory, so it is self-contained.
* changelog checkpoint (``state.changelog.enabled``, :mod:`.changelog`): the sealed segments no
  completed checkpoint holds go to ``base/shared/chk-<n>/``; the materialization referenced is a
  background one in ``base/shared/mat-<id>/``, or the slot's first checkpoint's own snapshot,
  every file of it in ``base/shared/chk-<n>/``.

Handle paths are relative to the directory that will hold ``_metadata``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from keyedstate.common.clock import Clock
from keyedstate.common.errors import (
    CorruptCheckpointError,
    EpochConflictError,
    InvalidArgumentError,
    KeyedStateError,
    SizeLimitError,
)
from keyedstate.common.faults import crash_point
from keyedstate.common.handles import (
    ChangelogSegmentHandle,
    CheckpointBarrier,
    DeclineReason,
    SlotRestore,
    StateFileHandle,
    SubtaskStateHandle,
)
from keyedstate.common.ids import CheckpointId, JobId, KeyGroupRange, OperatorId, SubtaskId, validate_id
from keyedstate.common.retry import RetryPolicy
from keyedstate.common.storage import StorageCache, is_plain_file_name
from keyedstate.taskmanager.backends import BackendFactory
from keyedstate.taskmanager.deployment import DeployResult
from keyedstate.taskmanager.metrics import TaskManagerMetrics
from keyedstate.taskmanager.slots import Slot, SlotTable
from keyedstate.taskmanager.snapshot.changelog import (
    ChangelogCheckpoints,
    ChangelogCut,
    LocalSegment,
    Materialization,
    replay_changelog,
)
from keyedstate.taskmanager.snapshot.mover import FileMover
from keyedstate.taskmanager.snapshot.transfer import TransferStats, sha256_file
from keyedstate.taskmanager.state import KeyedStateBackend, LocalSnapshot

logger = logging.getLogger(__name__)

_LOCAL_SNAPSHOTS = "snapshots"
_MATERIALIZER_TICK_S = 0.1
_MATERIALIZE_RETRY = RetryPolicy(initial_backoff_s=1.0, max_backoff_s=60.0, jitter=0.0)
"""Backoff between failed materializations of a slot (at most its interval)."""
_RESTORE_DIR = "restore"


def _join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts]])


def shared_group(checkpoint_id: CheckpointId) -> str:
    """The sub-directory of ``shared/`` holding the files checkpoint ``checkpoint_id`` uploaded first."""
    return f"chk-{checkpoint_id}"


class CheckpointReporter(Protocol):
    """Where a slot's checkpoint outcome goes: the JobManager, through the TaskManager's RPC edge.

    Both calls retry transient failures themselves and raise when the outcome stays unknown.
    """

    def acknowledge_checkpoint(self, job_id: JobId, checkpoint_id: CheckpointId, state: SubtaskStateHandle) -> None:
        """Report one slot's uploaded snapshot of ``checkpoint_id``."""

    def decline_checkpoint(
        self,
        job_id: JobId,
        checkpoint_id: CheckpointId,
        subtask: SubtaskId,
        reason: str,
        kind: DeclineReason = DeclineReason.SNAPSHOT_FAILED,
    ) -> None:
        """Report that ``subtask`` cannot complete ``checkpoint_id``, and why (shown to the operator)."""

    def report_task_failure(self, subtask: SubtaskId, routing_version: int, cause: str) -> None:
        """Report that ``subtask`` failed while running (its materializations kept failing): its job fails over."""


class StateSizeLimitExceeded(SizeLimitError):
    """A slot's snapshot is larger than the JobManager checkpoint storage takes inline."""


_PlannedUpload = tuple[str, str, str, bool]
"""(local path, remote url, path relative to the checkpoint directory, shared)"""


@dataclass
class _SlotCheckpoint:
    """One slot's part of one in-flight checkpoint."""

    slot: Slot
    checkpoint_id: CheckpointId
    local_dir: Path
    target_path: str = ""
    """Where this checkpoint's own (non-shared) files go: ``<job dir>/chk-<n>`` or the savepoint dir."""
    cancel: threading.Event = field(default_factory=threading.Event)
    # local SST name -> handle (relative path from a chk dir) uploaded by this checkpoint
    new_shared: dict[str, StateFileHandle] = field(default_factory=dict)
    referenced_shared: dict[str, StateFileHandle] = field(default_factory=dict)
    uploaded_remote: list[str] = field(default_factory=list)
    done: bool = False
    acknowledged: bool = False
    """The ack was sent (its outcome may be unknown): the uploaded files are the JobManager's to delete."""
    savepoint: bool = False
    inline: bool = False
    """The files go inline to the JobManager (its memory holds the checkpoint): nothing is uploaded."""
    changelog: ChangelogCut | None = None
    """A changelog slot's checkpoint: the materialization and segments it may reference."""
    materialization: Materialization | None = None
    """The materialization the acknowledged handle references (its own snapshot's, or an earlier one)."""
    new_segments: dict[Path, ChangelogSegmentHandle] = field(default_factory=dict)


class SnapshotManager:
    """Runs slot snapshots for barriers and restores slots from checkpoint storage."""

    def __init__(
        self,
        slots: SlotTable,
        backends: BackendFactory,
        reporter: CheckpointReporter,
        storages: StorageCache,
        transfers: FileMover,
        restore_transfers: FileMover,
        metrics: TaskManagerMetrics,
        clock: Clock,
        *,
        transfer_threads: int,
        local_recovery: bool,
    ) -> None:
        self._slots = slots
        self._backends = backends
        self._reporter = reporter
        self._storages = storages
        self._transfers = transfers
        self._restore_transfers = restore_transfers
        self._metrics = metrics
        self._clock = clock
        self._threads = transfer_threads
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="snapshot-async")
        self._inflight: dict[tuple[JobId, CheckpointId], list[_SlotCheckpoint]] = {}
        self._changelogs: dict[SubtaskId, ChangelogCheckpoints] = {}
        self._closing = threading.Event()
        self._materializer: threading.Thread | None = None
        self._lock = threading.Lock()
        self.stats = TransferStats()
        self.local_recovery = local_recovery

    # -- checkpoints -------------------------------------------------------------------------
    def trigger(self, barrier: CheckpointBarrier) -> int:
        """Take the synchronous part for every slot of the job and start the uploads."""
        if barrier.checkpoint_id <= 0 or not barrier.target_path:
            raise InvalidArgumentError("a checkpoint barrier needs a positive checkpoint_id and a target_path")
        crash_point("taskmanager.checkpoint.barrier")
        key = (barrier.job_id, barrier.checkpoint_id)
        with self._lock:
            running = self._inflight.get(key)
            if running is not None:
                # A duplicate barrier (a retried trigger): starting again would delete the local
                # snapshot the first one is still uploading. Like a duplicate ack, it is not an error.
                logger.info(
                    "checkpoint %d of job %s: duplicate barrier ignored, %d slots already snapshotting",
                    barrier.checkpoint_id,
                    barrier.job_id,
                    len(running),
                )
                return len(running)
            self._inflight[key] = []
        try:
            return self._start(barrier, key)
        except BaseException:
            with self._lock:
                if not self._inflight.get(key, True):
                    del self._inflight[key]  # refused before any slot started
            raise

    def _start(self, barrier: CheckpointBarrier, key: tuple[JobId, CheckpointId]) -> int:
        slots = self._slots.of_job(barrier.job_id)
        for slot in slots:
            # The cut must be consistent: every slot of the job holds the epoch the barrier names.
            held = slot.require_backend().committed_epoch()
            if held != barrier.epoch:
                raise EpochConflictError(
                    f"{slot.subtask} holds epoch {held}, but the barrier of checkpoint {barrier.checkpoint_id} was cut at "
                    f"epoch {barrier.epoch}; the checkpoint cannot be consistent and is refused"
                )
        started: list[_SlotCheckpoint] = []
        with self._lock:
            self._inflight[key] = started  # filled as slots start, so a notify in between sees them
        for slot in slots:
            backend = slot.require_backend()
            local_dir = self._backends.instance_dir(slot.subtask) / _LOCAL_SNAPSHOTS / _local_name(barrier)
            if local_dir.exists():
                shutil.rmtree(local_dir)
            local_dir.parent.mkdir(parents=True, exist_ok=True)
            t0 = self._clock.monotonic_ms()
            cut: ChangelogCut | None = None
            snapshot: LocalSnapshot | None
            log = slot.changelog
            if log is not None and not barrier.savepoint and barrier.inline_max_state_size <= 0:
                # A savepoint is self-contained (a full snapshot, no changelog), as in Flink.
                with log.lock:
                    held = backend.committed_epoch()
                    if held != barrier.epoch:
                        raise EpochConflictError(
                            f"{slot.subtask} committed epoch {held} while the barrier of checkpoint "
                            f"{barrier.checkpoint_id} (epoch {barrier.epoch}) arrived; the checkpoint is refused"
                        )
                    cut = self.changelog_of(slot).cut(barrier.epoch)
                    snapshot = backend.snapshot(local_dir) if cut.materializes else None
            else:
                snapshot = backend.snapshot(local_dir)
            sync_ms = float(self._clock.monotonic_ms() - t0)
            work = _SlotCheckpoint(
                slot,
                barrier.checkpoint_id,
                local_dir,
                barrier.target_path,
                savepoint=barrier.savepoint,
                inline=barrier.inline_max_state_size > 0,
                changelog=cut,
            )
            started.append(work)
            self._pool.submit(self._run_async, work, snapshot, barrier, sync_ms)
        if not started:
            with self._lock:
                if self._inflight.get(key) is started:
                    del self._inflight[key]  # nothing to track (no slot of the job here)
        logger.info(
            "checkpoint %d of job %s: snapshot of %d slots started", barrier.checkpoint_id, barrier.job_id, len(started)
        )
        return len(started)

    def _run_async(
        self, work: _SlotCheckpoint, snapshot: LocalSnapshot | None, barrier: CheckpointBarrier, sync_ms: float
    ) -> None:
        try:
            handle = self._finish_snapshot(work, snapshot, barrier, sync_ms)
            if handle is None:
                return
            crash_point("taskmanager.checkpoint.before-ack")
            work.acknowledged = True
            try:
                self._reporter.acknowledge_checkpoint(barrier.job_id, barrier.checkpoint_id, handle)
            except Exception as exc:
                # The outcome is unknown: the JobManager may have completed the checkpoint with
                # this ack (its answer lost or late), so nothing is deleted here. If the checkpoint
                # was aborted instead, the JobManager deletes these files (late ack, or notify).
                logger.warning(
                    "checkpoint %d of %s: acknowledgement failed, files kept: %s",
                    barrier.checkpoint_id,
                    work.slot.subtask,
                    exc.message if isinstance(exc, KeyedStateError) else repr(exc),
                )
        finally:
            work.done = True

    def _finish_snapshot(
        self, work: _SlotCheckpoint, snapshot: LocalSnapshot | None, barrier: CheckpointBarrier, sync_ms: float
    ) -> SubtaskStateHandle | None:
        """Upload; on failure decline (unless cancelled), delete what was uploaded and return None."""
        slot = work.slot
        t0 = self._clock.monotonic_ms()
        labels = (slot.subtask.job_id, slot.subtask.operator_id, str(slot.subtask.subtask_index))
        try:
            # The synchronous phase is the time the slot's writes were blocked. A RocksDB
            # snapshot pre-flushes while serving goes on and reports its (short) cut.
            if snapshot is not None and snapshot.blocked_ms is not None:
                logger.debug(
                    "checkpoint %d of %s: snapshot call %.0f ms, writes blocked %.1f ms",
                    barrier.checkpoint_id,
                    slot.subtask,
                    sync_ms,
                    snapshot.blocked_ms,
                )
                sync_ms = snapshot.blocked_ms
            self._metrics.checkpoint_sync_seconds.labels(*labels).observe(sync_ms / 1000.0)
            if work.changelog is not None:
                handle = self._upload_changelog(work, work.changelog, snapshot, barrier)
            else:
                assert snapshot is not None
                handle = self._upload(work, snapshot, barrier)
            handle.sync_duration_ms = int(sync_ms)
            handle.async_duration_ms = self._clock.monotonic_ms() - t0
            self._metrics.checkpoint_async_seconds.labels(*labels).observe(handle.async_duration_ms / 1000.0)
            self._metrics.checkpoint_bytes.labels(*labels).inc(handle.incremental_size)
            return handle
        except Exception as exc:  # every failure becomes a decline with its cause
            reason = exc.message if isinstance(exc, KeyedStateError) else repr(exc)
            if not work.cancel.is_set():
                logger.warning("checkpoint %d of %s failed: %s", barrier.checkpoint_id, slot.subtask, reason)
                kind = (
                    DeclineReason.STATE_SIZE_LIMIT_EXCEEDED
                    if isinstance(exc, StateSizeLimitExceeded)
                    else DeclineReason.SNAPSHOT_FAILED
                )
                try:
                    self._reporter.decline_checkpoint(barrier.job_id, barrier.checkpoint_id, slot.subtask, reason, kind)
                except Exception:
                    logger.warning("could not decline checkpoint %d (JobManager unreachable)", barrier.checkpoint_id)
            self._discard_uploads(work, barrier)
            return None

    def _plan_uploads(
        self, work: _SlotCheckpoint, files: list[Path], barrier: CheckpointBarrier
    ) -> tuple[list[_PlannedUpload], list[StateFileHandle], int]:
        """What to upload where, the shared files reused from the last completed checkpoint, and the full size."""
        slot = work.slot
        owner = f"{slot.subtask.operator_id}-{slot.subtask.subtask_index}"
        inline = barrier.inline_max_state_size > 0
        incremental = bool(barrier.incremental and not barrier.savepoint and not inline and slot.checkpoint_base)
        # A changelog slot's own snapshot becomes its materialization, which later checkpoints
        # reference: every file of it must be in shared/, and its SST files are reused as incremental ones are.
        share_all = work.changelog is not None
        incremental = incremental or share_all
        confirmed: dict[str, StateFileHandle] = dict(slot.uploaded_shared)
        plan: list[_PlannedUpload] = []
        reused_handles: list[StateFileHandle] = []
        full_size = 0
        for path in files:
            name = path.name
            size = path.stat().st_size
            full_size += size
            if incremental and (share_all or name.endswith(".sst")):
                reused = confirmed.get(name) if name.endswith(".sst") else None
                if reused is not None and reused.size == size:
                    reused_handles.append(
                        StateFileHandle(
                            path=reused.path, size=reused.size, sha256=reused.sha256, local_name=name, shared=True
                        )
                    )
                    work.referenced_shared[name] = reused
                    continue
                # Grouped by the checkpoint that uploads it: when that checkpoint never completes (this
                # TaskManager dies mid-upload), the JobManager deletes shared/chk-<n>/ as a whole.
                shared_name = f"{shared_group(barrier.checkpoint_id)}/{owner}-{uuid.uuid4().hex[:12]}-{name}"
                plan.append(
                    (str(path), _join(slot.checkpoint_base, "shared", shared_name), f"../shared/{shared_name}", True)
                )
            else:
                plan.append((str(path), _join(barrier.target_path, owner, name), f"{owner}/{name}", False))
        return plan, reused_handles, full_size

    def _upload(self, work: _SlotCheckpoint, snapshot: LocalSnapshot, barrier: CheckpointBarrier) -> SubtaskStateHandle:
        slot = work.slot
        files = snapshot.materialize()
        plan, handles, full_size = self._plan_uploads(work, files, barrier)
        if barrier.inline_max_state_size > 0:
            handles = self._inline(slot, plan, full_size, barrier)
            return self._state_handle(slot, snapshot, handles, full_size, full_size)
        # Recorded before uploading: when one file fails or the checkpoint is cancelled, the files
        # that did arrive are not reported back, and a discard must still delete every one of them.
        work.uploaded_remote.extend(p[1] for p in plan)
        logger.info(
            "checkpoint %d of %s: async upload of %d files (%d bytes) started",
            barrier.checkpoint_id,
            slot.subtask,
            len(plan),
            sum(os.path.getsize(p[0]) for p in plan),
        )
        uploaded = self._transfers.upload(
            barrier.target_path, [(p[0], p[1]) for p in plan], self._threads, work.cancel, self.stats
        )
        incremental_size = 0
        for (local, _remote, relative, shared), up in zip(plan, uploaded):
            name = Path(local).name
            handle = StateFileHandle(path=relative, size=up.size, sha256=up.sha256, local_name=name, shared=shared)
            handles.append(handle)
            incremental_size += up.size
            if shared:
                work.new_shared[name] = handle
        return self._state_handle(slot, snapshot, handles, incremental_size, full_size)

    # -- changelog checkpoints ---------------------------------------------------------------
    def changelog_of(self, slot: Slot) -> ChangelogCheckpoints:
        """The materializations and sealed segments of a changelog slot (created on first use)."""
        assert slot.changelog is not None
        with self._lock:
            entry = self._changelogs.get(slot.subtask)
            if entry is None or entry.log is not slot.changelog:
                # A new deployment of the subtask: its log, and what it materialized, start again.
                entry = ChangelogCheckpoints(slot.changelog)
                if slot.restored_materialization is not None:
                    entry.restored(slot.restored_materialization)
                self._changelogs[slot.subtask] = entry
            return entry

    def _upload_changelog(
        self, work: _SlotCheckpoint, cut: ChangelogCut, snapshot: LocalSnapshot | None, barrier: CheckpointBarrier
    ) -> SubtaskStateHandle:
        """Upload the segments no completed checkpoint holds (and the snapshot, when this checkpoint
        materializes); the handle names the materialization and every segment after it."""
        slot = work.slot
        uploaded_bytes = 0
        if cut.materializes:
            assert snapshot is not None
            own = self._upload(work, snapshot, barrier)
            materialization = Materialization(
                barrier.epoch, tuple(own.files), own.full_size, incremental_size=own.incremental_size
            )
            uploaded_bytes = own.incremental_size
        else:
            materialization = self._usable_materialization(slot, cut)
        work.materialization = materialization
        needed = cut.after(materialization)
        owner = f"{slot.subtask.operator_id}-{slot.subtask.subtask_index}"
        plan: list[tuple[LocalSegment, str, str]] = []
        for segment in needed:
            if segment.remote is None:
                name = (
                    f"{shared_group(barrier.checkpoint_id)}/{owner}-{uuid.uuid4().hex[:12]}-{segment.local.path.name}"
                )
                plan.append((segment, _join(slot.checkpoint_base, "shared", name), f"../shared/{name}"))
        # Recorded before uploading, as for snapshot files: a discard deletes whatever arrived.
        work.uploaded_remote.extend(remote for _, remote, _ in plan)
        crash_point("taskmanager.changelog.before-segment-upload")
        t0 = self._clock.monotonic_ms()
        try:
            uploaded = self._transfers.upload(
                barrier.target_path,
                [(str(segment.local.path), remote) for segment, remote, _ in plan],
                self._threads,
                work.cancel,
                self.stats,
            )
        except Exception:
            if not work.cancel.is_set():
                self._metrics.record_segment_upload_failure(slot.subtask.job_id, len(plan))
            raise
        self._metrics.record_segment_uploads(
            slot.subtask.job_id,
            [(up.size, segment.local.records) for (segment, _, _), up in zip(plan, uploaded)],
            (self._clock.monotonic_ms() - t0) * 1_000_000,
        )
        segment_bytes = 0
        for (segment, _remote, relative), up in zip(plan, uploaded):
            if up.size != segment.local.size:
                raise CorruptCheckpointError(
                    f"changelog segment {segment.local.path} of {slot.subtask} was sealed at {segment.local.size} "
                    f"bytes but {up.size} were uploaded; the local segment changed after it was sealed"
                )
            work.new_segments[segment.local.path] = ChangelogSegmentHandle(
                relative, segment.local.first_epoch, segment.local.last_epoch, up.size, up.sha256
            )
            segment_bytes += up.size
        uploaded_bytes += segment_bytes
        crash_point("taskmanager.changelog.segments-uploaded")
        segments = [s.remote or work.new_segments[s.local.path] for s in needed]
        self._metrics.record_changelog_checkpoint(
            _labels(slot),
            full_materialized=materialization.full_size,
            inc_materialized=materialization.incremental_size,
            full_changelog=sum(s.size for s in segments),
            inc_changelog=segment_bytes,
        )
        logger.info(
            "checkpoint %d of %s: changelog on top of the materialization of epoch %d, %d segment(s) (%d uploaded now)",
            barrier.checkpoint_id,
            slot.subtask,
            materialization.epoch,
            len(segments),
            len(plan),
        )
        return SubtaskStateHandle(
            operator_id=OperatorId(slot.subtask.operator_id),
            subtask_index=slot.subtask.subtask_index,
            key_groups=KeyGroupRange(slot.key_groups.start, slot.key_groups.end),
            backend=self._backends.kind,
            files=list(materialization.files),
            incremental_size=uploaded_bytes,
            full_size=materialization.full_size + sum(s.size for s in segments),
            committed_epoch=barrier.epoch,
            changelog=segments,
            materialized_epoch=materialization.epoch,
        )

    # -- background materialization ----------------------------------------------------------
    def start_materializing(self) -> None:
        """Start the thread that materializes changelog slots every ``state.changelog.periodic-materialize.interval``."""
        if self._materializer is None:
            self._materializer = threading.Thread(target=self._materialize_loop, name="materializer", daemon=True)
            self._materializer.start()

    def _materialize_loop(self) -> None:
        # Slots are polled, not scheduled: a deploy, a release or a restore changes them at any time.
        while not self._closing.wait(_MATERIALIZER_TICK_S):
            now = self._clock.monotonic_ms()
            slots = self._slots.all()
            deployed = {slot.subtask: slot.changelog for slot in slots}
            with self._lock:
                # A released slot's materializations go with it (a redeploy starts again).
                for subtask in [s for s, e in self._changelogs.items() if deployed.get(s) is not e.log]:
                    del self._changelogs[subtask]
            for slot in slots:
                if slot.changelog is None or slot.backend is None:
                    continue
                state = self.changelog_of(slot)
                if state.next_materialization_ms == 0:
                    state.next_materialization_ms = now + slot.materialize_interval_ms
                if state.materializing or state.failed or now < state.next_materialization_ms:
                    continue
                state.materializing = True
                try:
                    self._pool.submit(self._materialize_guarded, slot, state)
                except RuntimeError:  # the pool shut down: the TaskManager stops
                    state.materializing = False
                    return

    def _materialize_guarded(self, slot: Slot, state: ChangelogCheckpoints) -> None:
        labels = _labels(slot)
        self._metrics.record_materialization(labels, "started")
        t0 = self._clock.monotonic_ms()
        try:
            done = self.materialize(slot)
        except Exception as exc:
            state.failures += 1
            self._metrics.record_materialization(labels, "failed")
            reason = exc.message if isinstance(exc, KeyedStateError) else repr(exc)
            if state.failures > slot.max_materialization_failures:
                self._fail_slot(slot, state, reason)
                return
            # Checkpoints go on referencing the previous materialization; retried after a backoff.
            delay_ms = int(min(slot.materialize_interval_ms, _MATERIALIZE_RETRY.backoff_s(state.failures) * 1000))
            state.next_materialization_ms = self._clock.monotonic_ms() + delay_ms
            logger.warning(
                "materialization of %s failed (%d in a row, %d tolerated), retried in %d ms: %s",
                slot.subtask,
                state.failures,
                slot.max_materialization_failures,
                delay_ms,
                reason,
            )
        else:
            # Nothing new since the last one counts as completed, as in Flink, but leaves the duration.
            duration = self._clock.monotonic_ms() - t0 if done is not None else None
            self._metrics.record_materialization(labels, "completed", duration)
        finally:
            state.materializing = False

    def _fail_slot(self, slot: Slot, state: ChangelogCheckpoints, reason: str) -> None:
        """Too many materializations failed in a row: report the subtask failed, so its job fails over.

        As Flink fails the task: the restart strategy restarts the job from its latest completed
        checkpoint, which a new deployment of the slot materializes afresh. Should the report not
        reach the JobManager, the slot goes on materializing, and the next failure reports again.
        """
        cause = (
            f"{state.failures} consecutive materializations failed, more than "
            f"state.changelog.max-failures-allowed={slot.max_materialization_failures}; the last: {reason}"
        )
        logger.error("%s fails its job over: %s", slot.subtask, cause)
        state.failed = True
        try:
            self._reporter.report_task_failure(slot.subtask, slot.routing_version, cause)
        except Exception as exc:
            state.failed = False
            state.next_materialization_ms = self._clock.monotonic_ms() + slot.materialize_interval_ms
            logger.warning(
                "could not report the failure of %s (%s); it goes on materializing",
                slot.subtask,
                exc.message if isinstance(exc, KeyedStateError) else repr(exc),
            )

    def materialize(self, slot: Slot) -> Materialization | None:
        """Snapshot a changelog slot off the commit path and upload it to ``shared/mat-<id>/``.

        Offered to the slot's next checkpoints once every file is stored; None when nothing was
        committed since the last materialization. Raises on failure, having deleted what it uploaded.
        """
        log = slot.changelog
        if log is None or not slot.checkpoint_base:
            return None
        state = self.changelog_of(slot)
        backend = slot.require_backend()
        local_dir = self._backends.instance_dir(slot.subtask) / _LOCAL_SNAPSHOTS / f"mat-{uuid.uuid4().hex[:12]}"
        local_dir.parent.mkdir(parents=True, exist_ok=True)
        if backend.committed_epoch() <= state.latest_epoch():
            state.next_materialization_ms = self._clock.monotonic_ms() + slot.materialize_interval_ms
            return None
        # Commits go on meanwhile: a snapshot that reports the epoch of its own cut (RocksDB reads
        # it under its write lock, where commits write it with their data) needs no log lock, so a
        # memtable flush never blocks a commit. Every epoch it holds is logged (logging precedes
        # applying), and the checkpoints on top of it replay the segments after that epoch.
        snapshot = backend.snapshot(local_dir)
        epoch = snapshot.committed_epoch
        if epoch is None:
            # This backend's snapshot does not say (HashMap: a copy in memory, quick): cut again
            # with commits kept out, so the epoch read is the copy's.
            shutil.rmtree(local_dir, ignore_errors=True)
            with log.lock:
                epoch = backend.committed_epoch()
                snapshot = backend.snapshot(local_dir)
        uploaded_remote: list[str] = []
        try:
            crash_point("taskmanager.changelog.materializing")
            materialization = self._upload_materialization(slot, snapshot, epoch, uploaded_remote)
        except BaseException:
            storage = self._storages.for_url(slot.checkpoint_base)
            for remote in uploaded_remote:
                try:
                    storage.delete(remote)
                except Exception:
                    logger.warning("could not delete %s of a failed materialization of %s", remote, slot.subtask)
            raise
        finally:
            shutil.rmtree(local_dir, ignore_errors=True)
        unused = state.offer(materialization)
        self._delete_unreferenced(slot, unused)
        state.next_materialization_ms = self._clock.monotonic_ms() + slot.materialize_interval_ms
        logger.info(
            "materialized %s at epoch %d: %d files (%d bytes) referenced by its next checkpoints",
            slot.subtask,
            epoch,
            len(materialization.files),
            materialization.full_size,
        )
        return materialization

    def _upload_materialization(
        self, slot: Slot, snapshot: LocalSnapshot, epoch: int, uploaded_remote: list[str]
    ) -> Materialization:
        owner = f"{slot.subtask.operator_id}-{slot.subtask.subtask_index}"
        group = f"mat-{uuid.uuid4().hex[:12]}"
        confirmed = dict(slot.uploaded_shared)
        handles: list[StateFileHandle] = []
        plan: list[tuple[str, str, str]] = []
        full_size = 0
        for path in snapshot.materialize():
            size = path.stat().st_size
            full_size += size
            reused = confirmed.get(path.name) if path.name.endswith(".sst") else None
            if reused is not None and reused.size == size:
                # Held by a completed checkpoint's materialization: referenced, not uploaded again.
                handles.append(reused)
                continue
            name = f"{group}/{owner}-{path.name}"
            plan.append((str(path), _join(slot.checkpoint_base, "shared", name), f"../shared/{name}"))
        uploaded_remote.extend(remote for _, remote, _ in plan)
        uploaded = self._transfers.upload(
            slot.checkpoint_base,
            [(local, remote) for local, remote, _ in plan],
            self._threads,
            self._closing,
            self.stats,
        )
        for (local, _remote, relative), up in zip(plan, uploaded):
            handles.append(
                StateFileHandle(path=relative, size=up.size, sha256=up.sha256, local_name=Path(local).name, shared=True)
            )
        return Materialization(
            epoch,
            tuple(handles),
            full_size,
            frozenset(relative for _, _, relative in plan),
            incremental_size=sum(up.size for up in uploaded),
        )

    def _delete_unreferenced(self, slot: Slot, files: list[StateFileHandle]) -> None:
        """Delete a superseded materialization's own files, which no checkpoint ever referenced."""
        if not files:
            return
        storage = self._storages.for_url(slot.checkpoint_base)
        for f in files:
            try:
                storage.delete(_join(slot.checkpoint_base, "shared", f.path.removeprefix("../shared/")))
            except Exception:
                logger.warning("could not delete %s of a superseded materialization of %s", f.path, slot.subtask)

    def _usable_materialization(self, slot: Slot, cut: ChangelogCut) -> Materialization:
        """The candidate when its files are all in storage, else the confirmed materialization.

        A candidate's files belong to no checkpoint until one that references it completes, so
        an offline ``statectl checkpoint gc`` run meanwhile may have deleted them; the confirmed
        one is the JobManager's to keep, and the segments since it are still kept locally.
        """
        candidate = cut.candidate
        if candidate is not None:
            storage = self._storages.for_url(slot.checkpoint_base)
            base = _join(slot.checkpoint_base, "shared")
            try:
                missing = [
                    f.path
                    for f in candidate.files
                    if storage.size(_join(base, f.path.removeprefix("../shared/"))) != f.size
                ]
            except FileNotFoundError as exc:
                missing = [str(exc)]
            if not missing:
                return candidate
            logger.warning(
                "%s: the materialization of epoch %d lost files (%s); checkpoints fall back to the confirmed one",
                slot.subtask,
                candidate.epoch,
                missing[0],
            )
            self.changelog_of(slot).drop_candidate(candidate)
        if cut.confirmed is None:
            raise CorruptCheckpointError(
                f"{slot.subtask} has no usable materialization to reference; the next checkpoint materializes again"
            )
        return cut.confirmed

    def _inline(
        self, slot: Slot, plan: list[_PlannedUpload], full_size: int, barrier: CheckpointBarrier
    ) -> list[StateFileHandle]:
        """The slot's files with their bytes, for a checkpoint kept in the JobManager's memory.

        Refused past the barrier's limit before anything is read, as Flink's JobManagerCheckpointStorage
        refuses a state larger than its maximum.
        """
        limit = barrier.inline_max_state_size
        if full_size > limit:
            raise StateSizeLimitExceeded(
                f"the state of {slot.subtask} is {full_size} bytes, more than the {limit} bytes the JobManager "
                f"checkpoint storage takes (execution.checkpointing.jobmanager-storage.max-state-size); use "
                f"execution.checkpointing.storage: filesystem with state.checkpoints.dir for state this large"
            )
        handles = []
        for local, _remote, relative, _shared in plan:
            data = Path(local).read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            handles.append(
                StateFileHandle(path=relative, size=len(data), sha256=digest, local_name=Path(local).name, data=data)
            )
        logger.info(
            "checkpoint %d of %s: %d files (%d bytes) sent inline to the JobManager",
            barrier.checkpoint_id,
            slot.subtask,
            len(handles),
            full_size,
        )
        return handles

    def _state_handle(
        self, slot: Slot, snapshot: LocalSnapshot, files: list[StateFileHandle], incremental_size: int, full_size: int
    ) -> SubtaskStateHandle:
        backend = slot.backend
        return SubtaskStateHandle(
            operator_id=OperatorId(slot.subtask.operator_id),
            subtask_index=slot.subtask.subtask_index,
            key_groups=KeyGroupRange(slot.key_groups.start, slot.key_groups.end),
            backend=self._backends.kind,
            files=files,
            incremental_size=incremental_size,
            full_size=full_size,
            # Read at the cut when the backend can; the live value may already include a later epoch.
            committed_epoch=snapshot.committed_epoch
            if snapshot.committed_epoch is not None
            else backend.committed_epoch()
            if backend is not None
            else -1,
        )

    def _discard_uploads(self, work: _SlotCheckpoint, barrier: CheckpointBarrier) -> None:
        """Delete what this attempt uploaded and its local snapshot: a failed checkpoint leaves nothing."""
        if work.inline:
            # Nothing was uploaded: the files went (or were to go) inline to the JobManager.
            shutil.rmtree(work.local_dir, ignore_errors=True)
            return
        storage = self._storages.for_url(barrier.target_path)
        for remote in work.uploaded_remote:
            try:
                storage.delete(remote)
            except Exception:
                logger.warning("could not delete %s of failed checkpoint %d", remote, barrier.checkpoint_id)
        work.uploaded_remote.clear()
        if work.target_path:
            # The JobManager deletes the directory of an aborted checkpoint, but an upload still
            # running then recreates it (empty directories, on file systems that have them).
            # This subtask's own directory goes, and the checkpoint's once nothing else is in it
            # (a _metadata there is someone else's checkpoint and stays).
            owner = f"{work.slot.subtask.operator_id}-{work.slot.subtask.subtask_index}"
            try:
                storage.delete_dir(_join(work.target_path, owner))
                if not any(True for _ in storage.list(work.target_path)):
                    storage.delete_dir(work.target_path)
            except Exception:
                logger.warning("could not delete %s of failed checkpoint %d", work.target_path, barrier.checkpoint_id)
        shutil.rmtree(work.local_dir, ignore_errors=True)

    def notify(self, job_id: JobId, checkpoint_id: CheckpointId, completed: bool) -> None:
        """The JobManager's word on a checkpoint: completed (keep its files for the next one) or aborted."""
        with self._lock:
            works = self._inflight.pop((job_id, checkpoint_id), [])
        if completed and works and not works[0].savepoint:
            self._subsume_older(job_id, checkpoint_id)
        for work in works:
            if completed:
                if work.changelog is not None and work.materialization is not None:
                    if self.changelog_of(work.slot).completed(work.materialization, work.new_segments):
                        # Its files are the JobManager's now: the next snapshot may reference its SST files.
                        work.slot.uploaded_shared = work.materialization.sst_files()
                elif not work.savepoint:
                    # The next incremental checkpoint may reference exactly what this one references.
                    work.slot.uploaded_shared = {**work.referenced_shared, **work.new_shared}
                self._keep_local_copy(work)
            else:
                self._cancel(work)

    def _subsume_older(self, job_id: JobId, checkpoint_id: CheckpointId) -> None:
        """A completed checkpoint subsumes the job's older in-flight *checkpoints*; savepoints carry on."""
        with self._lock:
            older = [
                k
                for k, works in self._inflight.items()
                if k[0] == job_id and k[1] < checkpoint_id and works and not works[0].savepoint
            ]
            subsumed = [w for k in older for w in self._inflight.pop(k)]
        for work in subsumed:
            if work.acknowledged:
                # Never told the outcome, but it may have completed: a JobManager that died after
                # its _metadata is taken back by the next one, and newer checkpoints then reference
                # its shared files. Deleting them is the JobManager's call (subsumption, gc).
                work.cancel.set()
                shutil.rmtree(work.local_dir, ignore_errors=True)
                continue
            self._cancel(work)

    def _cancel(self, work: _SlotCheckpoint) -> None:
        work.cancel.set()
        if work.done:
            barrier = CheckpointBarrier(
                job_id=JobId(work.slot.subtask.job_id),
                checkpoint_id=work.checkpoint_id,
                target_path=work.target_path or work.slot.checkpoint_base or "file:///",
            )
            self._discard_uploads(work, barrier)
        # A running upload discards its own files when it sees the cancel (see _finish_snapshot).

    def _keep_local_copy(self, work: _SlotCheckpoint) -> None:
        """After completion: a checkpoint's snapshot replaces older local copies (local recovery); a savepoint's goes."""
        if work.savepoint:
            shutil.rmtree(work.local_dir, ignore_errors=True)
            return
        for other in work.local_dir.parent.glob("chk-*"):
            # Only older checkpoints: a newer one may be in flight, and savepoints live in savepoint-<n>.
            other_id = _checkpoint_id(other.name)
            if other_id is not None and other_id < work.checkpoint_id:
                shutil.rmtree(other, ignore_errors=True)
        if not self.local_recovery:
            shutil.rmtree(work.local_dir, ignore_errors=True)

    # -- restore -----------------------------------------------------------------------------
    def restore(self, slot: Slot, instance_dir: Path, restore: SlotRestore) -> tuple[KeyedStateBackend, DeployResult]:
        """Download (or find locally) every snapshot overlapping the slot and build its backend."""
        t0 = self._clock.monotonic_ms()
        for handle in restore.handles:
            # The handle's operator id names a directory below; refuse traversal before anything is made.
            validate_id("operator id of a restore handle", handle.operator_id)
        work_root = instance_dir.parent / f"{instance_dir.name}.{_RESTORE_DIR}"
        shutil.rmtree(work_root, ignore_errors=True)
        snapshot_dirs: list[Path] = []
        downloaded = downloaded_files = local_files = local_bytes = 0
        restored_bytes = 0
        for i, handle in enumerate(restore.handles):
            target = work_root / f"{i}-{handle.operator_id}-{handle.subtask_index}"
            target.mkdir(parents=True)
            local = self._local_copy(slot, restore.checkpoint_id, handle)
            items = []
            for f in handle.files:
                restored_bytes += f.size
                name = f.local_name or Path(f.path).name
                if not is_plain_file_name(name):
                    raise InvalidArgumentError(
                        f"restore of {slot.subtask}: file {f.path[:200]!r} has local name {name[:100]!r}; it must be a "
                        "plain file name (no '/', not '..'), or the file would be written outside the restore directory"
                    )
                if f.data is not None:
                    _write_inline(f, target / name)
                    continue
                verified = local.get(name)
                if verified is not None:
                    (target / name).hardlink_to(verified)
                    local_files += 1
                    local_bytes += f.size
                    continue
                items.append((f.path, str(target / name), f.size, f.sha256))
            if items:
                downloaded += self._restore_transfers.download(items[0][0], items, self._threads, stats=self.stats)
                downloaded_files += len(items)
            snapshot_dirs.append(target)
        segments = self._download_segments(restore, work_root / "changelog")
        downloaded += sum(len(data) for data in segments.values())
        downloaded_files += len(segments)
        shutil.rmtree(instance_dir, ignore_errors=True)
        backend = self._backends.restore(slot, snapshot_dirs)
        if segments:
            try:
                # Before the slot reports its epoch: the JobManager checks it is the checkpoint's.
                replay_changelog(backend, restore.handles, segments)
            except BaseException:
                backend.close()
                raise
        self._keep_restored_copy(slot, instance_dir, restore, snapshot_dirs)
        shutil.rmtree(work_root, ignore_errors=True)
        slot.uploaded_shared = owned_shared_files(slot, restore)
        slot.restored_materialization = owned_materialization(slot, restore)
        ms = self._clock.monotonic_ms() - t0
        labels = (slot.subtask.job_id, slot.subtask.operator_id, str(slot.subtask.subtask_index))
        self._metrics.restore_seconds.labels(*labels).set(ms / 1000.0)
        self._metrics.record_restore(labels, downloaded_files, downloaded, local_files, local_bytes)
        logger.info(
            "restored %s from checkpoint %d: %d snapshot(s), %d files (%d bytes) downloaded, %d files (%d bytes) "
            "from the local copy, %d ms",
            slot.subtask,
            restore.checkpoint_id,
            len(snapshot_dirs),
            downloaded_files,
            downloaded,
            local_files,
            local_bytes,
            ms,
        )
        return backend, DeployResult(restore_duration_ms=ms, restored_bytes=restored_bytes, downloaded_bytes=downloaded)

    def _download_segments(self, restore: SlotRestore, directory: Path) -> dict[str, bytes]:
        """The changelog segments of the restored handles, verified (size and sha256), by path."""
        wanted = {s.path: s for h in restore.handles for s in h.changelog}
        if not wanted:
            return {}
        directory.mkdir(parents=True)
        items = [
            (path, str(directory / f"{i:06d}.seg"), s.size, s.sha256) for i, (path, s) in enumerate(wanted.items())
        ]
        crash_point("taskmanager.changelog.before-segment-download")
        # A missing or damaged segment raises CorruptCheckpointError naming it: never a silent partial restore.
        self._restore_transfers.download(items[0][0], items, self._threads, stats=self.stats)
        return {path: Path(local).read_bytes() for path, local, _, _ in items}

    def _keep_restored_copy(
        self, slot: Slot, instance_dir: Path, restore: SlotRestore, snapshot_dirs: list[Path]
    ) -> None:
        """With local recovery, the snapshot a slot was restored from becomes its local copy.

        A second failure before the next checkpoint completes (a failover right after a
        failover) then restores from it again instead of downloading it. Only a slot restoring
        its own snapshot unchanged qualifies; the backend copied the files it modifies.
        """
        if not self.local_recovery or restore.checkpoint_id <= 0 or len(restore.handles) != 1:
            return
        handle = restore.handles[0]
        if (handle.operator_id, handle.subtask_index, handle.key_groups.start, handle.key_groups.end) != (
            slot.subtask.operator_id,
            slot.subtask.subtask_index,
            slot.key_groups.start,
            slot.key_groups.end,
        ):
            return
        local = instance_dir / _LOCAL_SNAPSHOTS / f"chk-{restore.checkpoint_id}"
        try:
            local.parent.mkdir(parents=True, exist_ok=True)
            os.replace(snapshot_dirs[0], local)
        except OSError as exc:  # only a lost optimisation
            logger.warning("could not keep the restored snapshot of %s as its local copy: %s", slot.subtask, exc)

    def _local_copy(self, slot: Slot, checkpoint_id: CheckpointId, handle: SubtaskStateHandle) -> dict[str, Path]:
        """The files of the local snapshot of the same checkpoint that verify, by local name.

        Local recovery keeps the snapshot of the last completed checkpoint next to the slot's
        state. Each file is checked against the size and sha256 the checkpoint recorded; one that
        is missing or differs is downloaded instead (and named in the log), the others are used.
        """
        if not self.local_recovery or checkpoint_id <= 0:
            return {}
        source = SubtaskId(slot.subtask.job_id, handle.operator_id, handle.subtask_index)
        local = self._backends.instance_dir(source) / _LOCAL_SNAPSHOTS / f"chk-{checkpoint_id}"
        if not local.is_dir():
            logger.info(
                "no local copy of checkpoint %d of %s at %s; %s downloads it",
                checkpoint_id,
                source,
                local,
                slot.subtask,
            )
            return {}
        verified: dict[str, Path] = {}
        for f in handle.files:
            path = local / (f.local_name or Path(f.path).name)
            if not path.is_file():
                logger.warning("local copy %s is missing; %s downloads %s instead", path, slot.subtask, f.path)
                continue
            size, digest = sha256_file(str(path))
            if size != f.size or digest != f.sha256:
                logger.warning(
                    "local copy %s does not verify (%d bytes, sha256 %s; checkpoint %d recorded %d bytes, sha256 %s); "
                    "%s downloads %s instead",
                    path,
                    size,
                    digest,
                    checkpoint_id,
                    f.size,
                    f.sha256,
                    slot.subtask,
                    f.path,
                )
                continue
            verified[path.name] = path
        return verified

    def close(self) -> None:
        """Cancel the uploads in flight and wait for the workers (the TaskManager stops)."""
        self._closing.set()
        with self._lock:
            for works in self._inflight.values():
                for w in works:
                    w.cancel.set()
        self._pool.shutdown(wait=True, cancel_futures=True)


def _labels(slot: Slot) -> tuple[str, str, str]:
    """The slot's operator-scope metric labels (job, operator, subtask)."""
    return (slot.subtask.job_id, slot.subtask.operator_id, str(slot.subtask.subtask_index))


def _write_inline(f: StateFileHandle, path: Path) -> None:
    """A file the JobManager sent with the restore (its memory holds the checkpoint), checked as a download is."""
    assert f.data is not None
    if len(f.data) != f.size or hashlib.sha256(f.data).hexdigest() != f.sha256:
        raise CorruptCheckpointError(
            f"file {f.path!r} sent inline by the JobManager has {len(f.data)} bytes and another checksum than "
            f"its handle ({f.size} bytes, sha256 {f.sha256[:12]}…); take a new checkpoint"
        )
    path.write_bytes(f.data)


def _local_name(barrier: CheckpointBarrier) -> str:
    """Local snapshot directory of one barrier: savepoints apart, so no checkpoint's completion touches them."""
    return f"{'savepoint' if barrier.savepoint else 'chk'}-{barrier.checkpoint_id}"


def _checkpoint_id(name: str) -> int | None:
    prefix = "chk-"
    if name.startswith(prefix) and name[len(prefix) :].isdigit():
        return int(name[len(prefix) :])
    return None


def owned_shared_files(slot: Slot, restore: SlotRestore) -> dict[str, StateFileHandle]:
    """The restored ``shared/`` files the slot's next incremental checkpoint references (by local name).

    Only when the job owns them (``restore.owned``: CLAIM, a failover, a JobManager restart), they
    lie in this job's ``shared/`` (a reference is ``../shared/<name>``), and the slot restored
    exactly one snapshot: its RocksDB is then that snapshot, SST files hard-linked under their
    recorded names. After a rescale that merged several snapshots, a name may stand for an
    ingested file of another content, so everything is uploaded again. A file RocksDB has since
    compacted away is simply not listed by the next snapshot; one whose size differs is uploaded.
    """
    if not restore.owned or len(restore.handles) != 1 or not slot.checkpoint_base:
        return {}
    handle = restore.handles[0]
    if not len(handle.key_groups.intersection(slot.key_groups)):
        return {}
    pool = _join(slot.checkpoint_base, "shared") + "/"
    owned: dict[str, StateFileHandle] = {}
    for f in handle.files:
        if not f.shared or not f.local_name or not f.path.startswith(pool):
            continue
        owned[f.local_name] = StateFileHandle(
            path=f"../shared/{f.path[len(pool) :]}", size=f.size, sha256=f.sha256, local_name=f.local_name, shared=True
        )
    if not owned and any(f.shared for f in handle.files):
        logger.info(
            "restore of %s from checkpoint %d: the job owns it, but its shared files lie outside %s (another job's "
            "directory), so the next checkpoint uploads them again",
            slot.subtask,
            restore.checkpoint_id,
            pool,
        )
    return owned


def owned_materialization(slot: Slot, restore: SlotRestore) -> SubtaskStateHandle | None:
    """The restored changelog snapshot the slot's next checkpoints reference, paths made relative; None: none.

    Only when the job owns the restored files (as for :func:`owned_shared_files`), the slot
    restored exactly one snapshot of its own key groups (a rescale merges or splits them), and
    that snapshot is a changelog one: every file and segment in this job's ``shared/``, where the
    shared-state registry keeps what a retained checkpoint references. A plain checkpoint's
    private files live in its ``chk-<n>/`` and go with it, so it cannot serve as a materialization.
    """
    if not restore.owned or len(restore.handles) != 1 or not slot.checkpoint_base:
        return None
    handle = restore.handles[0]
    if (handle.key_groups.start, handle.key_groups.end) != (slot.key_groups.start, slot.key_groups.end):
        return None
    pool = _join(slot.checkpoint_base, "shared") + "/"
    paths = [f.path for f in handle.files] + [s.path for s in handle.changelog]
    if not handle.files or not all(f.shared for f in handle.files) or not all(p.startswith(pool) for p in paths):
        return None

    def relative(path: str) -> str:
        return f"../shared/{path[len(pool) :]}"

    return dataclasses.replace(
        handle,
        files=[dataclasses.replace(f, path=relative(f.path), data=None) for f in handle.files],
        changelog=[dataclasses.replace(s, path=relative(s.path)) for s in handle.changelog],
        materialized_epoch=handle.snapshot_epoch,
    )
