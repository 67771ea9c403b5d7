"""The TaskManager-wide RocksDB memory budget, and the only place that builds ``rocksdict.Options``.

As in Flink's managed memory for RocksDB, every slot of a TaskManager shares ONE block cache
and ONE ``WriteBufferManager``. The write buffer manager charges memtable memory to the cache,
so block cache plus memtables together stay within the cache capacity::

    write buffers  = managed * write-buffer-ratio
    block cache    = state.backend.rocksdb.block.cache-size (default: managed - write buffers)
    cache capacity = block cache + write buffers
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import rocksdict

from keyedstate.common.config import Configuration, options
from keyedstate.common.errors import ConfigError

logger = logging.getLogger(__name__)

_BLOOM_BITS_PER_KEY = 10
_LOCK = threading.Lock()


@dataclass(frozen=True)
class SharedRocksDBMemory:
    """The cache and write buffer manager every RocksDB instance of the TaskManager uses."""

    cache: rocksdict.Cache
    write_buffer_manager: rocksdict.WriteBufferManager
    capacity_bytes: int


@dataclass(frozen=True)
class RocksDBResources:
    """Memory and thread settings shared by all RocksDB instances of one TaskManager."""

    managed_bytes: int = 256 << 20
    """Total budget (``taskmanager.memory.managed.size``)."""
    block_cache_bytes: int | None = None
    """Block cache size (``state.backend.rocksdb.block.cache-size``); None derives it."""
    write_buffer_ratio: float = 0.5
    """Share of ``managed_bytes`` for all memtables together."""
    writebuffer_size: int = 64 << 20
    """One memtable (per column family)."""
    writebuffer_count: int = 2
    threads: int = 2
    """Background flush/compaction jobs per instance."""
    bloom: bool = True
    _shared: list[SharedRocksDBMemory] = field(default_factory=list, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.managed_bytes < 1 << 20:
            raise ConfigError(
                f"taskmanager.memory.managed.size must be at least 1mb for RocksDB, got {self.managed_bytes} bytes"
            )
        if not 0.0 < self.write_buffer_ratio < 1.0:
            raise ConfigError(
                f"state.backend.rocksdb.memory.write-buffer-ratio must be between 0 and 1 (exclusive), got {self.write_buffer_ratio}"
            )
        if self.block_cache_bytes is not None and self.block_cache_bytes < 1:
            raise ConfigError(f"state.backend.rocksdb.block.cache-size must be positive, got {self.block_cache_bytes}")
        if self.writebuffer_size < 64 << 10:
            raise ConfigError(
                f"state.backend.rocksdb.writebuffer.size must be at least 64kb, got {self.writebuffer_size} bytes"
            )
        if self.writebuffer_count < 1 or self.threads < 1:
            raise ConfigError(
                "state.backend.rocksdb.writebuffer.count and state.backend.rocksdb.thread.num must be at least 1"
            )

    @classmethod
    def from_config(cls, conf: Configuration) -> RocksDBResources:
        return cls(
            managed_bytes=conf.get(options.MANAGED_MEMORY),
            block_cache_bytes=conf.get(options.ROCKSDB_BLOCK_CACHE),
            write_buffer_ratio=conf.get(options.ROCKSDB_WRITE_BUFFER_RATIO),
            writebuffer_size=conf.get(options.ROCKSDB_WRITEBUFFER_SIZE),
            writebuffer_count=conf.get(options.ROCKSDB_WRITEBUFFER_COUNT),
            threads=conf.get(options.ROCKSDB_THREADS),
            bloom=conf.get(options.ROCKSDB_BLOOM),
        )

    @property
    def write_buffer_bytes(self) -> int:
        """The share of managed memory for write buffers (memtables), in bytes."""
        return int(self.managed_bytes * self.write_buffer_ratio)

    @property
    def effective_block_cache_bytes(self) -> int:
        """The block cache size in bytes: the configured one, or managed memory minus the write buffers."""
        if self.block_cache_bytes is not None:
            return self.block_cache_bytes
        return self.managed_bytes - self.write_buffer_bytes

    def shared(self) -> SharedRocksDBMemory:
        """The one cache and write buffer manager of this TaskManager (created on first use)."""
        with _LOCK:
            if not self._shared:
                capacity = self.effective_block_cache_bytes + self.write_buffer_bytes
                cache = rocksdict.Cache(capacity)
                # allow_stall=False: at the limit RocksDB flushes early instead of blocking writers.
                wbm = rocksdict.WriteBufferManager.new_write_buffer_manager_with_cache(
                    self.write_buffer_bytes, False, cache
                )
                self._shared.append(SharedRocksDBMemory(cache, wbm, capacity))
                logger.info(
                    "RocksDB managed memory: cache capacity %d bytes (block cache %d + write buffers %d)",
                    capacity,
                    self.effective_block_cache_bytes,
                    self.write_buffer_bytes,
                )
            return self._shared[0]

    def _column_family_options(self, shared: SharedRocksDBMemory) -> rocksdict.Options:
        # raw_mode must match on every open, or rocksdict rewrites the DB's saved config.
        opts = rocksdict.Options(raw_mode=True)
        table = rocksdict.BlockBasedOptions()
        table.set_block_cache(shared.cache)
        table.set_cache_index_and_filter_blocks(True)
        table.set_pin_l0_filter_and_index_blocks_in_cache(True)
        if self.bloom:
            table.set_bloom_filter(_BLOOM_BITS_PER_KEY, False)
        opts.set_block_based_table_factory(table)
        opts.set_write_buffer_size(self.writebuffer_size)
        opts.set_max_write_buffer_number(self.writebuffer_count)
        opts.set_level_compaction_dynamic_level_bytes(True)
        return opts

    def column_family_options(self) -> rocksdict.Options:
        """Options for one column family (DB-level options do not reach new column families)."""
        return self._column_family_options(self.shared())

    def db_options(self) -> rocksdict.Options:
        """Options for opening a slot's DB (also used for its default column family)."""
        shared = self.shared()
        opts = self._column_family_options(shared)
        opts.create_if_missing(True)
        opts.create_missing_column_families(True)
        opts.increase_parallelism(self.threads)
        opts.set_max_background_jobs(self.threads)
        opts.set_write_buffer_manager(shared.write_buffer_manager)
        opts.set_keep_log_file_num(2)
        opts.set_max_log_file_size(8 << 20)
        return opts

    @staticmethod
    def plain_options() -> rocksdict.Options:
        """Options for read-only opens of snapshots and for SST writers (no shared memory)."""
        return rocksdict.Options(raw_mode=True)


DEFAULT_RESOURCES = RocksDBResources()
"""Used when a backend is created without resources (tests, tools); shared by all of them."""
