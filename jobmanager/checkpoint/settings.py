"""The ``execution.checkpointing.*`` settings of one job (Flink's ``CheckpointCoordinatorConfiguration``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from keyedstate.common.config import Configuration
from keyedstate.common.config import options as o
from keyedstate.common.errors import ConfigError

logger = logging.getLogger(__name__)

_MIN_INTERVAL_MS = 10


@dataclass(frozen=True)
class CheckpointingSettings:
    """The ``execution.checkpointing.*`` settings of one job."""

    interval_ms: int | None = None
    """Periodic trigger interval; None disables periodic checkpoints."""
    timeout_ms: int = 10 * 60_000
    max_concurrent: int = 1
    min_pause_ms: int = 0
    tolerable_failures: int = 0
    num_retained: int = 1
    incremental: bool = False
    changelog: bool = False
    """Changelog checkpoints (``state.changelog.enabled``): slots checkpoint a materialization plus segments."""
    inline_max_state_size: int = 0
    """> 0: checkpoints live in the JobManager's memory (``execution.checkpointing.storage: jobmanager``),
    TaskManagers send their files inline, each slot's at most this many bytes. 0: files in storage."""

    def __post_init__(self) -> None:
        if self.interval_ms is not None and self.interval_ms < _MIN_INTERVAL_MS:
            raise ConfigError(
                f"{o.CHECKPOINT_INTERVAL.key}: must be at least {_MIN_INTERVAL_MS} ms, got {self.interval_ms} ms; "
                "leave it unset to disable periodic checkpoints"
            )
        if self.timeout_ms < 1:
            raise ConfigError(f"{o.CHECKPOINT_TIMEOUT.key}: must be positive, got {self.timeout_ms} ms")
        for key, value, minimum in (
            (o.CHECKPOINT_MAX_CONCURRENT.key, self.max_concurrent, 1),
            (o.CHECKPOINT_MIN_PAUSE.key, self.min_pause_ms, 0),
            (o.CHECKPOINT_TOLERABLE_FAILURES.key, self.tolerable_failures, 0),
            (o.CHECKPOINT_NUM_RETAINED.key, self.num_retained, 1),
        ):
            if value < minimum:
                raise ConfigError(f"{key}: must be at least {minimum}, got {value}")

    @classmethod
    def from_config(cls, conf: Configuration) -> CheckpointingSettings:
        """The settings ``conf`` gives; ConfigError for JobManager storage under high availability."""
        in_memory = o.checkpoints_in_jobmanager_memory(conf)
        incremental = conf.get(o.CHECKPOINT_INCREMENTAL)
        if in_memory and incremental:
            # As in Flink, a memory-held checkpoint is always complete: there is no shared/ to refer to.
            logger.info(
                "%s is ignored with %s: jobmanager; every checkpoint holds the whole state",
                o.CHECKPOINT_INCREMENTAL.key,
                o.CHECKPOINT_STORAGE.key,
            )
        return cls(
            interval_ms=conf.get(o.CHECKPOINT_INTERVAL),
            timeout_ms=conf.get(o.CHECKPOINT_TIMEOUT),
            max_concurrent=conf.get(o.CHECKPOINT_MAX_CONCURRENT),
            min_pause_ms=conf.get(o.CHECKPOINT_MIN_PAUSE),
            tolerable_failures=conf.get(o.CHECKPOINT_TOLERABLE_FAILURES),
            num_retained=conf.get(o.CHECKPOINT_NUM_RETAINED),
            incremental=incremental and not in_memory,
            changelog=conf.get(o.CHANGELOG_ENABLED),
            inline_max_state_size=conf.get(o.JOBMANAGER_STORAGE_MAX_STATE_SIZE) if in_memory else 0,
        )

    @property
    def periodic(self) -> bool:
        return self.interval_ms is not None


def refuse_unavailable(conf: Configuration) -> None:
    """Refuse a job asking for a checkpointing combination this version cannot run, instead of ignoring it.

    Changelog checkpoints upload segments to the job's ``shared/`` directory in checkpoint
    storage, where the shared-state registry, retention and gc count them with the SST files:
    checkpoints kept in the JobManager's memory have no such directory, and a separate segment
    base path is not offered.
    """
    if not conf.get(o.CHANGELOG_ENABLED):
        return
    if conf.get(o.CHECKPOINT_STORAGE) == "jobmanager":
        raise ConfigError(
            f"{o.CHANGELOG_ENABLED.key}: changelog checkpoints need checkpoint files, and "
            f"{o.CHECKPOINT_STORAGE.key}: jobmanager keeps checkpoints in the JobManager's memory; set "
            f"{o.CHECKPOINT_STORAGE.key}: filesystem with state.checkpoints.dir, or remove {o.CHANGELOG_ENABLED.key}"
        )
    if conf.get(o.CHANGELOG_BASE_PATH):
        raise ConfigError(
            f"{o.CHANGELOG_BASE_PATH.key}: changelog segments are uploaded to the job's shared/ directory under "
            "state.checkpoints.dir, where retention and gc count them with the snapshot files; remove the key"
        )


def validate_commit_mode(conf: Configuration) -> None:
    """Refuse ``execution.checkpointing.commit-mode: overlapped`` where it cannot keep its promise.

    An overlapped commit is durable once its change sets and decision are in checkpoint storage,
    so it needs files that outlive the JobManager: filesystem checkpoint storage with a directory.
    """
    if conf.get(o.CHECKPOINT_COMMIT_MODE) != "overlapped":
        return
    if o.checkpoints_in_jobmanager_memory(conf) or not conf.get(o.CHECKPOINTS_DIR):
        raise ConfigError(
            f"{o.CHECKPOINT_COMMIT_MODE.key}: overlapped commits keep every epoch's change sets and decision in "
            f"checkpoint storage; set {o.CHECKPOINT_STORAGE.key}: filesystem with {o.CHECKPOINTS_DIR.key}, or use "
            "commit-mode sync"
        )
