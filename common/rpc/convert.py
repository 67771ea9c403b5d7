"""Protobuf <-> domain conversions of what both daemons (and the Spark helper) exchange.

The checkpoint handles (``common.handles``) and the epoch winners (``common.batches``) cross every
process: a barrier goes from the JobManager to the TaskManagers, handles come back in acks, go into
``_metadata`` and return in restores; winners go from the Spark helper through the JobManager to
each TaskManager. These functions are the one place that knows those messages' field names.
"""

from __future__ import annotations

from collections.abc import Iterable

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import taskmanager_pb2 as tm_pb
from keyedstate.common.batches import Winner
from keyedstate.common.changesets import CHANGELOG_DIR, ChangeSetFile
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.handles import (
    ChangelogSegmentHandle,
    CheckpointBarrier,
    SlotRestore,
    StateFileHandle,
    SubtaskStateHandle,
)
from keyedstate.common.ids import CheckpointId, JobId, KeyGroupRange, OperatorId


def barrier_from_proto(message: tm_pb.CheckpointBarrier) -> CheckpointBarrier:
    """The JobManager's barrier as the snapshot layer takes it."""
    return CheckpointBarrier(
        job_id=JobId(message.job_id),
        checkpoint_id=CheckpointId(message.checkpoint_id),
        target_path=message.target_path,
        epoch=message.epoch,
        savepoint=message.savepoint,
        incremental=message.incremental,
        timestamp_ms=message.timestamp_ms,
        inline_max_state_size=message.inline_max_state_size,
    )


def file_from_proto(message: pb.StateFileHandle) -> StateFileHandle:
    return StateFileHandle(
        path=message.path,
        size=message.size,
        sha256=message.sha256,
        local_name=message.local_name,
        shared=message.shared,
        data=message.data if message.HasField("data") else None,
    )


def handle_from_proto(message: pb.SubtaskStateHandle) -> SubtaskStateHandle:
    """A snapshot named in a restore (the JobManager reads it back from ``_metadata``)."""
    return SubtaskStateHandle(
        operator_id=OperatorId(message.operator_id),
        subtask_index=message.subtask_index,
        key_groups=KeyGroupRange(message.key_groups.start, message.key_groups.end),
        backend=message.backend,
        files=[file_from_proto(f) for f in message.files],
        incremental_size=message.incremental_size,
        full_size=message.full_size,
        sync_duration_ms=message.sync_duration_ms,
        async_duration_ms=message.async_duration_ms,
        committed_epoch=message.committed_epoch,
        changelog=[
            ChangelogSegmentHandle(s.path, s.first_epoch, s.last_epoch, s.size, s.sha256) for s in message.changelog
        ],
        # Without segments the snapshot holds the committed epoch (what older senders mean by 0 here).
        materialized_epoch=message.materialized_epoch if message.changelog else None,
    )


def handle_to_proto(handle: SubtaskStateHandle) -> pb.SubtaskStateHandle:
    """What a slot acknowledges for one checkpoint."""
    return pb.SubtaskStateHandle(
        operator_id=handle.operator_id,
        subtask_index=handle.subtask_index,
        key_groups=pb.KeyGroupRange(start=handle.key_groups.start, end=handle.key_groups.end),
        backend=handle.backend,
        files=[
            pb.StateFileHandle(
                path=f.path, size=f.size, sha256=f.sha256, local_name=f.local_name, shared=f.shared, data=f.data
            )
            for f in handle.files
        ],
        incremental_size=handle.incremental_size,
        full_size=handle.full_size,
        sync_duration_ms=handle.sync_duration_ms,
        async_duration_ms=handle.async_duration_ms,
        committed_epoch=handle.committed_epoch,
        changelog=[
            pb.ChangelogSegmentHandle(
                path=s.path, first_epoch=s.first_epoch, last_epoch=s.last_epoch, size=s.size, sha256=s.sha256
            )
            for s in handle.changelog
        ],
        materialized_epoch=handle.snapshot_epoch,
    )


def restore_from_proto(message: tm_pb.SlotRestore) -> SlotRestore:
    return SlotRestore(
        checkpoint_id=CheckpointId(message.checkpoint_id),
        handles=tuple(handle_from_proto(h) for h in message.handles),
        checkpoint_path=message.checkpoint_path,
        owned=message.owned,
    )


def restore_to_proto(restore: SlotRestore) -> tm_pb.SlotRestore:
    """A slot's restore inputs as the JobManager sends them in ``DeploySlot``."""
    return tm_pb.SlotRestore(
        checkpoint_id=restore.checkpoint_id,
        checkpoint_path=restore.checkpoint_path,
        handles=[handle_to_proto(h) for h in restore.handles],
        owned=restore.owned,
    )


def barrier_to_proto(barrier: CheckpointBarrier) -> tm_pb.CheckpointBarrier:
    """The JobManager's barrier as it goes to each TaskManager."""
    return tm_pb.CheckpointBarrier(
        job_id=barrier.job_id,
        checkpoint_id=barrier.checkpoint_id,
        target_path=barrier.target_path,
        epoch=barrier.epoch,
        savepoint=barrier.savepoint,
        incremental=barrier.incremental,
        timestamp_ms=barrier.timestamp_ms,
        inline_max_state_size=barrier.inline_max_state_size,
    )


def winner_to_proto(winner: Winner) -> pb.PartitionAttempt:
    """A partition's winning attempt, with its ledger when it has one (sorted, so equal winners encode equally)."""
    return pb.PartitionAttempt(
        partition=winner.partition,
        attempt=winner.attempt,
        has_ledger=winner.ledger is not None,
        writes=[
            pb.SlotWrites(operator_id=op, subtask_index=i, requests=n)
            for (op, i), n in sorted((winner.ledger or {}).items())
        ],
    )


def winners_from_proto(items: Iterable[pb.PartitionAttempt]) -> dict[int, Winner]:
    """partition -> its winning attempt and ledger; one winner per partition."""
    winners: dict[int, Winner] = {}
    for w in items:
        if w.partition < 0 or w.attempt < 0:
            raise InvalidArgumentError(f"winner partition {w.partition} attempt {w.attempt}: both must be >= 0")
        ledger: dict[tuple[str, int], int] | None = None
        if w.has_ledger:
            ledger = {}
            for entry in w.writes:
                if entry.requests < 0 or entry.subtask_index < 0:
                    raise InvalidArgumentError(
                        f"winner partition {w.partition}: ledger entry {entry.operator_id}/{entry.subtask_index} has "
                        f"{entry.requests} requests; counts and subtask indexes must be >= 0"
                    )
                ledger[(entry.operator_id, entry.subtask_index)] = entry.requests
        previous = winners.get(w.partition)
        if previous is not None and previous.attempt != w.attempt:
            raise InvalidArgumentError(
                f"partition {w.partition} has two winning attempts ({previous.attempt} and {w.attempt}); name one winner per partition"
            )
        winners[w.partition] = Winner(w.partition, w.attempt, ledger)
    return winners


def winner_to_bytes(winner: Winner) -> bytes:
    """A winner as one Spark task ships it to the driver: its ``PartitionAttempt`` message, serialized."""
    return winner_to_proto(winner).SerializeToString()


def winner_from_bytes(data: bytes) -> Winner:
    """The inverse of :func:`winner_to_bytes` (validated as :func:`winners_from_proto` validates)."""
    message = pb.PartitionAttempt.FromString(data)
    return winners_from_proto([message])[message.partition]


def change_set_to_proto(f: ChangeSetFile) -> tm_pb.ChangeSetFile:
    return tm_pb.ChangeSetFile(
        epoch=f.epoch,
        operator_id=f.operator_id,
        subtask_index=f.subtask_index,
        path=f.path,
        size=f.size,
        sha256=f.sha256,
    )


def change_set_from_proto(m: tm_pb.ChangeSetFile) -> ChangeSetFile:
    """A change set reference; refuses paths that leave the job's changelog directory."""
    if not m.path.startswith(CHANGELOG_DIR + "/") or ".." in m.path.split("/") or m.epoch < 0 or m.size < 0:
        raise InvalidArgumentError(
            f"change set {m.path!r} of epoch {m.epoch}: the path must lie under {CHANGELOG_DIR}/ of the job's checkpoint "
            "directory and the epoch and size must be >= 0"
        )
    return ChangeSetFile(m.epoch, m.operator_id, m.subtask_index, m.path, m.size, m.sha256)
