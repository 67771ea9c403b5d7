"""Planning a restore: which local snapshots feed which key groups, and checks before any write.

After rescaling, several snapshots (each of an old subtask's key-group range) overlap the new
range; each contributes exactly its overlap. Everything that can make a restore fail (missing
manifest, other max parallelism, a state whose kind changed, overlapping snapshots) is found
here, before the backend touches its directory.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from keyedstate.common.descriptors import StateDescriptor
from keyedstate.common.errors import IncompatibleCheckpointError, InvalidArgumentError
from keyedstate.common.ids import KeyGroupRange
from keyedstate.taskmanager.state.backend import check_compatible
from keyedstate.taskmanager.state.metadata import INTERNAL_META_PREFIX
from keyedstate.taskmanager.state.snapshot import SnapshotManifest, SnapshotReader, open_snapshot

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestorePart:
    directory: Path
    manifest: SnapshotManifest
    overlap: KeyGroupRange
    """The key groups this snapshot contributes (possibly empty)."""

    def open(self) -> SnapshotReader:
        """A reader over this snapshot directory, whichever backend wrote it; close it after use."""
        return open_snapshot(self.directory)


@dataclass(frozen=True)
class RestorePlan:
    parts: tuple[RestorePart, ...]
    carried: tuple[StateDescriptor, ...]
    """States present in the snapshots that the job no longer declares (kept, not served)."""

    @property
    def contributing(self) -> list[RestorePart]:
        """The parts that hold some of the slot's key groups (the others need not be read)."""
        return [p for p in self.parts if len(p.overlap)]


def plan_restore(
    snapshot_dirs: Sequence[Path],
    key_groups: KeyGroupRange,
    max_parallelism: int,
    states: Sequence[StateDescriptor],
) -> RestorePlan:
    if not snapshot_dirs:
        raise InvalidArgumentError(
            "restore needs at least one local snapshot directory; create the backend empty instead"
        )
    parts: list[RestorePart] = []
    declared = {s.name: s for s in states}
    carried: dict[str, StateDescriptor] = {}
    for directory in snapshot_dirs:
        directory = Path(directory)
        manifest = SnapshotManifest.read(directory)
        if manifest.max_parallelism != max_parallelism:
            raise IncompatibleCheckpointError(
                f"snapshot {directory} was taken with max parallelism {manifest.max_parallelism} but the job now has "
                f"{max_parallelism}; the max parallelism (pipeline.max-parallelism) is fixed for a job's life"
            )
        for d in manifest.states:
            if d.name in declared:
                check_compatible(declared[d.name], d, f"snapshot {directory}")
            elif d.name in carried:
                check_compatible(carried[d.name], d, f"snapshot {directory}")
            else:
                carried[d.name] = d
        parts.append(RestorePart(directory, manifest, manifest.key_groups.intersection(key_groups)))
    contributing = sorted((p for p in parts if len(p.overlap)), key=lambda p: p.overlap.start)
    for a, b in itertools.pairwise(contributing):
        if a.overlap.end >= b.overlap.start:
            raise InvalidArgumentError(
                f"snapshots {a.directory} ({a.manifest.key_groups}) and {b.directory} ({b.manifest.key_groups}) both hold "
                "key groups of the new range; pass each old subtask's snapshot of ONE checkpoint exactly once"
            )
    covered = sum(len(p.overlap) for p in contributing)
    if covered < len(key_groups):
        logger.info(
            "restore of key groups %s: the snapshots cover %d of %d key groups; the rest start empty",
            key_groups,
            covered,
            len(key_groups),
        )
    if carried:
        logger.warning(
            "restored state(s) %s are no longer declared by the operator; they are kept (and checkpointed) but not served",
            sorted(carried),
        )
    return RestorePlan(tuple(parts), tuple(carried.values()))


def merge_meta(metas: Sequence[dict[bytes, bytes]]) -> dict[bytes, bytes]:
    """User metadata of several snapshots; for a key in more than one, the first snapshot listed wins."""
    merged: dict[bytes, bytes] = {}
    for meta in metas:
        for k, v in meta.items():
            if k.startswith(INTERNAL_META_PREFIX):
                continue
            if k in merged and merged[k] != v:
                logger.debug("meta key %r differs between restored snapshots; keeping the first", k)
            merged.setdefault(k, v)
    return merged
