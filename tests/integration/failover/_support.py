"""Helpers of the failover proofs: an epoch writer with its plain-Python reference, the orphan
check of checkpoint storage, metric scrapes, and the recovery-time figures.

The reference is a pure function of the committed epochs: epoch ``e`` appends ``"e<e>"`` to the
list of every key it touches and adds ``(1, e)`` to its reducing totals (count SUM, last MAX),
so an epoch applied twice shows as a doubled element and a count one too high, and an epoch lost
as a missing element.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common.client import CheckpointStatus, ListState, ReducingState, StateClient, ValueState, status_name
from keyedstate.common.descriptors import (
    NumberType,
    OperatorSpec,
    ReduceField,
    ReduceFunction,
    StateDescriptor,
    StateKind,
)
from keyedstate.common.errors import (
    EpochConflictError,
    JobStateError,
    KeyedStateError,
    StaleRoutingError,
    UnavailableError,
)
from keyedstate.common.rpc.enums import name_of
from keyedstate.common.storage import CheckpointStorage
from keyedstate.jobmanager.checkpoint import CheckpointMetadata, plan_gc

logger = logging.getLogger(__name__)

OPERATOR = "counts"
STATES = (
    StateDescriptor("events", StateKind.LIST),
    StateDescriptor(
        "totals",
        StateKind.REDUCING,
        reduce_fields=(
            ReduceField("n"),
            ReduceField("last", ReduceFunction.MAX, NumberType.INT64),
        ),
    ),
    StateDescriptor("blob", StateKind.VALUE),
)
PARTITIONS = 2
"""Spark partitions of one batch: each stages its half of the keys under its own attempt id."""

RETRYABLE = (UnavailableError, EpochConflictError, JobStateError, StaleRoutingError)
"""What a writer may see while a job fails over; anything else fails the test."""


def operators(parallelism: int) -> list[OperatorSpec]:
    return [OperatorSpec(OPERATOR, parallelism, STATES)]


def key_names(n: int) -> list[str]:
    return [f"user-{i:05d}" for i in range(n)]


def blob_value(key: str, epoch: int, size: int) -> bytes:
    """Incompressible and reproducible, so RocksDB files have the size the test asks for."""
    return random.Random(f"{key}/{epoch}").randbytes(size)


@dataclass
class Reference:
    events: dict[str, list[str]] = field(default_factory=dict)
    totals: dict[str, tuple[int, int]] = field(default_factory=dict)
    blob: dict[str, bytes] = field(default_factory=dict)


@dataclass
class Attempt:
    """One try at one epoch, as the writer saw it."""

    epoch: int
    started: float
    finished: float = 0.0
    error: str = ""


class EpochWriter:
    """Writes epochs through epoch transactions and commits each with a checkpoint, like the
    foreachBatch driver: on a retryable error it waits for the job to run again, reads the
    committed epoch and carries on from the next one (staged writes of a failed try are lost)."""

    def __init__(
        self,
        client: StateClient,
        job_id: str,
        keys: list[str],
        *,
        blob_bytes: int = 0,
        blob_epochs: frozenset[int] = frozenset(),
    ) -> None:
        self.client = client
        self.job_id = job_id
        self.keys = keys
        self.blob_bytes = blob_bytes
        self.blob_epochs = blob_epochs
        self.committed = -1
        self.attempts: list[Attempt] = []
        self._ids = itertools.count(1)

    # -- the workload ------------------------------------------------------------------------
    def keys_of(self, epoch: int) -> list[str]:
        return [k for i, k in enumerate(self.keys) if (i + epoch) % 3]

    def expected(self, through: int) -> Reference:
        """The state after epochs ``0..through``, each applied exactly once."""
        ref = Reference()
        for epoch in range(through + 1):
            for k in self.keys_of(epoch):
                ref.events.setdefault(k, []).append(f"e{epoch}")
                n, _ = ref.totals.get(k, (0, 0))
                ref.totals[k] = (n + 1, epoch)
                if epoch in self.blob_epochs:
                    ref.blob[k] = blob_value(k, epoch, self.blob_bytes)
        return ref

    def _handles(
        self, context: pb.EpochContext | None
    ) -> tuple[ListState[Any, Any], ReducingState[Any], ValueState[Any, Any]]:
        c, j = self.client, self.job_id
        return (
            ListState(c, j, OPERATOR, "events", value_serializer="str", epoch=context),
            ReducingState(c, j, OPERATOR, "totals", epoch=context),
            ValueState(c, j, OPERATOR, "blob", value_serializer="bytes", epoch=context),
        )

    def stage(self, epoch: int) -> dict[int, int]:
        """Stage epoch ``epoch`` (every partition under a fresh attempt id); returns the winners."""
        keys = self.keys_of(epoch)
        winners = {}
        for partition in range(PARTITIONS):
            attempt = next(self._ids)
            part = keys[partition::PARTITIONS]
            events, totals, blob = self._handles(pb.EpochContext(epoch=epoch, partition=partition, attempt=attempt))
            events.append_many(part, [f"e{epoch}"] * len(part))
            totals.add_many(part, [(1, epoch)] * len(part))
            if epoch in self.blob_epochs:
                blob.put_many(part, [blob_value(k, epoch, self.blob_bytes) for k in part])
            winners[partition] = attempt
        return winners

    # -- the driver loop ---------------------------------------------------------------------
    def run_epoch(self, epoch: int) -> None:
        """One try: stage, commit, checkpoint; raises a RETRYABLE error when the job is failing over."""
        attempt = Attempt(epoch, time.monotonic())
        self.attempts.append(attempt)
        try:
            version = self.client.routing(self.job_id, refresh=True).version
            winners = self.stage(epoch)
            response = self.client.commit_epoch(
                self.job_id,
                epoch,
                winners,
                checkpoint=True,
                wait_for_checkpoint=True,
                expected_routing_version=version,
                timeout_s=120,
            )
            cp = response.checkpoint
            if cp is None or cp.status is not CheckpointStatus.COMPLETED:
                raise UnavailableError(
                    f"the checkpoint of epoch {epoch} did not complete: "
                    f"{(cp.failure_reason or status_name(cp.status)) if cp is not None else 'no checkpoint'}"
                )
        except KeyedStateError as exc:
            attempt.error = f"{type(exc).__name__}: {exc.message}"
            raise
        finally:
            attempt.finished = time.monotonic()
        self.committed = epoch

    def run(self, through: int, *, timeout_s: float = 120.0) -> None:
        """Run epochs until ``through`` is committed; retryable failures restart from the job's committed epoch."""
        deadline = time.monotonic() + timeout_s
        while self.committed < through:
            if time.monotonic() > deadline:
                pytest.fail(
                    f"the writer reached epoch {self.committed} of {through} in {timeout_s:.0f} s; "
                    f"last attempts: {self.attempts[-3:]}"
                )
            try:
                self.run_epoch(self.committed + 1)
            except RETRYABLE as exc:
                logger.info(
                    "writer: epoch %d failed (%s: %s); waiting for the job",
                    self.committed + 1,
                    type(exc).__name__,
                    exc.message,
                )
                # Paces the retries while the JobManager has not yet noticed the loss.
                time.sleep(0.2)
                self.committed = wait_for_job(self.client, self.job_id, {"RUNNING"}, timeout_s=60).committed_epoch

    def failures(self) -> list[Attempt]:
        return [a for a in self.attempts if a.error]

    def first_success_after(self, t: float) -> Attempt | None:
        """The first try that started after ``t`` and committed."""
        return next((a for a in self.attempts if a.started > t and not a.error), None)

    # -- reading back ------------------------------------------------------------------------
    def read(self) -> Reference:
        """The job's state as served, found by scanning every subtask (no key list given)."""
        # keys() scans as many subtasks as the cached routing has: refresh it after a rescale.
        self.client.routing(self.job_id, refresh=True)
        events, totals, blob = self._handles(None)
        out = Reference()
        for handle, target in ((events, out.events), (totals, out.totals), (blob, out.blob)):
            keys = list(handle.keys())
            assert len(keys) == len(set(keys)), f"state {handle.name!r}: a key is served by two subtasks"
            target.update(zip(keys, handle.get_many(keys)))  # type: ignore[arg-type]
        out.totals = {k: tuple(v) for k, v in out.totals.items()}  # type: ignore[misc]
        return out


class BackgroundWriter:
    """Runs an EpochWriter on a thread, so the test can kill processes while it writes."""

    def __init__(self, writer: EpochWriter, through: int) -> None:
        self.writer = writer
        self.through = through
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="epoch-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.writer.run(self.through)
        except BaseException as exc:  # re-raised in the test thread by join()
            self.error = exc

    def wait_for_epoch(self, epoch: int, timeout_s: float = 60.0) -> None:
        wait_until(
            lambda: self.writer.committed >= epoch or not self._thread.is_alive(),
            f"the writer to commit epoch {epoch}",
            timeout_s,
        )
        if self.error is not None:
            raise self.error

    def join(self, timeout_s: float = 150.0) -> None:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            pytest.fail(f"the writer did not finish within {timeout_s:.0f} s (at epoch {self.writer.committed})")
        if self.error is not None:
            raise self.error


def assert_state_equals(actual: Reference, expected: Reference) -> None:
    """Exact equality per state, with a short diff on failure."""
    for name in ("events", "totals", "blob"):
        got, want = getattr(actual, name), getattr(expected, name)
        if got != want:
            missing = sorted(set(want) - set(got))[:5]
            extra = sorted(set(got) - set(want))[:5]
            wrong = sorted(k for k in set(got) & set(want) if got[k] != want[k])[:3]
            shown = [(k, str(got[k])[:80], str(want[k])[:80]) for k in wrong]
            pytest.fail(
                f"state {name!r} differs: {len(want)} keys expected, {len(got)} served; missing {missing}, "
                f"unexpected {extra}, wrong values (key, served, expected) {shown}"
            )


# -- jobs and time ------------------------------------------------------------------------------


def wait_until(
    predicate: Callable[[], bool], what: str, timeout_s: float = 30.0, state: Callable[[], Any] | None = None
) -> None:
    """Wait for something another process does on its own; fail naming ``what`` (and ``state()``)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(
                f"timed out after {timeout_s:.0f} s waiting for {what}" + (f"; now: {state()}" if state else "")
            )
        time.sleep(0.05)


def wait_for_job(
    client: StateClient, job_id: str, statuses: set[str], *, min_restarts: int = 0, timeout_s: float = 60.0
) -> Any:
    """Poll the job until its status is one of ``statuses`` (after at least ``min_restarts``); its JobInfo."""
    seen: list[Any] = []

    def ready() -> bool:
        try:
            info = client.job_info(job_id)
        except UnavailableError:
            return False
        seen[:] = [info]
        return name_of(pb.JobStatus, info.status) in statuses and info.restarts >= min_restarts

    wait_until(
        ready,
        f"job {job_id} to be {'/'.join(sorted(statuses))} (restarts >= {min_restarts})",
        timeout_s,
        lambda: (
            (name_of(pb.JobStatus, seen[0].status), seen[0].restarts, seen[0].failure_cause) if seen else "no answer"
        ),
    )
    return seen[0]


FIGURES: list[tuple[str, float]] = []
"""Recovery times measured by the tests of this run, printed in the terminal summary."""


def record_figure(name: str, seconds: float) -> None:
    FIGURES.append((name, seconds))
    logger.info("figure: %s = %.2f s", name, seconds)
    print(f"figure: {name} = {seconds:.2f} s")


# -- checkpoint storage ---------------------------------------------------------------------------


def relative_files(storage: CheckpointStorage, root: str) -> set[str]:
    root = root.rstrip("/")
    return {info.path[len(root) + 1 :] for info in storage.list(root, recursive=True) if not info.is_dir}


def read_metadata(storage: CheckpointStorage, checkpoint_dir: str) -> CheckpointMetadata:
    return CheckpointMetadata.from_json(storage.read_bytes(f"{checkpoint_dir}/_metadata"), source=checkpoint_dir)


def referenced_files(metadata: CheckpointMetadata, checkpoint_name: str) -> set[str]:
    """What ``_metadata`` references, relative to the job directory (``chk-2/x``, ``shared/chk-1/y``)."""
    return {f.path[3:] if f.path.startswith("../") else f"{checkpoint_name}/{f.path}" for _, _, f in metadata.files()}


def assert_no_orphans(storage: CheckpointStorage, job_dir: str, retained: list[str], timeout_s: float = 30.0) -> None:
    """Wait until the job's checkpoint storage holds exactly the retained checkpoints' ``_metadata``
    and the files they reference; then gc must find nothing to remove either.

    ``retained`` are checkpoint directories (absolute); deletions run asynchronously in the
    JobManager, hence the wait.
    """
    job_dir = job_dir.rstrip("/")
    expected: set[str] = set()
    metas = []
    for path in retained:
        name = path[len(job_dir) + 1 :]
        meta = read_metadata(storage, path)
        metas.append(meta)
        expected |= {f"{name}/_metadata"} | referenced_files(meta, name)

    def diff() -> str:
        now = relative_files(storage, job_dir)
        return f"orphans {sorted(now - expected)[:10]}, missing {sorted(expected - now)[:10]}"

    wait_until(
        lambda: relative_files(storage, job_dir) == expected,
        "checkpoint storage to hold only retained files",
        timeout_s,
        diff,
    )
    plan = plan_gc(storage, job_dir, retained=metas)
    assert not plan.remove, plan.describe()


# -- metrics --------------------------------------------------------------------------------------


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample a daemon's Prometheus endpoint serves: (name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric_total(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """Sum of ``name`` over every label set that includes ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)
