"""What a checkpoint holds, counted: keys and bytes per state and key group, and the largest keys.

Counted on the stored entries (no serializer needed): a key is one (key, namespace) of a state;
its bytes are those of its stored keys and values, so a list's or map's entries add up.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from keyedstate.state_processor.savepoint import RawEntry, Savepoint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeyGroupStats:
    """One state's share of one key group."""

    operator_id: str
    state: str
    key_group: int
    keys: int
    entries: int
    """Stored entries: one per key for value and reducing state, one per element or map entry otherwise."""
    bytes: int


@dataclass(frozen=True)
class KeyStats:
    """One key of one state, with everything stored under it."""

    operator_id: str
    state: str
    key_group: int
    key: bytes
    namespace: bytes
    entries: int
    bytes: int


@dataclass(frozen=True)
class Summary:
    """Per-key-group counts of every state, and the largest keys (largest first)."""

    key_groups: tuple[KeyGroupStats, ...]
    largest_keys: tuple[KeyStats, ...]


def summarize(savepoint: Savepoint, largest: int = 10) -> Summary:
    """Scan every state of every operator once; ``largest`` keys by bytes are kept."""
    groups: list[KeyGroupStats] = []
    heap: list[tuple[int, int, KeyStats]] = []
    counter = 0
    for op in savepoint.operators:
        for d in op.states:
            for stats, keys in _state_stats(op.operator_id, d.name, savepoint.entries(op.operator_id, d.name)):
                groups.append(stats)
                for k in keys:
                    counter += 1
                    item = (k.bytes, -counter, k)
                    if len(heap) < largest:
                        heapq.heappush(heap, item)
                    elif largest > 0 and item > heap[0]:
                        heapq.heapreplace(heap, item)
    ranked = tuple(item[2] for item in sorted(heap, reverse=True))
    return Summary(tuple(groups), ranked)


def _state_stats(
    operator_id: str, state: str, entries: Iterator[RawEntry]
) -> Iterator[tuple[KeyGroupStats, list[KeyStats]]]:
    """Per key group: its counts and its keys (entries arrive sorted, so each key is contiguous)."""
    group = -1
    keys: list[KeyStats] = []
    current: tuple[bytes, bytes] | None = None
    n_entries = n_bytes = 0

    def close_key() -> None:
        if current is not None:
            keys.append(KeyStats(operator_id, state, group, current[0], current[1], n_entries, n_bytes))

    for e in entries:
        if e.key_group != group:
            close_key()
            if keys:
                yield _group(operator_id, state, group, keys), keys
            group, keys, current = e.key_group, [], None
        if (e.key, e.namespace) != current:
            close_key()
            current, n_entries, n_bytes = (e.key, e.namespace), 0, 0
        n_entries += 1
        n_bytes += e.size
    close_key()
    if keys:
        yield _group(operator_id, state, group, keys), keys


def _group(operator_id: str, state: str, group: int, keys: list[KeyStats]) -> KeyGroupStats:
    return KeyGroupStats(operator_id, state, group, len(keys), sum(k.entries for k in keys), sum(k.bytes for k in keys))
