"""Shared fixtures, one plugin module per external system (tests/fixtures/)."""

pytest_plugins = ["tests.fixtures.spark", "tests.fixtures.s3", "tests.fixtures.cluster", "tests.fixtures.netns"]
