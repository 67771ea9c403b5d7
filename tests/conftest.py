"""Shared fixtures, one plugin module per external system (tests/fixtures/), and the exhaustive tier's mark."""

pytest_plugins = [
    "tests.fixtures.spark",
    "tests.fixtures.s3",
    "tests.fixtures.cluster",
    "tests.fixtures.netns",
    "tests.fixtures.tiers",
]
