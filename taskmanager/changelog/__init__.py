"""Changelog checkpoints (Flink's changelog state backend): committed change sets logged before they apply.

A checkpoint of a slot with the changelog on is its last materialized snapshot plus the segments
written after it; a restore restores the snapshot and replays the segments.
"""

from keyedstate.taskmanager.changelog.log import (
    CHANGELOG_DIR,
    ReplaySource,
    SealedSegment,
    SlotChangelog,
    pinned_clock,
    replay,
)
from keyedstate.taskmanager.changelog.segment import ChangeSet, encode_segment, read_segment

__all__ = [
    "CHANGELOG_DIR",
    "ChangeSet",
    "ReplaySource",
    "SealedSegment",
    "SlotChangelog",
    "encode_segment",
    "pinned_clock",
    "read_segment",
    "replay",
]
