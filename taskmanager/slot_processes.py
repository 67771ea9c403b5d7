"""The TaskManager's slot processes (``taskmanager.slot-processes`` > 1): started, watched, replaced.

One Python process serving every slot runs on one core at a time, however many the host has
(one GIL for every call, every snapshot and every epoch commit). With N slot processes, slot
``i`` lives in process ``i mod N`` (:mod:`~keyedstate.taskmanager.slot_process`), each with its
own client port and ``1/N`` of ``taskmanager.memory.managed.size`` (and of
``state.backend.rocksdb.block.cache-size`` when set), so all of them together stay within the
TaskManager's budget. The TaskManager process keeps what is one per TaskManager: the JobManager
connection, the lease (on a page every slot process reads), the internal plane (it forwards each
TaskExecutor call to the processes that host the slots concerned) and the metrics endpoint
(it merges the processes' metrics, each sample labelled ``slot_process``).

A slot process that dies is replaced at once on a new port; the TaskManager then registers again,
so the JobManager sees the slots that process hosted gone and fails over only their jobs, and
routes the new deployments to the new port. One that cannot be replaced (it fails to start
``_REPLACE_ATTEMPTS`` times in a row) stops the TaskManager, which then exits non-zero.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from keyedstate.common.child_process import ChildProcess
from keyedstate.common.config import Configuration
from keyedstate.common.config import options as o
from keyedstate.common.errors import ConfigError, InvalidArgumentError, KeyedStateError, UnavailableError
from keyedstate.common.exit_status import describe_exit
from keyedstate.common.faults import ENV as CRASH_AT
from keyedstate.common.ids import JobId, SubtaskId
from keyedstate.taskmanager.rpc.slot_process_control import SlotProcessChannel
from keyedstate.taskmanager.slot_process import MODULE, SlotProcessFailed, SlotProcessReady, SlotProcessSpec

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0
"""How long a slot process may take to import, open its transfer processes and bind."""
_EXIT_WAIT_S = 15.0
_WATCH_INTERVAL_S = 0.2
_REPLACE_ATTEMPTS = 3
_CONTROL_DIR_PREFIX = "keyedstate-slots-"
_CONTROL_DIR_RECORD = "slot-processes.dir"
"""The file in the work directory that names the private directory in use (removed on a clean stop)."""

T = TypeVar("T")
U = TypeVar("U")


def remove_leftover_control_dir(work_dir: Path) -> None:
    """Remove the private directory a TaskManager killed on ``work_dir`` left in the temp directory.

    A TaskManager that stops removes its directory (the lease page and the slot processes' Unix
    sockets) itself; one killed with -9 cannot, so the next TaskManager on the same work directory
    does, once no slot process of the killed one lives (call it after ``wait_for_slot_processes_gone``).
    Only what the record names is removed, and only when it is a directory of ours made for this
    purpose (the record file is ours, but the temp directory is shared).
    """
    record = work_dir / _CONTROL_DIR_RECORD
    try:
        leftover = Path(record.read_text().strip())
    except FileNotFoundError:
        return
    except (OSError, UnicodeDecodeError) as exc:
        logger.warning("cannot read %s (%s); removing it", record, exc)
        record.unlink(missing_ok=True)
        return
    try:
        info = os.lstat(leftover)
    except FileNotFoundError:
        info = None
    if info is not None:
        if (
            leftover.is_absolute()
            and leftover.name.startswith(_CONTROL_DIR_PREFIX)
            and stat.S_ISDIR(info.st_mode)
            and info.st_uid == os.getuid()
        ):
            shutil.rmtree(leftover, ignore_errors=True)
            logger.info("removed %s, left by a TaskManager that did not stop cleanly on %s", leftover, work_dir)
        else:
            logger.warning("%s names %s, which is no slot-process directory of ours; leaving it", record, leftover)
    record.unlink(missing_ok=True)


def process_config(conf: Configuration, count: int, resource_id: str) -> Configuration:
    """The configuration a slot process runs with: its share of the managed memory, the TaskManager's id.

    Raises ConfigError when a share would be below what RocksDB needs (1 MiB).
    """
    managed = conf.get(o.MANAGED_MEMORY)
    if managed // count < 1 << 20:
        raise ConfigError(
            f"taskmanager.memory.managed.size {managed} bytes split over taskmanager.slot-processes {count} leaves "
            "less than 1mb per slot process; raise the managed memory or lower the slot processes"
        )
    values: dict[str, object] = {o.MANAGED_MEMORY.key: managed // count, o.TASKMANAGER_RESOURCE_ID.key: resource_id}
    block_cache = conf.get(o.ROCKSDB_BLOCK_CACHE)
    if block_cache is not None:
        values[o.ROCKSDB_BLOCK_CACHE.key] = max(1, block_cache // count)
    return conf.with_values(values)


class SlotProcessHandle:
    """One running slot process: its pid, its client address and the channel to its Unix socket."""

    def __init__(self, spec: SlotProcessSpec, host: str, replacement: bool = False) -> None:
        self.index = spec.index
        env = dict(os.environ)
        if replacement:
            # A crash point armed for the TaskManager fires in the incarnation it was armed for:
            # a replacement is a new incarnation, as a restarted TaskManager is.
            env.pop(CRASH_AT, None)
        self._child = ChildProcess(MODULE, env=env)
        self.pid = self._child.pid
        self._conn = self._child.conn
        self._spec = spec
        self._host = host
        self.address = ""
        self.channel: SlotProcessChannel | None = None
        self._conn.send(spec)

    def wait_ready(self) -> None:
        """Wait for the process to serve; raises ConfigError (its own message) or UnavailableError."""
        reply: object = None
        if self._conn.poll(_START_TIMEOUT_S):
            try:
                reply = self._conn.recv()
            except (EOFError, OSError):
                reply = None
        if isinstance(reply, SlotProcessReady):
            self.address = f"{self._host}:{reply.port}"
            self.channel = SlotProcessChannel(self._spec.control_path)
            logger.info("slot process %d (pid %d) serves on %s", self.index, self.pid, self.address)
            return
        self.close()
        if isinstance(reply, SlotProcessFailed):
            raise ConfigError(f"slot process {self.index} failed to start: {reply.message}")
        raise UnavailableError(
            f"slot process {self.index} (pid {self.pid}) {describe_exit(self._child.exit_code())} before it served"
        )

    def serving(self) -> SlotProcessChannel:
        """The channel to the process's Unix socket (it serves once :meth:`wait_ready` returned)."""
        if self.channel is None:
            raise UnavailableError(f"slot process {self.index} is not serving yet; retry shortly")
        return self.channel

    def exit_code(self) -> int | None:
        """None while the process runs."""
        return self._child.exit_code()

    def kill(self) -> None:
        self._child.kill()

    def close(self) -> None:
        """Close our end of the socket: the process stops serving, closes its backends and exits."""
        self._child.hang_up()
        if not self._child.wait_exit(_EXIT_WAIT_S):
            logger.warning(
                "slot process %d (pid %d) did not exit within %.0f s; killed it", self.index, self.pid, _EXIT_WAIT_S
            )
        if self.channel is not None:
            self.channel.close()
        self._child.close_socket()
        try:
            os.unlink(self._spec.control_path)
        except OSError:
            pass


class SlotProcessGroup:
    """Starts the slot processes, tells the TaskManager where each slot is served, replaces dead ones."""

    def __init__(
        self,
        conf: Configuration,
        count: int,
        num_slots: int,
        host: str,
        resource_id: str,
        on_replaced: Callable[[int], None],
        on_failed: Callable[[str], None],
    ) -> None:
        if count > num_slots:
            raise ConfigError(
                f"taskmanager.slot-processes {count} exceeds taskmanager.numberOfTaskSlots {num_slots}: "
                "a slot process without a slot serves nothing; lower it to at most the slot count"
            )
        self._conf = process_config(conf, count, resource_id)
        self.count = count
        self.num_slots = num_slots
        self._host = host
        self._on_replaced = on_replaced
        self._on_failed = on_failed
        # Unix socket paths are limited to 107 bytes: a short private directory, not the work dir.
        self._control_dir = Path(tempfile.mkdtemp(prefix=_CONTROL_DIR_PREFIX))
        self.control_dir = self._control_dir
        """The private directory of the lease page and the slot processes' Unix sockets."""
        self.lease_path = self._control_dir / "lease"
        """The page holding the TaskManager's lease (:class:`~keyedstate.common.lease.SharedLeaseCell`)."""
        self._processes: list[SlotProcessHandle | None] = [None] * count
        self._addresses = [""] * count
        self._lock = threading.Lock()
        self._replaced = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._calls = ThreadPoolExecutor(max_workers=count, thread_name_prefix="slot-process-call")
        self._record: Path | None = None

    def _spec(self, index: int) -> SlotProcessSpec:
        return SlotProcessSpec(
            index=index,
            count=self.count,
            config=self._conf.to_dict(),
            lease_path=str(self.lease_path),
            control_path=str(self._control_dir / f"slot-{index}.sock"),
        )

    def start(self, work_dir: Path) -> None:
        """Start every slot process (concurrently) and wait until all serve, then watch them.

        First records the private directory in ``work_dir``, so that a successor can remove it
        should this TaskManager be killed (:func:`remove_leftover_control_dir`).
        """
        record = work_dir / _CONTROL_DIR_RECORD
        staged = record.with_name(record.name + ".new")
        staged.write_text(str(self._control_dir))
        os.replace(staged, record)  # a crash leaves the old record or the new one, never half of one
        self._record = record
        started = [SlotProcessHandle(self._spec(i), self._host) for i in range(self.count)]
        failure: BaseException | None = None
        for process in started:
            try:
                process.wait_ready()
            except BaseException as exc:
                failure = failure or exc
        if failure is not None:
            for process in started:
                process.close()
            raise failure
        with self._lock:
            self._processes = list(started)
            self._addresses = [p.address for p in started]
        self._watcher = threading.Thread(target=self._watch, name="slot-process-watch", daemon=True)
        self._watcher.start()

    # -- where slots live ---------------------------------------------------------------------
    def index_of(self, slot_index: int) -> int:
        """The slot process serving slot ``slot_index``."""
        if not 0 <= slot_index < self.num_slots:
            raise InvalidArgumentError(
                f"slot index {slot_index} does not exist on this TaskManager (it has {self.num_slots} slots)"
            )
        return slot_index % self.count

    def slot_addresses(self) -> list[str]:
        """host:port serving each slot, in slot order (registrations carry it).

        A process being replaced keeps its last address until its successor serves (its slots
        answer UNAVAILABLE there meanwhile); the registration after the replacement carries the new one.
        """
        with self._lock:
            return [self._addresses[i % self.count] for i in range(self.num_slots)]

    def processes(self) -> list[tuple[str, int]]:
        """``(address, pid)`` of each slot process, by index (pid 0: being replaced; its last address stays)."""
        with self._lock:
            return [(self._addresses[i], p.pid if p is not None else 0) for i, p in enumerate(self._processes)]

    def pids(self) -> list[int]:
        """The slot processes' pids, by process index (0: none running there right now)."""
        with self._lock:
            return [p.pid if p is not None else 0 for p in self._processes]

    def _require(self, index: int) -> SlotProcessHandle:
        process = self._processes[index]
        if process is None or process.exit_code() is not None:
            raise UnavailableError(f"slot process {index} is being replaced; retry shortly")
        return process

    def channel(self, index: int, wait_s: float = 0.0) -> SlotProcessChannel:
        """The channel to running slot process ``index``, waiting up to ``wait_s`` while it is replaced.

        A deploy waits (a slot restores for as long anyway) rather than fail the job's restart: a
        fixed-delay restart strategy would otherwise spend its attempts while the process starts.
        Raises UnavailableError when it is not back in time.
        """
        deadline = time.monotonic() + wait_s
        with self._lock:
            while True:
                process = self._processes[index]
                if process is not None and process.exit_code() is None:
                    return process.serving()
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stop.is_set():
                    return self._require(index).serving()
                self._replaced.wait(min(remaining, _WATCH_INTERVAL_S))

    def channels(self) -> list[SlotProcessChannel]:
        """The channels to every slot process running now."""
        return [p.serving() for p in self.live()]

    def live(self) -> list[SlotProcessHandle]:
        """Every slot process running now."""
        with self._lock:
            return [p for p in self._processes if p is not None and p.exit_code() is None]

    def each(self, call: Callable[[U], T], items: Iterable[U]) -> list[T]:
        """``call`` on every item (one per slot process) at once; the first failure is raised."""
        results = [self._calls.submit(call, item) for item in items]
        return [r.result() for r in results]

    # -- the TaskManager's view ---------------------------------------------------------------
    def reports(self) -> list[Any]:
        """What every live slot process hosts (``SlotReport`` messages); one that does not answer reports
        nothing, so the JobManager sees its slots gone."""
        reports: list[Any] = []
        for process in self.live():
            try:
                reports.extend(process.serving().reports())
            except KeyedStateError as exc:
                logger.warning("slot process %d did not report its slots: %s", process.index, exc.message)
        return reports

    def retain(self, kept: set[SubtaskId], routing_versions: dict[JobId, int]) -> None:
        """Tell every slot process which slots the JobManager lets it keep, and the deploy floors."""
        self.each(lambda channel: channel.retain(kept, routing_versions), self.channels())

    def metric_families(self) -> Iterator[tuple[int, Metric]]:
        """Every live slot process's metric families, with its index."""
        for process in self.live():
            try:
                text = process.serving().metrics()
            except KeyedStateError:
                continue  # a process being replaced shows no metrics for one scrape
            for family in text_string_to_metric_families(text.decode("utf-8")):
                yield process.index, family

    # -- supervision ----------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(_WATCH_INTERVAL_S):
            try:
                if not self._replace_dead():
                    return
            except Exception:  # the watch must outlive anything; the next round looks again
                logger.exception("watching the slot processes failed")

    def _replace_dead(self) -> bool:
        """Replace every slot process that exited; False once one could not be (the TaskManager stops)."""
        for index in range(self.count):
            with self._lock:
                process = self._processes[index]
            if process is None or process.exit_code() is None:
                continue
            logger.error(
                "slot process %d (pid %d) %s; replacing it (its slots' jobs fail over)",
                index,
                process.pid,
                describe_exit(process.exit_code()),
            )
            with self._lock:
                self._processes[index] = None
            process.close()
            if not self._replace(index):
                return False
        return True

    def _replace(self, index: int) -> bool:
        last: BaseException | None = None
        for attempt in range(1, _REPLACE_ATTEMPTS + 1):
            if self._stop.is_set():
                return False
            try:
                process = SlotProcessHandle(self._spec(index), self._host, replacement=True)
                process.wait_ready()
            except Exception as exc:
                last = exc
                logger.error("slot process %d: replacement %d of %d failed: %s", index, attempt, _REPLACE_ATTEMPTS, exc)
                continue
            with self._lock:
                if self._stop.is_set():
                    process.close()
                    return False
                self._processes[index] = process
                self._addresses[index] = process.address
                self._replaced.notify_all()
            self._on_replaced(index)
            return True
        self._on_failed(f"slot process {index} died and could not be replaced ({_REPLACE_ATTEMPTS} attempts): {last}")
        return False

    def close(self) -> None:
        """Stop every slot process (each closes its backends) and remove the control sockets."""
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(_EXIT_WAIT_S)
        with self._lock:
            processes = [p for p in self._processes if p is not None]
            self._processes = [None] * self.count
        for process in processes:
            process.close()
        self._calls.shutdown(wait=False)
        shutil.rmtree(self._control_dir, ignore_errors=True)
        if self._record is not None:
            self._record.unlink(missing_ok=True)
            self._record = None


class MergedMetrics(Collector):
    """The TaskManager's endpoint: its own metrics and its slot processes', merged family by family.

    A slot process's samples carry ``slot_process="<index>"``, so the series of two processes
    (or of a process and the TaskManager) never collide and a ``sum by (...)`` adds them up.
    The slot counts are the TaskManager's alone (a slot process does not know them).
    """

    def __init__(self, own: CollectorRegistry, group: SlotProcessGroup, taskmanager_only: frozenset[str]) -> None:
        self._own = own
        self._group = group
        self._taskmanager_only = taskmanager_only

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for family in self._own.collect():
            merged[family.name] = family
        for index, family in self._group.metric_families():
            if family.name in self._taskmanager_only:
                continue
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation, family.type)
            for sample in family.samples:
                target.add_sample(
                    sample.name, {**sample.labels, "slot_process": str(index)}, sample.value, sample.timestamp
                )
        return list(merged.values())
