"""Finding and deleting checkpoint garbage left by crashes (backs ``statectl checkpoint gc JOB``).

Garbage is what no valid ``_metadata`` in the job directory references: ``chk-<n>`` directories
without ``_metadata`` (aborted or crashed before completing), directories of checkpoints that
were subsumed but not deleted, and ``shared/`` files no checkpoint uses. The ``shared/`` and
``taskowned/`` directories themselves always stay, and nothing in ``taskowned/`` is ever deleted:
as in Flink, TaskManagers own what is there, and only they know when it is no longer needed. The
plan is conservative: a checkpoint in progress (with the ``shared/chk-<n>/`` files it uploads), a
valid checkpoint the store does not know, and anything an unreadable ``_metadata`` might
reference are kept, each with the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from keyedstate.common.errors import CorruptCheckpointError, StorageError
from keyedstate.common.storage import CheckpointStorage
from keyedstate.jobmanager.checkpoint import _paths
from keyedstate.jobmanager.checkpoint.completed import CompletedCheckpoint
from keyedstate.jobmanager.checkpoint.failure import CheckpointNotFoundError
from keyedstate.jobmanager.checkpoint.metadata import CheckpointMetadata
from keyedstate.jobmanager.checkpoint.restore import load_checkpoint

logger = logging.getLogger(__name__)


TASKOWNED_KEPT = "TaskManagers own taskowned/: gc never deletes it or anything in it"


class GcEntry(NamedTuple):
    path: str
    why: str
    is_dir: bool = False


@dataclass(frozen=True)
class GcPlan:
    job_dir: str
    remove: list[GcEntry] = field(default_factory=list)
    keep: list[GcEntry] = field(default_factory=list)

    def describe(self) -> str:
        """The plan as ``statectl checkpoint gc --dry-run`` prints it."""
        lines = [f"garbage in {self.job_dir}: {len(self.remove)} to remove, {len(self.keep)} kept"]
        lines += [f"  remove {e.path}{'/' if e.is_dir else ''}  ({e.why})" for e in self.remove]
        lines += [f"  keep   {e.path}{'/' if e.is_dir else ''}  ({e.why})" for e in self.keep]
        return "\n".join(lines)


def plan_gc(
    storage: CheckpointStorage,
    job_dir: str,
    retained: Sequence[CompletedCheckpoint | CheckpointMetadata] = (),
    in_progress_ids: Iterable[int] = (),
    *,
    num_retained: int | None = None,
    protected: Iterable[str] = (),
) -> GcPlan:
    """Work out what can be deleted under ``job_dir`` without touching any retained checkpoint.

    ``retained`` are the checkpoints the JobManager's store holds; valid checkpoints older than
    the oldest of them count as subsumed. Without ``retained`` (offline use), ``num_retained``
    keeps that many of the newest valid checkpoints; with neither, every valid one is kept.
    ``protected`` checkpoint directories (one the job was restored from under NO_CLAIM: the
    user's) are kept with every file they reference, however old.
    References are always read from the ``_metadata`` files in storage, not from memory.
    """
    job_dir = _paths.normalize(job_dir)
    in_progress = set(in_progress_ids)
    retained_ids = {r.checkpoint_id for r in retained if not _is_savepoint(r)}
    plan = GcPlan(job_dir)
    checkpoint_dirs, pools = _list_job_dir(storage, job_dir, plan)
    valid, unreadable = _load_checkpoints(storage, checkpoint_dirs, in_progress, retained_ids, plan)
    users = {_paths.normalize(p) for p in protected}
    references = _keep_checkpoints(checkpoint_dirs, valid, retained_ids, num_retained, plan, users)
    for pool in sorted(pools):
        _sweep_pool(storage, pool, references, unreadable, in_progress, plan)
    return plan


def _list_job_dir(storage: CheckpointStorage, job_dir: str, plan: GcPlan) -> tuple[dict[int, str], list[str]]:
    """The job directory's ``chk-<n>`` directories by id and its file pools; anything else is kept."""
    checkpoint_dirs: dict[int, str] = {}
    pools: list[str] = []
    for info in storage.list(job_dir):
        entry_name = _paths.name(info.path)
        cid = _paths.parse_checkpoint_dir_name(entry_name)
        if info.is_dir and cid is not None:
            checkpoint_dirs[cid] = _paths.normalize(info.path)
        elif info.is_dir and entry_name == _paths.SHARED_DIR:
            pools.append(_paths.normalize(info.path))
        elif info.is_dir and entry_name == _paths.TASKOWNED_DIR:
            plan.keep.append(GcEntry(_paths.normalize(info.path), TASKOWNED_KEPT, True))
        else:
            plan.keep.append(GcEntry(_paths.normalize(info.path), "not a checkpoint directory", info.is_dir))
    return checkpoint_dirs, pools


def _load_checkpoints(
    storage: CheckpointStorage,
    checkpoint_dirs: dict[int, str],
    in_progress: set[int],
    retained_ids: set[int],
    plan: GcPlan,
) -> tuple[dict[int, CheckpointMetadata], list[int]]:
    """The readable ``_metadata`` by checkpoint id, and the ids whose ``_metadata`` is unreadable."""
    valid: dict[int, CheckpointMetadata] = {}
    unreadable: list[int] = []
    for cid, path in sorted(checkpoint_dirs.items()):
        if cid in in_progress:
            plan.keep.append(GcEntry(path, f"checkpoint {cid} is in progress", True))
            continue
        try:
            valid[cid] = load_checkpoint(storage, path)
        except CheckpointNotFoundError:
            if cid in retained_ids:
                plan.keep.append(GcEntry(path, f"retained checkpoint {cid} (its _metadata is missing!)", True))
            else:
                plan.remove.append(GcEntry(path, "no _metadata: aborted or crashed before completing", True))
        except CorruptCheckpointError as exc:
            unreadable.append(cid)
            plan.keep.append(GcEntry(path, f"unreadable _metadata, inspect it by hand: {exc.message}", True))
    return valid, unreadable


def _keep_checkpoints(
    checkpoint_dirs: dict[int, str],
    valid: dict[int, CheckpointMetadata],
    retained_ids: set[int],
    num_retained: int | None,
    plan: GcPlan,
    protected: set[str],
) -> dict[str, list[int]]:
    """Keep or remove each valid checkpoint; the pool files the kept ones reference, with who references them."""
    ids = sorted(valid)
    if retained_ids:
        oldest = min(retained_ids)
        subsumed = {cid for cid in ids if cid < oldest and cid not in retained_ids}
    elif num_retained is not None:
        subsumed = set(ids[: max(0, len(ids) - num_retained)])
    else:
        subsumed = set()
    references: dict[str, list[int]] = {}
    for cid in ids:
        path = checkpoint_dirs[cid]
        if path in protected:
            why = f"checkpoint {cid} was restored from with claim mode NO_CLAIM: the user's, never deleted by the job"
            plan.keep.append(GcEntry(path, why, True))
            for _, _, f in valid[cid].files():
                references.setdefault(_paths.join(path, f.path), []).append(cid)
            continue
        if cid in subsumed:
            plan.remove.append(GcEntry(path, f"checkpoint {cid} was subsumed by newer retained checkpoints", True))
            continue
        why = (
            f"retained checkpoint {cid}"
            if cid in retained_ids or not retained_ids
            else f"valid checkpoint {cid} not in the store (kept to be safe)"
        )
        plan.keep.append(GcEntry(path, why, True))
        for _, _, f in valid[cid].files():
            references.setdefault(_paths.join(path, f.path), []).append(cid)
    return references


def _sweep_pool(
    storage: CheckpointStorage,
    pool: str,
    references: dict[str, list[int]],
    unreadable: list[int],
    in_progress: set[int],
    plan: GcPlan,
) -> None:
    """Keep the pool's referenced files (and any a checkpoint in progress or unreadable may own); remove the rest."""
    for info in storage.list(pool, recursive=True):
        if info.is_dir:
            continue
        path = _paths.normalize(info.path)
        users = references.get(path)
        if users:
            plan.keep.append(
                GcEntry(
                    path,
                    "referenced by " + ", ".join(f"chk-{c}" for c in users[:3]) + (" …" if len(users) > 3 else ""),
                )
            )
        elif unreadable:
            plan.keep.append(GcEntry(path, f"an unreadable _metadata (chk-{unreadable[0]}) may reference it"))
        elif (group := _upload_group(pool, path)) is not None:
            # shared/chk-<n>/ holds what checkpoint n uploaded: only n itself can still claim it.
            if group in in_progress:
                plan.keep.append(GcEntry(path, f"uploaded for checkpoint {group}, which is in progress"))
            else:
                plan.remove.append(
                    GcEntry(
                        path,
                        f"not referenced by any valid _metadata (uploaded for checkpoint "
                        f"{group}, which did not complete or was subsumed)",
                    )
                )
        elif in_progress:
            plan.keep.append(
                GcEntry(
                    path,
                    f"checkpoint(s) {sorted(in_progress)} in progress may own it; "
                    "run gc again when none is in progress",
                )
            )
        else:
            plan.remove.append(GcEntry(path, "not referenced by any valid _metadata"))


def execute(storage: CheckpointStorage, plan: GcPlan) -> list[str]:
    """Delete everything in ``plan.remove`` (directories first); return what was deleted.

    Raises StorageError naming the first path that could not be deleted, after trying them all.
    """
    deleted: list[str] = []
    failed: list[tuple[str, BaseException]] = []
    for entry in sorted(plan.remove, key=lambda e: not e.is_dir):
        try:
            if entry.is_dir:
                storage.delete_dir(entry.path)
            else:
                storage.delete(entry.path)
            deleted.append(entry.path)
            logger.info("gc: deleted %s (%s)", entry.path, entry.why)
        except Exception as exc:
            failed.append((entry.path, exc))
    if failed:
        first_path, first_exc = failed[0]
        raise StorageError(
            f"gc deleted {len(deleted)} of {len(plan.remove)} paths; could not delete {first_path}: {first_exc}"
            + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else "")
            + "; run gc again"
        ) from first_exc
    return deleted


def _is_savepoint(item: CompletedCheckpoint | CheckpointMetadata) -> bool:
    return item.savepoint


def _upload_group(pool: str, path: str) -> int | None:
    """The checkpoint id of a ``shared/chk-<n>/<file>`` path (None for other layouts, such as flat names)."""
    relative = _paths.relative_to(path, pool)
    if relative is None or _paths.name(pool) != _paths.SHARED_DIR or "/" not in relative:
        return None
    return _paths.parse_checkpoint_dir_name(relative.split("/", 1)[0])
