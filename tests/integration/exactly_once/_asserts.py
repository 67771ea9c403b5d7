"""Assertions shared by the exactly-once tests: every message says what was lost or doubled."""

from __future__ import annotations

from collections.abc import Iterable

from tests.integration.exactly_once._pipeline import ExactlyOncePipeline, Outcome

QUERY_TIMEOUT_S = 150.0
"""Deadline for one query run: a healthy run of this pipeline takes 10-30 s here."""


def assert_finished_exactly(
    pipeline: ExactlyOncePipeline, outcome: Outcome, files: Iterable[int] | None = None
) -> None:
    """The query ended by itself, without an error, and the state is exactly the reference of ``files``."""
    assert outcome.finished, f"the query did not finish within its deadline: {outcome.describe()}"
    if outcome.error is not None:
        raise AssertionError(f"the query {outcome.describe()}\nstate then: {pipeline.describe_state(files)}")
    diff = pipeline.diff(files)
    info = pipeline.job_info()
    assert diff is None, (
        f"the query finished normally but {diff}; "
        f"job: {info.status}, {info.restarts} restart(s), committed epoch {info.committed_epoch}, "
        f"last cause: {info.failure_cause or '-'}"
    )


def assert_state_is_one_of(pipeline: ExactlyOncePipeline, candidates: list[list[int]], context: str) -> None:
    """The state equals the reference of one of the ``candidates`` (lists of files): nothing half applied."""
    diffs = []
    for files in candidates:
        diff = pipeline.diff(files)
        if diff is None:
            return
        diffs.append(diff)
    raise AssertionError(f"{context}; the state matches none of the acceptable references: " + " | ".join(diffs))
