"""Durable job records (Flink's ``JobGraphStore`` plus its job result store).

A record holds what a restarted JobManager needs to bring a job back: the spec it was
submitted with (operators, states, max parallelism, per-job config), the path it was first
restored from, its status, the routing version clients have seen and the restarts used.
Terminal jobs keep their record so ``statectl job info`` still shows why a job failed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from keyedstate.common.errors import CorruptCheckpointError
from keyedstate.common.storage import CheckpointStorage

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


@dataclass(frozen=True)
class JobRecord:
    spec: dict[str, Any]  # JobSpec.to_dict()
    status: str
    routing_version: int
    restarts: int = 0
    failure_cause: str = ""
    restore_path: str = ""  # the checkpoint or savepoint the job was submitted or last restored from
    # The TaskManagers that may host the job's latest deployment (recorded before it is deployed):
    # a new leader redeploys only once each of them is fenced.
    taskmanagers: list[str] = field(default_factory=list)
    # Job.checkpoints_from (0 in records written before it existed: any checkpoint may be taken back).
    checkpoints_from: int = 0
    # How the job was restored from restore_path (RecoveryClaimMode; NO_CLAIM in records written before it existed).
    claim_mode: str = "NO_CLAIM"
    # Job.changelog_generation (overlapped commits; 0 in records written before it existed).
    changelog_generation: int = 0

    @property
    def job_id(self) -> str:
        return str(self.spec["job_id"])

    def to_bytes(self) -> bytes:
        """The record as versioned JSON (``job.json``)."""
        return json.dumps({"format_version": FORMAT_VERSION, **asdict(self)}, indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> JobRecord:
        """Parse a ``job.json``; raises CorruptCheckpointError (naming ``where``) if unreadable or of another version."""
        try:
            raw = json.loads(data)
            version = raw.pop("format_version")
            if version != FORMAT_VERSION:
                raise ValueError(f"format_version {version} is not {FORMAT_VERSION}")
            return cls(**raw)
        except (ValueError, TypeError, KeyError) as exc:
            raise CorruptCheckpointError(
                f"job record {where} is unreadable ({exc}); restore the job by hand with "
                "`statectl job restore` from its latest checkpoint, then delete the record"
            ) from exc


class JobStore:
    def __init__(self, storage: CheckpointStorage, jobs_dir: str, fence: Callable[[], None]) -> None:
        self._storage = storage
        self._dir = jobs_dir.rstrip("/")
        self._fence = fence

    def job_dir(self, job_id: str) -> str:
        return f"{self._dir}/{job_id}"

    def put(self, record: JobRecord) -> None:
        """Write the record's ``job.json``, replacing any earlier one.

        Fenced: raises LeadershipLostError once a newer leader exists.
        """
        self._fence()
        self._storage.write_bytes(f"{self.job_dir(record.job_id)}/job.json", record.to_bytes())

    def records(self) -> list[JobRecord]:
        """Every readable record; an unreadable one is logged and skipped (the others still recover)."""
        out = []
        for info in self._storage.list(self._dir):
            if not info.is_dir:
                continue
            path = f"{info.path.rstrip('/')}/job.json"
            try:
                out.append(JobRecord.from_bytes(self._storage.read_bytes(path), path))
            except FileNotFoundError:
                continue
            except CorruptCheckpointError as exc:
                logger.error("high availability: %s", exc.message)
        return out
