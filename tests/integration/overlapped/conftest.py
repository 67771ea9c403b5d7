"""The exactly-once pipeline fixture (``exo_pipeline``), shared with tests/integration/exactly_once."""

from tests.integration.exactly_once.conftest import commit_mode, exo_pipeline

__all__ = ["commit_mode", "exo_pipeline"]
