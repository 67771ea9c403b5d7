"""The exactly-once pipeline fixture (``exo_pipeline``) for the overlapped changelog kill tests; each module names its ``commit_mode``."""

from tests.integration.exactly_once.conftest import exo_pipeline

__all__ = ["exo_pipeline"]
