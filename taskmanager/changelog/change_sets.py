"""Change sets of overlapped commits: one slot's winners' operations of one epoch, in checkpoint storage.

At Prepare in ``execution.checkpointing.commit-mode: overlapped`` a slot writes the mutations
its commit of the epoch will apply (the winners' staged operations folded per entry, exactly
what a changelog segment records) to ``<job dir>/changelog/<E>/v<version>-<operator>-<subtask>``,
as a one-record changelog segment, and answers only once the write is durable. A restore hands
the change sets of the decided epochs above the restored state back to each new slot, which
replays those of its key groups with :func:`~keyedstate.taskmanager.changelog.log.replay`
(one atomic batch per epoch, TTL stamped with the commit's original time).

Mutations are sorted by key group (stable, so the operations on one key keep their order): a
reader after a rescale finds its key groups' part of every file together.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence

from keyedstate.common.changesets import ChangeSetFile, change_set_name
from keyedstate.common.errors import CorruptCheckpointError, InvalidArgumentError
from keyedstate.common.ids import SubtaskId
from keyedstate.common.keygroups import key_group
from keyedstate.common.storage import StorageCache, join_url
from keyedstate.taskmanager.changelog.log import ReplaySource, replay
from keyedstate.taskmanager.changelog.segment import ChangeSet, encode_segment, read_segment
from keyedstate.taskmanager.state.backend import KeyedStateBackend
from keyedstate.taskmanager.state.mutation import Mutation

logger = logging.getLogger(__name__)


def encode_change_set(epoch: int, timestamp_ms: int, mutations: Sequence[Mutation], max_parallelism: int) -> bytes:
    """The file of one slot's change set: a changelog segment of one record, mutations sorted by key group."""
    ordered = sorted(mutations, key=lambda m: key_group(m.key, max_parallelism))
    return encode_segment([ChangeSet(epoch, timestamp_ms, tuple(ordered))])


class ChangeSetStore:
    """Writes a slot's change sets and replays decided ones into a restored slot (one per TaskManager process)."""

    def __init__(self, storages: StorageCache) -> None:
        self._storages = storages

    def upload(
        self,
        checkpoint_base: str,
        subtask: SubtaskId,
        routing_version: int,
        epoch: int,
        timestamp_ms: int,
        mutations: Sequence[Mutation],
        max_parallelism: int,
    ) -> ChangeSetFile:
        """Write the change set durably (atomic replace: a re-prepare of the same epoch and deployment
        overwrites a file that no decision names yet); its reference for the decision."""
        if not checkpoint_base:
            raise InvalidArgumentError(
                f"{subtask} was deployed without checkpoint storage; overlapped commits need state.checkpoints.dir "
                "(execution.checkpointing.storage: filesystem)"
            )
        name = change_set_name(epoch, routing_version, subtask.operator_id, subtask.subtask_index)
        data = encode_change_set(epoch, timestamp_ms, mutations, max_parallelism)
        storage = self._storages.for_url(checkpoint_base)
        storage.write_bytes(join_url(checkpoint_base, name), data)
        logger.info(
            "%s: change set of epoch %d written (%d mutations, %d bytes)", subtask, epoch, len(mutations), len(data)
        )
        return ChangeSetFile(
            epoch, subtask.operator_id, subtask.subtask_index, name, len(data), hashlib.sha256(data).hexdigest()
        )

    def replay(self, backend: KeyedStateBackend, checkpoint_base: str, files: Sequence[ChangeSetFile]) -> int:
        """Fold the decided epochs' change sets (of ``backend``'s key groups) into ``backend``; its epoch after.

        The epochs must continue the backend's committed epoch without a gap, and every file must
        match the size and digest its decision recorded; otherwise CorruptCheckpointError names
        the file, before anything is applied.
        """
        held = backend.committed_epoch()
        if not files:
            return held
        epochs = sorted({f.epoch for f in files})
        if epochs != list(range(held + 1, held + 1 + len(epochs))):
            raise CorruptCheckpointError(
                f"{backend.subtask} holds epoch {held}, but the decided epochs to replay are {epochs}: they must continue "
                "it without a gap. Restore the job again (its latest checkpoint and the decisions above it)"
            )
        storage = self._storages.for_url(checkpoint_base)
        sources = []
        for f in sorted(files, key=lambda f: (f.epoch, f.operator_id, f.subtask_index)):
            url = join_url(checkpoint_base, f.path)
            try:
                data = storage.read_bytes(url)
            except FileNotFoundError as exc:
                raise CorruptCheckpointError(
                    f"the change set {url} of decided epoch {f.epoch} is missing; the decision names it, so the epoch "
                    "cannot be replayed. Restore from a checkpoint at or above that epoch"
                ) from exc
            if len(data) != f.size or hashlib.sha256(data).hexdigest() != f.sha256:
                raise CorruptCheckpointError(
                    f"the change set {url} of decided epoch {f.epoch} has {len(data)} bytes / sha256 "
                    f"{hashlib.sha256(data).hexdigest()[:12]}…, its decision recorded {f.size} / {f.sha256[:12]}…; restore "
                    "from a checkpoint at or above that epoch"
                )
            # Validate the whole file before anything applies (replay reads lazily).
            if any(cs.epoch != f.epoch for cs in read_segment(data, url)):
                raise CorruptCheckpointError(f"the change set {url} holds another epoch than {f.epoch}")
            sources.append(ReplaySource(materialized_epoch=held, segments=[(url, data)]))
        last = replay(backend, sources)
        logger.info(
            "%s: replayed decided epochs %d..%d from %d change sets", backend.subtask, held + 1, last, len(files)
        )
        return last
