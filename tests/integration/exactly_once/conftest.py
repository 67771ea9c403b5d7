"""The ``exo_pipeline`` factory: an :class:`ExactlyOncePipeline` started per call, torn down after the test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.exactly_once._pipeline import ExactlyOncePipeline


@pytest.fixture
def exo_pipeline(spark: Any, tmp_path: Path) -> Iterator[Callable[..., ExactlyOncePipeline]]:
    """Factory: ``exo_pipeline(files=5, parallelism=4, config={...}, tm_env={1: {...}})`` (see ExactlyOncePipeline)."""
    started: list[ExactlyOncePipeline] = []

    def make(**kwargs: Any) -> ExactlyOncePipeline:
        pipeline = ExactlyOncePipeline(spark, tmp_path / f"pipeline-{len(started)}", **kwargs)
        started.append(pipeline)
        return pipeline.start()

    yield make
    for pipeline in started:
        pipeline.close()
