"""``statectl checkpoint gc JOB [--dry-run] [--dir DIR]``: remove orphaned checkpoint files of one job.

Orphans are what no valid ``_metadata`` under ``<dir>/<JOB>`` references: ``chk-<n>``
directories without ``_metadata`` and ``shared/`` files no checkpoint uses (see
:mod:`keyedstate.jobmanager.checkpoint.gc`); ``taskowned/`` belongs to the TaskManagers and is kept. Every valid checkpoint is kept: which ones the
JobManager still retains is not known offline, and a kept checkpoint costs only space.

When the JobManager answers, checkpoints it reports in progress are protected (with them, every
``shared/`` file). The plan is made again until the JobManager triggered and finished nothing
while it was made, so a checkpoint that starts or completes meanwhile never loses a file to gc;
one that starts later uploads only files the plan does not name. Without a reachable
JobManager the job is assumed idle (a stopped JobManager completes no checkpoint).
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass

from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.config import Configuration
from keyedstate.common.config import options as o
from keyedstate.common.errors import ConfigError, KeyedStateError, NotFoundError
from keyedstate.common.storage import CheckpointStorage, open_storage, scheme_of
from keyedstate.jobmanager.checkpoint import GcEntry, GcPlan, _paths, execute, plan_gc

logger = logging.getLogger(__name__)

_PLAN_ATTEMPTS = 5
_JM_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class _JobManagerView:
    """What the JobManager says about the job's checkpoints, or why it said nothing."""

    reachable: bool
    in_progress: frozenset[int] = frozenset()
    newest_triggered: int = 0
    note: str = ""


def run_gc(args: argparse.Namespace) -> int:
    """Plan (and unless ``--dry-run``, execute) the garbage collection of ``args.job``; print every path."""
    conf = Configuration.load(args.config, args.overrides)
    base = args.dir or conf.get(o.CHECKPOINTS_DIR)
    if base and scheme_of(base) == "jobmanager":
        # Only the JobManager process sees its memory, and its retention already deletes what no
        # retained checkpoint uses: a crash there leaves nothing behind to collect.
        raise ConfigError(
            f"{base} is in a JobManager's memory (execution.checkpointing.storage: jobmanager), which statectl "
            "cannot reach and which leaves no garbage behind; gc applies to filesystem checkpoint storage"
        )
    if not base:
        raise ConfigError(
            "statectl checkpoint gc needs the checkpoint directory: pass --dir (for example s3://bucket/checkpoints) "
            "or set state.checkpoints.dir with --config/-D"
        )
    job_dir = _paths.join(_paths.normalize(base), args.job)
    storage = open_storage(job_dir, conf)
    if not any(True for _ in storage.list(job_dir)):
        jobs = sorted(_paths.name(i.path) for i in storage.list(_paths.normalize(base)) if i.is_dir)
        raise NotFoundError(
            f"nothing under {job_dir}: no checkpoints of job {args.job!r} there "
            f"(job directories in {base}: {', '.join(jobs) or 'none'}); check the job id and --dir"
        )

    plan, view = _stable_plan(args, conf, storage, job_dir)
    removed = plan.remove if args.dry_run else []
    if not args.dry_run and plan.remove:
        deleted = set(execute(storage, plan))
        removed = [e for e in plan.remove if e.path in deleted]
    _print(args, plan, removed, view)
    return 0


def _stable_plan(
    args: argparse.Namespace, conf: Configuration, storage: CheckpointStorage, job_dir: str
) -> tuple[GcPlan, _JobManagerView]:
    """A plan made while the JobManager triggered and finished nothing of the job."""
    before = _ask_jobmanager(args, conf)
    for _ in range(_PLAN_ATTEMPTS):
        plan = plan_gc(storage, job_dir, in_progress_ids=before.in_progress)
        if not before.reachable:
            return plan, before
        after = _ask_jobmanager(args, conf)
        if after == before:
            return plan, after
        logger.info("checkpoints of %s changed while planning gc (%s -> %s); planning again", args.job, before, after)
        before = after
    raise KeyedStateError(
        f"checkpoints of job {args.job!r} kept starting or completing while gc planned ({_PLAN_ATTEMPTS} attempts); "
        "run gc again when the job checkpoints less often, or while it is stopped"
    )


def _ask_jobmanager(args: argparse.Namespace, conf: Configuration) -> _JobManagerView:
    from keyedstate.common.client import ClientSettings, StateClient

    address = args.jobmanager or f"{conf.get(o.JOBMANAGER_ADDRESS)}:{conf.get(o.JOBMANAGER_PORT)}"
    timeout = min(float(getattr(args, "timeout", _JM_TIMEOUT_S) or _JM_TIMEOUT_S), _JM_TIMEOUT_S)
    client = StateClient(address, ClientSettings(timeout_s=timeout, max_attempts=1, backoff_s=0.1))
    try:
        listing = client.list_checkpoints(args.job, retry=False)
    except KeyedStateError as exc:
        return _JobManagerView(
            False,
            note=(
                f"the JobManager at {address} did not list the checkpoints of {args.job} ({exc.message}); "
                "assuming no checkpoint of it is in progress"
            ),
        )
    finally:
        client.close()
    in_progress = frozenset(
        c.checkpoint_id for c in listing.checkpoints if c.status == jm_pb.CHECKPOINT_STATUS_IN_PROGRESS
    )
    newest = max((c.checkpoint_id for c in listing.checkpoints), default=0)
    return _JobManagerView(True, in_progress, newest)


def _print(args: argparse.Namespace, plan: GcPlan, removed: list[GcEntry], view: _JobManagerView) -> None:
    def shown(e: GcEntry) -> str:
        return e.path + ("/" if e.is_dir else "")

    if args.json:
        print(
            json.dumps(
                {
                    "job_dir": plan.job_dir,
                    "dry_run": bool(args.dry_run),
                    "removed" if not args.dry_run else "would_remove": [
                        {"path": e.path, "reason": e.why, "dir": e.is_dir} for e in removed
                    ],
                    "kept": [{"path": e.path, "reason": e.why, "dir": e.is_dir} for e in plan.keep],
                    "notes": [view.note] if view.note else [],
                },
                indent=2,
                sort_keys=True,
            )
        )
        return
    if view.note:
        print(f"note: {view.note}")
    verb = "would remove" if args.dry_run else "removed"
    print(
        f"gc of {plan.job_dir}: {len(removed)} {verb}, {len(plan.keep)} kept"
        + (" (dry run: nothing was removed)" if args.dry_run else "")
    )
    for e in removed:
        print(f"  {verb}  {shown(e)}  ({e.why})")
    for e in plan.keep:
        print(f"  keep  {shown(e)}  ({e.why})")
