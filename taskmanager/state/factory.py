"""Choosing a backend by name (``state.backend.type``): creating it empty or restoring it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from keyedstate.common.clock import Clock
from keyedstate.common.descriptors import StateDescriptor
from keyedstate.common.errors import ConfigError
from keyedstate.common.ids import KeyGroupRange, SubtaskId
from keyedstate.taskmanager.state.backend import KeyedStateBackend
from keyedstate.taskmanager.state.hashmap import HashMapKeyedStateBackend
from keyedstate.taskmanager.state.limits import StateLimits
from keyedstate.taskmanager.state.resources import RocksDBResources
from keyedstate.taskmanager.state.rocksdb import RocksDBKeyedStateBackend

logger = logging.getLogger(__name__)

BACKENDS: dict[str, type[KeyedStateBackend]] = {
    RocksDBKeyedStateBackend.BACKEND_KIND: RocksDBKeyedStateBackend,
    HashMapKeyedStateBackend.BACKEND_KIND: HashMapKeyedStateBackend,
}


def backend_class(kind: str) -> type[KeyedStateBackend]:
    try:
        return BACKENDS[kind]
    except KeyError:
        raise ConfigError(
            f"state.backend.type: unknown backend {kind!r}; use one of {', '.join(sorted(BACKENDS))}"
        ) from None


def create_backend(
    kind: str,
    subtask: SubtaskId,
    key_groups: KeyGroupRange,
    max_parallelism: int,
    states: Sequence[StateDescriptor],
    *,
    local_dir: Path,
    limits: StateLimits,
    clock: Clock,
    resources: RocksDBResources | None = None,
) -> KeyedStateBackend:
    """A backend for one slot. RocksDB keeps data already in ``local_dir/<instance>/db``."""
    cls = backend_class(kind)
    return cls(  # type: ignore[call-arg]  # the abstract __init__ lacks the keywords both concrete backends take
        subtask,
        key_groups,
        max_parallelism,
        states,
        local_dir=local_dir,
        limits=limits,
        clock=clock,
        resources=resources,
    )


def restore_backend(
    kind: str,
    subtask: SubtaskId,
    key_groups: KeyGroupRange,
    max_parallelism: int,
    states: Sequence[StateDescriptor],
    *,
    snapshot_dirs: Sequence[Path],
    local_dir: Path,
    limits: StateLimits,
    clock: Clock,
    resources: RocksDBResources | None = None,
) -> KeyedStateBackend:
    """A backend for ``key_groups`` from local snapshots written by either backend."""
    return backend_class(kind).restore(
        subtask,
        key_groups,
        max_parallelism,
        states,
        snapshot_dirs=snapshot_dirs,
        local_dir=local_dir,
        limits=limits,
        clock=clock,
        resources=resources,
    )
