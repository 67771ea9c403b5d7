"""The checkpoint tests' clusters (file:// and S3) and the reference workload, shared with the State Processor tests."""

from __future__ import annotations

from tests.integration.checkpoints.conftest import checkpoint_cluster

__all__ = ["checkpoint_cluster"]
