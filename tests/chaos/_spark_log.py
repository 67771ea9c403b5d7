"""What Spark itself recorded in a query's checkpointLocation: the batches it committed and the files of each.

``commits/<n>`` exists once batch ``n`` is done (Spark writes it after ``foreachBatch``
returned); ``sources/0/<n>`` (or a ``<n>.compact`` file holding every batch up to ``n``) lists
the files of batch ``n`` for the file source. The chaos harness trusts these, not the driver's
own reports: a driver killed between ``foreachBatch`` returning and the commit log entry has
returned, but Spark runs that batch again.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

_PART = re.compile(r"part-(\d+)\.parquet$")


def committed_batches(checkpoint_location: str | Path) -> list[int]:
    """Batch ids in Spark's commit log, ascending."""
    commits = Path(checkpoint_location) / "commits"
    if not commits.is_dir():
        return []
    return sorted(int(p.name) for p in commits.iterdir() if p.name.isdigit())


def batch_files(checkpoint_location: str | Path) -> dict[int, list[int]]:
    """For every planned batch, the indices of its Parquet files (``part-<i>.parquet``)."""
    log = Path(checkpoint_location) / "sources" / "0"
    out: dict[int, set[int]] = {}
    if not log.is_dir():
        return {}
    for entry in log.iterdir():
        name = entry.name.removesuffix(".compact")
        if not name.isdigit():
            continue
        for line in entry.read_text(encoding="utf-8").splitlines()[1:]:  # the first line is the version
            if not line.strip():
                continue
            record = json.loads(line)
            match = _PART.search(record["path"])
            if match:
                out.setdefault(int(record["batchId"]), set()).add(int(match.group(1)))
    return {b: sorted(files) for b, files in sorted(out.items())}


def files_of(checkpoint_location: str | Path, batches: list[int] | set[int]) -> list[int]:
    """The file indices of ``batches``; KeyError naming a batch that Spark never planned."""
    planned = batch_files(checkpoint_location)
    missing = sorted(set(batches) - set(planned))
    if missing:
        raise KeyError(f"Spark's source log plans no files for batches {missing} (planned: {sorted(planned)})")
    return sorted(f for b in batches for f in planned[b])
