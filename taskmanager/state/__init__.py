"""Per-slot keyed state: the backend API and its RocksDB and HashMap implementations.

Pure domain code (no gRPC): the TaskManager's servicers translate requests into these calls.
"""

from keyedstate.taskmanager.state.backend import KeyedStateBackend, slot_db_dir
from keyedstate.taskmanager.state.factory import create_backend, restore_backend
from keyedstate.taskmanager.state.hashmap import HashMapKeyedStateBackend
from keyedstate.taskmanager.state.limits import StateLimits
from keyedstate.taskmanager.state.mutation import Mutation, MutationKind
from keyedstate.taskmanager.state.resources import RocksDBResources
from keyedstate.taskmanager.state.rocksdb import RocksDBKeyedStateBackend
from keyedstate.taskmanager.state.snapshot import LocalSnapshot, SnapshotManifest

__all__ = [
    "HashMapKeyedStateBackend",
    "KeyedStateBackend",
    "LocalSnapshot",
    "Mutation",
    "MutationKind",
    "RocksDBKeyedStateBackend",
    "RocksDBResources",
    "SnapshotManifest",
    "StateLimits",
    "create_backend",
    "restore_backend",
    "slot_db_dir",
]
