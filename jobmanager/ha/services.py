"""The JobManager's high-availability services: ``none`` (standalone) or ``filesystem``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from keyedstate.common.config import Configuration
from keyedstate.common.config import options as o
from keyedstate.common.errors import ConfigError
from keyedstate.common.ids import validate_id
from keyedstate.common.storage import CheckpointStorage
from keyedstate.jobmanager.checkpoint.completed import CompletedCheckpointStore, StandaloneCompletedCheckpointStore
from keyedstate.jobmanager.checkpoint.id_counter import CheckpointIDCounter, StandaloneCheckpointIDCounter
from keyedstate.jobmanager.ha.checkpoint_store import CheckpointPointer, DurableCompletedCheckpointStore
from keyedstate.jobmanager.ha.id_counter import DurableCheckpointIDCounter
from keyedstate.jobmanager.ha.job_store import JobRecord, JobStore
from keyedstate.jobmanager.ha.leader import LeadershipLease

logger = logging.getLogger(__name__)


class HighAvailabilityServices(Protocol):
    @property
    def enabled(self) -> bool:
        """True when job records, checkpoint pointers and ids outlive the JobManager process (``filesystem``)."""

    @property
    def leader_session(self) -> int:
        """The leadership session number (grows with every new leader; 0 without high availability)."""

    def start(self, address: str, on_lost: Callable[[str], None]) -> None:
        """Take leadership (``filesystem``: a new session, fencing every older JobManager)."""

    def checkpoint_id_counter(self, job_id: str, floor: int = 1) -> CheckpointIDCounter:
        """The job's checkpoint id counter, starting no lower than ``floor``.

        Durable under ``filesystem``, so no id is handed out twice across leaders.
        """

    def completed_checkpoint_store(self, job_id: str, num_retained: int) -> CompletedCheckpointStore:
        """The job's store of completed checkpoints, keeping the latest ``num_retained`` (savepoints aside).

        Under ``filesystem`` it also writes a pointer per retained checkpoint, for the next leader.
        """

    def checkpoint_pointers(self, job_id: str) -> list[CheckpointPointer]:
        """Pointers to the job's retained checkpoints a previous leader left, oldest first (none without HA).

        Recovery restores from the newest one that still loads.
        """

    def remove_checkpoint_pointer(self, job_id: str, checkpoint_id: int) -> None:
        """Forget the pointer to a checkpoint that cannot be loaded any more (recovery fell back past it)."""

    def put_job(self, record: JobRecord) -> None:
        """Persist the job's record so that a new leader recovers the job (a no-op without high availability)."""

    def job_records(self) -> list[JobRecord]:
        """Every readable job record, for recovery after a leader change (empty without high availability)."""

    def close(self) -> None:
        """Release the services; stored records and pointers stay for the next leader."""


class StandaloneHaServices:
    """``high-availability.type: none``: everything lives in the JobManager process and dies with it."""

    enabled = False
    leader_session = 0

    def start(self, address: str, on_lost: Callable[[str], None]) -> None:
        """Nothing to take: a standalone JobManager is always the leader, and ``on_lost`` is never called."""

    def checkpoint_id_counter(self, job_id: str, floor: int = 1) -> CheckpointIDCounter:
        """An in-memory counter from ``max(1, floor)``; ids start over when the process does."""
        return StandaloneCheckpointIDCounter(max(1, floor))

    def completed_checkpoint_store(self, job_id: str, num_retained: int) -> CompletedCheckpointStore:
        """An in-memory store of the latest ``num_retained`` checkpoints, lost with the process."""
        return StandaloneCompletedCheckpointStore(num_retained)

    def checkpoint_pointers(self, job_id: str) -> list[CheckpointPointer]:
        """Always empty: nothing of a standalone JobManager survives it."""
        return []

    def remove_checkpoint_pointer(self, job_id: str, checkpoint_id: int) -> None:
        pass

    def put_job(self, record: JobRecord) -> None:
        pass

    def job_records(self) -> list[JobRecord]:
        """Always empty: a standalone JobManager recovers no jobs."""
        return []

    def close(self) -> None:
        pass


class FileSystemHaServices:
    """``high-availability.type: filesystem``: see :mod:`keyedstate.jobmanager.ha`."""

    enabled = True

    def __init__(self, storage: CheckpointStorage, root: str, lease_check_interval_ms: int) -> None:
        self.root = root.rstrip("/")
        self._storage = storage
        self._interval = lease_check_interval_ms
        self._lease = LeadershipLease(storage, f"{self.root}/leader", address="")
        self._jobs = JobStore(storage, f"{self.root}/jobs", self._lease.check)

    def start(self, address: str, on_lost: Callable[[str], None]) -> None:
        """Take the leadership lease for ``address`` (a new session, fencing older JobManagers) and watch it.

        The lease is checked every ``lease_check_interval_ms`` on a background thread, which calls ``on_lost(message)``
        once when a newer session has taken over.
        """
        self._lease.acquire(address)
        self._lease.watch(self._interval, on_lost)

    @property
    def leader_session(self) -> int:
        """This JobManager's leadership session (meaningful after :meth:`start`)."""
        return self._lease.session

    def _job_dir(self, job_id: str) -> str:
        return self._jobs.job_dir(validate_id("job id", job_id))

    def checkpoint_id_counter(self, job_id: str, floor: int = 1) -> CheckpointIDCounter:
        """A durable counter in ``<job dir>/checkpoint-counter``.

        Fenced: raises LeadershipLostError once a newer leader exists.
        """
        return DurableCheckpointIDCounter(
            self._storage, f"{self._job_dir(job_id)}/checkpoint-counter", self._lease.check, floor
        )

    def completed_checkpoint_store(self, job_id: str, num_retained: int) -> CompletedCheckpointStore:
        """A store that writes one pointer per retained checkpoint under ``<job dir>/checkpoints``; fenced by the lease."""
        return self._pointers(job_id, num_retained)

    def _pointers(self, job_id: str, num_retained: int = 1) -> DurableCompletedCheckpointStore:
        return DurableCompletedCheckpointStore(
            self._storage, f"{self._job_dir(job_id)}/checkpoints", num_retained, self._lease.check
        )

    def checkpoint_pointers(self, job_id: str) -> list[CheckpointPointer]:
        """The pointers under ``<job dir>/checkpoints``, oldest first; unreadable ones are logged and skipped."""
        return self._pointers(job_id).pointers()

    def remove_checkpoint_pointer(self, job_id: str, checkpoint_id: int) -> None:
        """Delete the pointer of ``checkpoint_id``; fenced: raises LeadershipLostError once a newer leader exists."""
        self._pointers(job_id).remove_pointer(checkpoint_id)

    def put_job(self, record: JobRecord) -> None:
        """Write the job's ``job.json``; fenced: raises LeadershipLostError once a newer leader exists."""
        self._jobs.put(record)

    def job_records(self) -> list[JobRecord]:
        """Every readable ``job.json`` under the jobs directory; an unreadable one is logged and skipped."""
        return self._jobs.records()

    def close(self) -> None:
        """Stop the lease watcher; the session is not given up (a successor fences it by starting a newer one)."""
        self._lease.close()


def create_ha_services(
    conf: Configuration, storage_for: Callable[[str], CheckpointStorage]
) -> HighAvailabilityServices:
    kind = conf.get(o.HA_TYPE)
    if kind == "none":
        return StandaloneHaServices()
    storage_dir = conf.get(o.HA_STORAGE_DIR)
    if not storage_dir:
        raise ConfigError(
            "high-availability.type is filesystem but high-availability.storageDir is not set; set it to a durable "
            "directory the JobManager can reach after a restart (for example s3://bucket/ha or file:///var/lib/keyedstate/ha)"
        )
    cluster_id = o.cluster_id(conf)
    root = f"{storage_dir.rstrip('/')}/{cluster_id}"
    logger.info("high availability: filesystem at %s", root)
    return FileSystemHaServices(storage_for(root), root, conf.get(o.HA_LEASE_CHECK_INTERVAL))
