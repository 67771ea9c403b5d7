"""The RocksDB snapshot's cut: a pre-flush while writes go on, then a short cut under the write lock.

The snapshot must still hold exactly one instant of the state, with the committed epoch of
that instant, whatever writes run meanwhile. Real RocksDB in tmp_path throughout.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from keyedstate.common.descriptors import StateDescriptor, StateKind
from keyedstate.common.errors import UnavailableError
from keyedstate.common.ids import KeyGroupRange, SubtaskId
from keyedstate.taskmanager.state import KeyedStateBackend, StateLimits, create_backend, restore_backend
from keyedstate.taskmanager.state.metadata import COMMITTED_EPOCH
from tests.fakes.clock import ManualClock

MP = 128
SUBTASK = SubtaskId("job", "op", 0)
STATES = (StateDescriptor("v", StateKind.VALUE),)
ALL = KeyGroupRange(0, MP - 1)
KEYS = [b"key-%05d" % i for i in range(3000)]
BIG = b"x" * 1000  # 3000 x 1 kB: ~3 MB in the memtable, above the pre-flush threshold


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def opened() -> Iterator[list[KeyedStateBackend]]:
    backends: list[KeyedStateBackend] = []
    yield backends
    for b in backends:
        b.close()


@pytest.fixture
def backend(tmp_path: Path, clock: ManualClock, opened: list[KeyedStateBackend]) -> KeyedStateBackend:
    b = create_backend(
        "rocksdb", SUBTASK, ALL, MP, STATES, local_dir=tmp_path / "live", limits=StateLimits(), clock=clock
    )
    opened.append(b)
    return b


def restored(directory: Path, tmp_path: Path, clock: ManualClock, opened: list[KeyedStateBackend]) -> KeyedStateBackend:
    b = restore_backend(
        "rocksdb",
        SUBTASK,
        ALL,
        MP,
        STATES,
        snapshot_dirs=[directory],
        local_dir=tmp_path / f"restored-{len(opened)}",
        limits=StateLimits(),
        clock=clock,
    )
    opened.append(b)
    return b


def memtable_bytes(b: KeyedStateBackend) -> int:
    return b.stats()["cur-size-all-mem-tables"]


def test_snapshot_flushes_the_memtable_and_reports_the_blocked_time(
    backend: KeyedStateBackend,
    tmp_path: Path,
    clock: ManualClock,
    opened: list[KeyedStateBackend],
) -> None:
    backend.value_put("v", KEYS, [BIG] * len(KEYS), b"")
    assert memtable_bytes(backend) > 3_000_000
    snapshot = backend.snapshot(tmp_path / "chk-1")
    assert snapshot.materialized and any(p.suffix == ".sst" for p in snapshot.files())
    assert memtable_bytes(backend) < 100_000, "the memtable was flushed into the snapshot's SST files"
    assert snapshot.blocked_ms is not None and snapshot.blocked_ms >= 0
    assert restored(snapshot.directory, tmp_path, clock, opened).value_get("v", KEYS, b"") == [BIG] * len(KEYS)


def test_snapshot_records_the_committed_epoch_of_its_instant(
    backend: KeyedStateBackend,
    tmp_path: Path,
    clock: ManualClock,
    opened: list[KeyedStateBackend],
) -> None:
    backend.apply([], meta={COMMITTED_EPOCH: b"7"})
    snapshot = backend.snapshot(tmp_path / "chk-1")
    backend.apply([], meta={COMMITTED_EPOCH: b"8"})
    assert snapshot.committed_epoch == 7
    assert restored(snapshot.directory, tmp_path, clock, opened).get_meta(COMMITTED_EPOCH) == b"7"


def test_snapshot_without_a_numeric_epoch_leaves_it_unknown(backend: KeyedStateBackend, tmp_path: Path) -> None:
    assert backend.snapshot(tmp_path / "chk-1").committed_epoch is None
    backend.apply([], meta={COMMITTED_EPOCH: b"not-a-number"})
    assert backend.snapshot(tmp_path / "chk-2").committed_epoch is None


def test_snapshot_of_a_closed_backend_is_refused(backend: KeyedStateBackend, tmp_path: Path) -> None:
    backend.close()
    with pytest.raises(UnavailableError, match="closed"):
        backend.snapshot(tmp_path / "chk-1")
    assert not (tmp_path / "chk-1").exists()


def test_a_snapshot_under_concurrent_writes_is_one_instant_of_the_write_sequence(
    backend: KeyedStateBackend,
    tmp_path: Path,
    clock: ManualClock,
    opened: list[KeyedStateBackend],
) -> None:
    """One writer puts keys 0, 1, 2, ... in order while the snapshot pre-flushes and cuts. The
    snapshot must hold exactly keys 0..m-1, with m between the writes done before the call and
    the writes done when it returned."""
    n = 6000
    done = [0]
    started = threading.Event()
    stop = threading.Event()
    keys = [b"w-%06d" % i for i in range(n)]

    def writer() -> None:
        for i in range(n):
            if stop.is_set():
                return
            backend.value_put("v", [keys[i]], [BIG], b"")
            done[0] = i + 1
            if i == 3000:
                started.set()  # ~3 MB written: enough for a pre-flush

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert started.wait(60)
        low = done[0]
        snapshot = backend.snapshot(tmp_path / "chk-1")
        high = done[0]
    finally:
        stop.set()
        thread.join(60)
    present = [v is not None for v in restored(snapshot.directory, tmp_path, clock, opened).value_get("v", keys, b"")]
    m = present.index(False) if False in present else n
    assert not any(present[m:]), "the snapshot has a gap: it is not one instant of the write sequence"
    assert low <= m <= high + 1
