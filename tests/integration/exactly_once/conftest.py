"""The ``exo_pipeline`` factory: an :class:`ExactlyOncePipeline` started per call, torn down after the test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.exactly_once._pipeline import ExactlyOncePipeline


@pytest.fixture(params=["sync", "overlapped"])
def commit_mode(request: pytest.FixtureRequest) -> str:
    """``execution.checkpointing.commit-mode``: every exactly-once test runs in both modes (a test that
    parametrizes ``commit_mode`` itself lists its combinations, some in the exhaustive tier)."""
    return str(request.param)


@pytest.fixture
def exo_pipeline(spark: Any, tmp_path: Path, commit_mode: str) -> Iterator[Callable[..., ExactlyOncePipeline]]:
    """Factory: ``exo_pipeline(files=5, parallelism=4, config={...}, tm_env={1: {...}})`` (see ExactlyOncePipeline),
    in the commit mode of the ``commit_mode`` parameter unless ``config`` names one."""
    started: list[ExactlyOncePipeline] = []

    def make(**kwargs: Any) -> ExactlyOncePipeline:
        kwargs["config"] = {"execution.checkpointing.commit-mode": commit_mode, **(kwargs.get("config") or {})}
        pipeline = ExactlyOncePipeline(spark, tmp_path / f"pipeline-{len(started)}", **kwargs)
        started.append(pipeline)
        return pipeline.start()

    yield make
    for pipeline in started:
        pipeline.close()
