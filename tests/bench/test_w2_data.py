"""W2's input, its plain-Python reference and the shared session step (bench/w2), on hand-made cases and real Parquet."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from bench.w2 import data as w2data
from bench.w2.executor import GAP_S, advance

H = 3600


def test_the_executor_uses_the_data_gap() -> None:
    assert GAP_S == w2data.GAP_S == 30 * 60


def test_events_out_of_order_are_sessionized_in_time_order() -> None:
    got = w2data.reference([7, 7, 7, 7], [100, 50, 2_000, 1_950])
    # in time order: 50, 100 | 1950 (1850 s after 100), 2000
    assert got.closed == {(7, 50, 2, 50)}
    assert got.open == {7: (1_950, (1_950, 2_000))}


def test_a_gap_of_exactly_30_minutes_extends_and_one_second_more_closes() -> None:
    assert w2data.reference([1, 1], [0, 1_800]).closed == frozenset()
    assert w2data.reference([1, 1], [0, 1_800]).open == {1: (0, (0, 1_800))}
    more = w2data.reference([1, 1], [0, 1_801])
    assert more.closed == {(1, 0, 1, 0)}
    assert more.open == {1: (1_801, (1_801,))}


def test_users_do_not_share_sessions_and_the_last_session_stays_open() -> None:
    got = w2data.reference([1, 2, 1, 2, 1], [0, 10, 5_000, 20, 5_100])
    assert got.closed == {(1, 0, 1, 0)}
    assert got.open == {1: (5_000, (5_000, 5_100)), 2: (10, (10, 20))}


def _batchwise(batches: list[list[tuple[int, int]]]) -> w2data.Sessions:
    """The session step of every variant (executor.advance), applied micro-batch by micro-batch,
    with the list of times kept as the variants keep theirs (appended, or replaced from the index it returns).
    """
    sessions: dict[int, tuple[int, int, int]] = {}
    times: dict[int, list[int]] = {}
    closed: list[w2data.Session] = []
    for batch in batches:
        per_user: dict[int, list[int]] = {}
        for u, t in batch:
            per_user.setdefault(u, []).append(t)
        for u, new in per_user.items():
            new.sort()
            sessions[u], done, tail = advance(sessions.get(u), new)
            times[u] = times[u] + new if tail is None else new[tail:]
            start, last, count = sessions[u]
            assert (start, last, count) == (times[u][0], times[u][-1], len(times[u]))
            closed += [(u, *c) for c in done]
    assert len(closed) == len(set(closed))
    return w2data.Sessions(frozenset(closed), {u: (t[0], tuple(t)) for u, t in times.items()})


def test_advance_reports_how_the_list_changes() -> None:
    assert advance(None, [10, 20]) == ((10, 20, 2), [], 0)  # a new session: the list is new[0:]
    assert advance((0, 100, 3), [200, 1_900]) == ((0, 1_900, 5), [], None)  # went on: append everything
    # 2000 is 1900 s after 100: closes (0, 3 events, 100 s); 2100 goes on; 5000 closes again
    assert advance((0, 100, 3), [2_000, 2_100, 5_000]) == ((5_000, 5_000, 1), [(0, 3, 100), (2_000, 2, 100)], 2)


def test_a_session_spanning_micro_batches_goes_on_and_closes_later() -> None:
    batches = [[(3, 1_000), (3, 0)], [(3, 2_500), (4, H)], [(3, 2 * H), (3, 2 * H + 1_800)]]
    got = _batchwise(batches)
    assert got.closed == {(3, 0, 3, 2_500)}  # 0, 1000 | 2500 (next batch, 1500 s later) | 7200 closes it
    assert got.open == {3: (2 * H, (2 * H, 2 * H + 1_800)), 4: (H, (H,))}
    flat = [e for b in batches for e in b]
    assert w2data.reference([u for u, _ in flat], [t for _, t in flat]) == got


@pytest.fixture
def small(tmp_path: Path) -> w2data.W2Data:
    return w2data.generate(tmp_path / "in", events=6_000, users=200, batches=3, files_per_batch=2, seed=7)


def test_generate_writes_hours_in_order_with_disorder_inside_each_batch(small: w2data.W2Data) -> None:
    assert [p.name for p in small.files] == [f"events-{i:03d}.parquet" for i in range(6)]
    mtimes = [p.stat().st_mtime for p in small.files]
    assert mtimes == sorted(mtimes) and len(set(mtimes)) == 6  # the file source's order
    tables = [pq.read_table(p) for p in small.files]
    assert [t.num_rows for t in tables] == [1_000] * 6 and tables[0].schema.names == ["user", "ts"]
    for b in range(3):
        ts = np.concatenate([tables[2 * b + i].column("ts").to_numpy() for i in (0, 1)])
        lo = w2data.T0 + b * w2data.SPAN_S
        assert ts.min() >= lo and ts.max() < lo + w2data.SPAN_S  # event time increases per micro-batch
        assert (np.diff(ts) < 0).any()  # ... with disorder inside the batch
        assert np.diff(ts).min() >= -w2data.LATENESS_S - w2data.SPAN_S
    expected = small.expected
    assert sum(c for _, _, c, _ in expected.closed) + sum(len(t) for _, t in expected.open.values()) == 6_000
    spanning = [s for s in expected.closed if (s[1] - w2data.T0) // H != (s[1] + s[3] - w2data.T0) // H]
    assert spanning, "no closed session spans two micro-batches"
    assert any(c == 1 for _, _, c, _ in expected.closed) and any(c >= 5 for _, _, c, _ in expected.closed)


def test_the_batchwise_step_on_the_generated_files_equals_the_reference(small: w2data.W2Data) -> None:
    batches = []
    for b in range(small.batches):
        rows = []
        for p in small.files[2 * b : 2 * b + 2]:
            t = pq.read_table(p)
            rows += list(zip(t.column("user").to_pylist(), t.column("ts").to_pylist()))
        batches.append(rows)
    assert _batchwise(batches) == small.expected


def test_generate_is_deterministic_per_seed(tmp_path: Path, small: w2data.W2Data) -> None:
    again = w2data.generate(tmp_path / "again", events=6_000, users=200, batches=3, files_per_batch=2, seed=7)
    other = w2data.generate(tmp_path / "other", events=6_000, users=200, batches=3, files_per_batch=2, seed=8)
    assert again.expected == small.expected and other.expected != small.expected
    with pytest.raises(ValueError, match="do not split evenly"):
        w2data.generate(tmp_path / "x", events=6_001, users=10, batches=3, files_per_batch=2, seed=1)


def test_subset_keeps_every_batch_of_the_first_users(tmp_path: Path, small: w2data.W2Data) -> None:
    sub = w2data.subset_users(small, tmp_path / "sub", users=20)
    assert len(sub.files) == 6 and sub.batches == 3
    assert set(sub.expected.open) == {u for u in small.expected.open if u < 20}
    assert sub.expected.closed == {s for s in small.expected.closed if s[0] < 20}


def test_check_reference_counts_missing_extra_and_wrong_open_sessions(small: w2data.W2Data) -> None:
    expected = small.expected
    w2data.check_reference("same", expected, expected)
    closed = set(expected.closed)
    closed.remove(next(iter(closed)))
    closed.add((10**6, 0, 1, 0))
    still_open = dict(expected.open)
    u = next(iter(still_open))
    still_open[u] = (still_open[u][0], still_open[u][1][:-1] + (still_open[u][1][-1] + 1,))
    bad = w2data.Sessions(frozenset(closed), still_open)
    assert w2data.mismatches(expected, bad) == (2, 1)
    assert w2data.mismatches(expected, bad, with_open=False) == (2, 0)
    with pytest.raises(RuntimeError, match="W2 x: .* 2 of .* closed sessions missing or extra"):
        w2data.check_reference("W2 x", expected, bad)
