"""The registry of TaskManagers: registrations, heartbeats, loss detection, slot occupancy."""

from __future__ import annotations

import enum
import logging
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from keyedstate.common.clock import Cancellable, Clock, Scheduler
from keyedstate.common.config.options import MAX_TASK_SLOTS
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.ids import JobId, SubtaskId, TaskManagerId, validate_id
from keyedstate.common.lease import lease_bound_ms as lease_bound
from keyedstate.common.lease import lease_duration_ms as lease_duration

logger = logging.getLogger(__name__)


def check_address(who: str, what: str, address: str) -> None:
    """``address`` must be ``host:port`` with a port in 1..65535 and a host of printable characters.

    The JobManager connects to it (and resolves the host): garbage such as ``:::::`` or ``0`` took
    slots and failed every deploy, and sent the host to the DNS resolver.
    """
    host, sep, port = address.rpartition(":")
    if not (
        sep
        and host
        and port.isdigit()
        and 1 <= int(port) <= 65535
        and host.isprintable()
        and " " not in host
        and len(address) <= 300
    ):
        raise InvalidArgumentError(f"{who} sent {what} {address[:100]!r}; expected host:port with a port in 1..65535")


@dataclass(frozen=True)
class ReportedLimits:
    """The size limits (``state.limits.*``) a TaskManager enforces, as it reported them; 0: not reported."""

    max_key_bytes: int = 0
    max_value_bytes: int = 0
    max_list_elements: int = 0


@dataclass(frozen=True)
class SlotReport:
    """What a TaskManager says one of its slots hosts (``subtask`` None: the slot is free)."""

    slot_index: int
    subtask: SubtaskId | None = None


@dataclass(frozen=True)
class TaskManagerRegistration:
    """What a TaskManager says when it registers (or registers again)."""

    taskmanager_id: TaskManagerId
    address: str
    """host:port of its client plane (the address in routing tables)."""
    host: str
    num_slots: int
    backend: str
    metrics_port: int
    limits: ReportedLimits | None
    """None: it did not say."""
    internal_address: str
    """host:port of its internal plane ("": the same as ``address``)."""
    cluster_id: str
    """Its ``high-availability.cluster-id`` ("": the default cluster)."""
    slots: tuple[SlotReport, ...] = ()
    """What it still hosts (after a restart of either side, or a partition)."""
    slot_addresses: tuple[str, ...] = ()
    """host:port serving each slot's state calls (``taskmanager.slot-processes`` > 1); empty: ``address``."""
    slot_processes: tuple[SlotProcessReport, ...] = ()
    """Its slot processes by index; empty: it serves every slot itself."""


@dataclass(frozen=True)
class SlotProcessReport:
    """One slot process of a TaskManager (``taskmanager.slot-processes`` > 1), as it registered it."""

    index: int
    """Slot ``i`` is served by the process with index ``i`` mod the process count."""
    address: str
    """host:port serving its slots' KeyedState calls."""
    pid: int
    """On the TaskManager's host; 0: being replaced when the TaskManager registered."""


@dataclass(frozen=True)
class HeartbeatReport:
    """One heartbeat: who, under which JobManager session, and what each of its slots hosts."""

    taskmanager_id: TaskManagerId
    jobmanager_session: str
    slots: tuple[SlotReport, ...] = ()


class TaskManagerStatus(enum.Enum):
    ACTIVE = "ACTIVE"
    LOST = "LOST"


@dataclass
class TaskManagerRecord:
    taskmanager_id: TaskManagerId
    address: str
    host: str
    num_slots: int
    backend: str
    metrics_port: int
    last_heartbeat_ms: int
    lease_until_ms: int = 0
    """When the lease granted by the last answered heartbeat is certainly over (monotonic, this JobManager)."""
    status: TaskManagerStatus = TaskManagerStatus.ACTIVE
    # slot index -> the subtask the JobManager placed there (None: free)
    occupancy: list[SubtaskId | None] = field(default_factory=list)
    limits: ReportedLimits | None = None
    """The size limits it enforces (None: it did not say)."""
    slot_addresses: tuple[str, ...] = ()
    """host:port serving each slot (its slot processes'); empty: every slot is served on ``address``."""
    slot_processes: tuple[SlotProcessReport, ...] = ()
    """Its slot processes by index, as it last registered them (statectl shows them); empty: none."""
    offered: bool = True
    """False while its registration is decided (which reported slots it keeps): none of its slots is
    free until then, so nothing is deployed to it that the registration's answer would not know."""

    def slot_address(self, slot_index: int) -> str:
        """Where clients reach slot ``slot_index``: its slot process, or the TaskManager's client address."""
        return self.slot_addresses[slot_index] if self.slot_addresses else self.address

    def free_slots(self) -> list[int]:
        """Indexes of the slots holding no subtask; read under the registry's ``lock`` (occupancy changes under it).

        None before the registration is decided (:meth:`TaskManagerRegistry.offer`)."""
        if not self.offered:
            return []
        return [i for i, s in enumerate(self.occupancy) if s is None]


def _check_slot_processes(
    taskmanager_id: TaskManagerId, num_slots: int, slot_processes: tuple[SlotProcessReport, ...]
) -> None:
    """InvalidArgumentError unless ``slot_processes`` are indexed 0..n-1 in order, n <= num_slots, with valid addresses."""
    if len(slot_processes) > num_slots:
        raise InvalidArgumentError(
            f"TaskManager {taskmanager_id} sent {len(slot_processes)} slot processes for {num_slots} slots; "
            "taskmanager.slot-processes must be at most taskmanager.numberOfTaskSlots"
        )
    for position, process in enumerate(slot_processes):
        if process.index != position or process.pid < 0:
            raise InvalidArgumentError(
                f"TaskManager {taskmanager_id} sent slot process {process.index} (pid {process.pid}) at position "
                f"{position}; send each slot process once, in index order, with its pid (0 while it is replaced)"
            )
        check_address(f"TaskManager {taskmanager_id}", "slot process address", process.address)


LostListener = Callable[[TaskManagerRecord, str], None]


class TaskManagerRegistry:
    """Tracks TaskManagers. A TaskManager is lost when its heartbeats stop for the timeout.

    It also knows when a TaskManager is certainly *fenced* (serves nothing it was given before):
    when it registered again (it revokes its own lease before registering), deregistered after
    shutting its slots down, or once ``lease_bound_ms`` passed after the last heartbeat this
    JobManager answered. A TaskManager this JobManager never heard from may hold a lease from a
    previous JobManager until ``lease_bound_ms`` after this one started.
    """

    def __init__(
        self,
        clock: Clock,
        scheduler: Scheduler,
        heartbeat_timeout_ms: int,
        check_interval_ms: int,
        lease_bound_ms: int | None = None,
    ) -> None:
        """``lease_bound_ms``: see :func:`keyedstate.common.lease.lease_bound_ms` (default: from the timeout alone)."""
        self._clock = clock
        self._scheduler = scheduler
        self._timeout = heartbeat_timeout_ms
        self._check_interval = check_interval_ms
        self._lease_bound = (
            lease_bound_ms
            if lease_bound_ms is not None
            else lease_bound(lease_duration(heartbeat_timeout_ms, heartbeat_timeout_ms))
        )
        self._records: dict[TaskManagerId, TaskManagerRecord] = {}
        self._fenced_by: dict[TaskManagerId, int] = {}  # lost TaskManagers: when their last lease is certainly over
        self._started_ms = clock.monotonic_ms()
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._listeners: list[LostListener] = []
        self.session = uuid.uuid4().hex[:12]
        self._stopped = False
        self._timer: Cancellable | None = None

    def add_lost_listener(self, listener: LostListener) -> None:
        """Call ``listener(record, cause)`` whenever a TaskManager is lost or deregisters.

        Listeners run outside the registry's lock on the thread that noticed the loss (the heartbeat checker's, or a
        caller of :meth:`mark_lost`); an exception is logged and does not stop the others.
        """
        self._listeners.append(listener)

    def start(self) -> None:
        """Start checking heartbeats every ``check_interval_ms`` on the scheduler."""
        self._schedule_check()

    def stop(self) -> None:
        """Stop the heartbeat checks; registered TaskManagers are not marked lost."""
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()

    def register(
        self,
        taskmanager_id: TaskManagerId,
        address: str,
        host: str,
        num_slots: int,
        backend: str,
        metrics_port: int,
        limits: ReportedLimits | None = None,
        slot_addresses: tuple[str, ...] = (),
        slot_processes: tuple[SlotProcessReport, ...] = (),
        offered: bool = True,
    ) -> tuple[TaskManagerRecord, TaskManagerRecord | None]:
        """Register (or re-register) a TaskManager. Returns the record and the replaced one, if any.

        ``offered=False``: its slots are allocated only after :meth:`offer` (the caller first decides
        which of the slots the TaskManager reported it keeps).
        """
        validate_id("taskmanager id", taskmanager_id)
        if not 1 <= num_slots <= MAX_TASK_SLOTS:
            # The registry keeps one entry per slot: an unbounded count is a memory bomb.
            raise InvalidArgumentError(
                f"TaskManager {taskmanager_id} offers {num_slots} slots; taskmanager.numberOfTaskSlots must be "
                f"between 1 and {MAX_TASK_SLOTS}"
            )
        check_address(f"TaskManager {taskmanager_id}", "address", address)
        if slot_addresses and len(slot_addresses) != num_slots:
            raise InvalidArgumentError(
                f"TaskManager {taskmanager_id} sent {len(slot_addresses)} slot addresses for {num_slots} slots; "
                "send one per slot, or none when the TaskManager serves every slot on its address"
            )
        for slot_address in slot_addresses:
            check_address(f"TaskManager {taskmanager_id}", "slot address", slot_address)
        _check_slot_processes(taskmanager_id, num_slots, slot_processes)
        with self._lock:
            previous = self._records.get(taskmanager_id)
            now = self._clock.monotonic_ms()
            record = TaskManagerRecord(
                taskmanager_id,
                address,
                host,
                num_slots,
                backend,
                metrics_port,
                now,
                lease_until_ms=now + self._lease_bound,
                occupancy=[None] * num_slots,
                limits=limits,
                slot_addresses=tuple(slot_addresses),
                slot_processes=tuple(slot_processes),
                offered=offered,
            )
            self._records[taskmanager_id] = record
            # It fenced itself before registering: whatever it was given before is no longer served.
            self._fenced_by.pop(taskmanager_id, None)
            self._changed.notify_all()
        logger.info("registered taskmanager %s at %s with %d slots", taskmanager_id, address, num_slots)
        return record, previous

    def offer(self, record: TaskManagerRecord) -> None:
        """Make the free slots of ``record`` (registered with ``offered=False``) allocatable, if it is still current."""
        with self._lock:
            if self._records.get(record.taskmanager_id) is record and not record.offered:
                record.offered = True
                self._changed.notify_all()

    def heartbeat(self, taskmanager_id: TaskManagerId) -> bool:
        """Renew the TaskManager's lease; False if it is unknown or lost, and must register again."""
        with self._lock:
            record = self._records.get(taskmanager_id)
            if record is None or record.status is TaskManagerStatus.LOST:
                return False
            now = self._clock.monotonic_ms()
            record.last_heartbeat_ms = now
            record.lease_until_ms = now + self._lease_bound
            return True

    def deregister(self, taskmanager_id: TaskManagerId) -> None:
        """Mark the TaskManager lost as fenced at once (it deregisters only after closing its server and slots)."""
        # A TaskManager deregisters after it closed its server and slots: fenced.
        self.mark_lost(taskmanager_id, "deregistered (shut down)", fenced=True)

    def mark_lost(
        self, taskmanager_id: TaskManagerId, cause: str, only: TaskManagerRecord | None = None, fenced: bool = False
    ) -> None:
        """Remove the TaskManager and tell the listeners; with ``only``, just if that registration is current.

        ``fenced``: it certainly serves nothing any more. Otherwise its slots may be given to
        others only once its lease is certainly over (:meth:`wait_fenced`).
        """
        with self._lock:
            record = self._records.get(taskmanager_id)
            if record is None or record.status is TaskManagerStatus.LOST or (only is not None and record is not only):
                return
            record.status = TaskManagerStatus.LOST
            del self._records[taskmanager_id]
            self._fenced_by[taskmanager_id] = 0 if fenced else record.lease_until_ms
            self._changed.notify_all()
        logger.warning("taskmanager %s at %s lost: %s", taskmanager_id, record.address, cause)
        for listener in self._listeners:
            try:
                listener(record, cause)
            except Exception:
                logger.exception("lost-taskmanager listener failed")

    def check_heartbeats(self) -> list[TaskManagerId]:
        """Mark lost every TaskManager silent for longer than the heartbeat timeout; returns their ids.

        Runs every ``check_interval_ms`` after :meth:`start`, on the scheduler's thread.
        """
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

    # -- fencing -----------------------------------------------------------------------------
    def fenced_at_ms(self, taskmanager_id: TaskManagerId) -> int:
        """When ``taskmanager_id`` certainly serves nothing it was given before (monotonic ms; 0: already).

        A registered TaskManager counts as fenced: its previous slots were released by a call it
        answered, or it registered again since (callers declare a TaskManager lost when a
        release fails, so this holds).
        """
        with self._lock:
            if taskmanager_id in self._records:
                return 0
            bound = self._fenced_by.get(taskmanager_id)
            if bound is not None:
                return bound
            return self._started_ms + self._lease_bound  # maybe leased by an earlier JobManager

    def wait_fenced(
        self, taskmanager_ids: Iterable[TaskManagerId], timeout_ms: int, closed: threading.Event | None = None
    ) -> list[TaskManagerId]:
        """Wait until every TaskManager named is fenced; returns those still not fenced at the timeout."""
        ids = sorted(set(taskmanager_ids))
        deadline = self._clock.monotonic_ms() + timeout_ms
        with self._changed:
            while True:
                now = self._clock.monotonic_ms()
                pending = [t for t in ids if self.fenced_at_ms(t) > now]
                if not pending or now >= deadline or (closed is not None and closed.is_set()):
                    return pending
                wake = min(deadline, *(self.fenced_at_ms(t) for t in pending))
                # Short waits: a manual clock in tests moves without notifying.
                self._changed.wait(min(0.1, max(0.001, (wake - now) / 1000.0)))

    # -- slots -------------------------------------------------------------------------------
    def get(self, taskmanager_id: TaskManagerId) -> TaskManagerRecord | None:
        """The TaskManager's current registration (None once lost); a live, mutable record: read it under ``lock``."""
        with self._lock:
            return self._records.get(taskmanager_id)

    def all(self) -> list[TaskManagerRecord]:
        """The registered TaskManagers, ordered by id (lost ones are gone)."""
        with self._lock:
            return sorted(self._records.values(), key=lambda r: r.taskmanager_id)

    def occupy(self, taskmanager_id: TaskManagerId, slot_index: int, subtask: SubtaskId | None) -> None:
        """Record ``subtask`` in the slot (None frees it); ignored for an unknown TaskManager or slot index."""
        with self._lock:
            record = self._records.get(taskmanager_id)
            if record is not None and 0 <= slot_index < record.num_slots:
                record.occupancy[slot_index] = subtask

    def free_if(self, taskmanager_id: TaskManagerId, slot_index: int, subtask: SubtaskId) -> None:
        """Free a slot if it still holds ``subtask`` (a late release must not free a reused slot)."""
        with self._lock:
            record = self._records.get(taskmanager_id)
            if record is not None and 0 <= slot_index < record.num_slots and record.occupancy[slot_index] == subtask:
                record.occupancy[slot_index] = None

    def hosts_job(self, job_id: JobId) -> bool:
        """True while some registered TaskManager's slot is still marked with a subtask of ``job_id``."""
        with self._lock:
            return any(s is not None and s.job_id == job_id for r in self._records.values() for s in r.occupancy)

    def free_slot_count(self) -> int:
        """Free slots over all registered TaskManagers."""
        with self._lock:
            return sum(len(r.free_slots()) for r in self._records.values())

    def total_slot_count(self) -> int:
        """Slots over all registered TaskManagers, free or not."""
        with self._lock:
            return sum(r.num_slots for r in self._records.values())

    @property
    def lock(self) -> threading.RLock:
        """The registry's reentrant lock: hold it to read records and pick free slots as one consistent step."""
        return self._lock
