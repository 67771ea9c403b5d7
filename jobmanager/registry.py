"""The registry of TaskManagers: registrations, heartbeats, loss detection, slot occupancy."""

from __future__ import annotations

import enum
import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import Callable

from keyedstate.common.clock import Clock, Scheduler
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.ids import SubtaskId, validate_id

logger = logging.getLogger(__name__)


class TaskManagerStatus(enum.Enum):
    ACTIVE = "ACTIVE"
    LOST = "LOST"


@dataclass
class TaskManagerRecord:
    taskmanager_id: str
    address: str
    host: str
    num_slots: int
    backend: str
    metrics_port: int
    last_heartbeat_ms: int
    status: TaskManagerStatus = TaskManagerStatus.ACTIVE
    # slot index -> the subtask the JobManager placed there (None: free)
    occupancy: list[SubtaskId | None] = field(default_factory=list)

    def free_slots(self) -> list[int]:
        return [i for i, s in enumerate(self.occupancy) if s is None]


LostListener = Callable[[TaskManagerRecord, str], None]


class TaskManagerRegistry:
    """Tracks TaskManagers. A TaskManager is lost when its heartbeats stop for the timeout."""

    def __init__(self, clock: Clock, scheduler: Scheduler, heartbeat_timeout_ms: int, check_interval_ms: int) -> None:
        self._clock = clock
        self._scheduler = scheduler
        self._timeout = heartbeat_timeout_ms
        self._check_interval = check_interval_ms
        self._records: dict[str, TaskManagerRecord] = {}
        self._lock = threading.RLock()
        self._listeners: list[LostListener] = []
        self.session = uuid.uuid4().hex[:12]
        self._stopped = False
        self._timer = None

    def add_lost_listener(self, listener: LostListener) -> None:
        self._listeners.append(listener)

    def start(self) -> None:
        self._schedule_check()

    def stop(self) -> None:
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()

    def register(self, taskmanager_id: str, address: str, host: str, num_slots: int, backend: str, metrics_port: int) -> tuple[TaskManagerRecord, TaskManagerRecord | None]:
        """Register (or re-register) a TaskManager. Returns the record and the replaced one, if any."""
        validate_id("taskmanager id", taskmanager_id)
        if num_slots < 1:
            raise InvalidArgumentError(f"TaskManager {taskmanager_id} offers {num_slots} slots; it must offer at least 1")
        if not address or ":" not in address:
            raise InvalidArgumentError(f"TaskManager {taskmanager_id} sent address {address!r}; expected host:port")
        with self._lock:
            previous = self._records.get(taskmanager_id)
            record = TaskManagerRecord(
                taskmanager_id, address, host, num_slots, backend, metrics_port, self._clock.monotonic_ms(),
                occupancy=[None] * num_slots,
            )
            self._records[taskmanager_id] = record
        logger.info("registered taskmanager %s at %s with %d slots", taskmanager_id, address, num_slots)
        return record, previous

    def heartbeat(self, taskmanager_id: str) -> bool:
        with self._lock:
            record = self._records.get(taskmanager_id)
            if record is None or record.status is TaskManagerStatus.LOST:
                return False
            record.last_heartbeat_ms = self._clock.monotonic_ms()
            return True

    def deregister(self, taskmanager_id: str) -> None:
        self.mark_lost(taskmanager_id, "deregistered (shut down)")

    def mark_lost(self, taskmanager_id: str, cause: str, only: TaskManagerRecord | None = None) -> None:
        """Remove the TaskManager and tell the listeners; with ``only``, just if that registration is current."""
        with self._lock:
            record = self._records.get(taskmanager_id)
            if record is None or record.status is TaskManagerStatus.LOST or (only is not None and record is not only):
                return
            record.status = TaskManagerStatus.LOST
            del self._records[taskmanager_id]
        logger.warning("taskmanager %s at %s lost: %s", taskmanager_id, record.address, cause)
        for listener in self._listeners:
            try:
                listener(record, cause)
            except Exception:
                logger.exception("lost-taskmanager listener failed")

    def check_heartbeats(self) -> list[str]:
        now = self._clock.monotonic_ms()
        with self._lock:
            expired = [r.taskmanager_id for r in self._records.values() if now - r.last_heartbeat_ms > self._timeout]
        for tm_id in expired:
            self.mark_lost(tm_id, f"no heartbeat for {self._timeout} ms (heartbeat.timeout)")
        return expired

    def _schedule_check(self) -> None:
        if self._stopped:
            return

        def run() -> None:
            try:
                self.check_heartbeats()
            finally:
                self._schedule_check()

        self._timer = self._scheduler.schedule(self._check_interval, run)

    # -- slots -------------------------------------------------------------------------------
    def get(self, taskmanager_id: str) -> TaskManagerRecord | None:
        with self._lock:
            return self._records.get(taskmanager_id)

    def all(self) -> list[TaskManagerRecord]:
        with self._lock:
            return sorted(self._records.values(), key=lambda r: r.taskmanager_id)

    def occupy(self, taskmanager_id: str, slot_index: int, subtask: SubtaskId | None) -> None:
        with self._lock:
            record = self._records.get(taskmanager_id)
            if record is not None and 0 <= slot_index < record.num_slots:
                record.occupancy[slot_index] = subtask

    def free_if(self, taskmanager_id: str, slot_index: int, subtask: SubtaskId) -> None:
        """Free a slot if it still holds ``subtask`` (a late release must not free a reused slot)."""
        with self._lock:
            record = self._records.get(taskmanager_id)
            if record is not None and 0 <= slot_index < record.num_slots and record.occupancy[slot_index] == subtask:
                record.occupancy[slot_index] = None

    def hosts_job(self, job_id: str) -> bool:
        """True while some registered TaskManager's slot is still marked with a subtask of ``job_id``."""
        with self._lock:
            return any(s is not None and s.job_id == job_id for r in self._records.values() for s in r.occupancy)

    def free_slot_count(self) -> int:
        with self._lock:
            return sum(len(r.free_slots()) for r in self._records.values())

    def total_slot_count(self) -> int:
        with self._lock:
            return sum(r.num_slots for r in self._records.values())

    @property
    def lock(self) -> threading.RLock:
        return self._lock
