"""W1's input, reference and single-process baselines (bench/w1): real Parquet files and a real RocksDB."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from bench.w1 import data as w1data
from bench.w1 import local


@pytest.fixture
def small(tmp_path: Path) -> w1data.W1Data:
    return w1data.generate(tmp_path / "in", events=4_000, users=300, files=4, seed=7)


def test_generate_writes_the_files_and_an_exact_reference(small: w1data.W1Data) -> None:
    assert [p.name for p in small.files] == [f"events-{i:03d}.parquet" for i in range(4)]
    tables = [pq.read_table(p) for p in small.files]
    assert [t.num_rows for t in tables] == [1_000] * 4
    assert tables[0].schema.names == ["user", "amount"]
    expected = small.expected()
    assert sum(c for c, _ in expected.values()) == 4_000
    users = [u for t in tables for u in t.column("user").to_pylist()]
    amounts = [a for t in tables for a in t.column("amount").to_pylist()]
    assert expected[users[0]][1] == sum(a for u, a in zip(users, amounts) if u == users[0])
    assert all(1 <= a <= 10_000 for a in amounts)


def test_generate_is_deterministic_per_seed(tmp_path: Path, small: w1data.W1Data) -> None:
    again = w1data.generate(tmp_path / "again", events=4_000, users=300, files=4, seed=7)
    other = w1data.generate(tmp_path / "other", events=4_000, users=300, files=4, seed=8)
    assert again.expected() == small.expected()
    assert other.expected() != small.expected()


def test_generate_refuses_an_uneven_split(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="do not split evenly"):
        w1data.generate(tmp_path / "x", events=1_001, users=10, files=4, seed=1)


def test_mismatches_counts_wrong_missing_and_extra_users(small: w1data.W1Data) -> None:
    got = dict(small.expected())
    assert w1data.mismatches(small, got) == 0
    first, second = sorted(got)[:2]
    got[first] = (got[first][0], got[first][1] + 1)  # a sum off by one cent
    del got[second]
    got[10**9] = (1, 1)
    assert w1data.mismatches(small, got) == 3


def test_subset_keeps_the_first_events_and_their_reference(tmp_path: Path, small: w1data.W1Data) -> None:
    sub = w1data.subset(small, tmp_path / "sub", events=1_500, files=3)
    assert sub.events == 1_500 and len(sub.files) == 3
    first = pq.read_table(small.files[0]).to_pylist() + pq.read_table(small.files[1]).to_pylist()[:500]
    rows = [r for p in sub.files for r in pq.read_table(p).to_pylist()]
    assert rows == first
    assert sum(c for c, _ in sub.expected().values()) == 1_500


@pytest.mark.parametrize("files_per_batch", [1, 2])
def test_single_process_baselines_match_the_reference(
    tmp_path: Path, small: w1data.W1Data, files_per_batch: int
) -> None:
    seconds, final = local.run_pure_python(small, files_per_batch)
    assert seconds > 0 and w1data.mismatches(small, final) == 0
    seconds, final = local.run_rocksdict(small, files_per_batch, tmp_path / "db")
    assert seconds > 0 and w1data.mismatches(small, final) == 0


def test_preaggregate_folds_a_partition_per_user() -> None:
    import pyarrow as pa

    from bench.w1.executor import preaggregate

    schema = pa.schema([("user", pa.int64()), ("amount", pa.int64())])
    batches = [
        pa.record_batch({"user": [1, 2, 1], "amount": [5, 6, 7]}, schema=schema),
        pa.record_batch({"user": [], "amount": []}, schema=schema),
        pa.record_batch({"user": [2, 3], "amount": [1, 2]}, schema=schema),
    ]
    agg = preaggregate(iter(batches))
    assert agg is not None
    got = {u: (n, t) for u, n, t in zip(*(agg.column(c).to_pylist() for c in ("user", "n", "total")))}
    assert got == {1: (2, 12), 2: (2, 7), 3: (1, 2)}
    assert preaggregate(iter([])) is None
    assert preaggregate(iter(batches[1:2])) is None
