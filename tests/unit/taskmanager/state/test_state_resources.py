"""RocksDBResources and StateLimits: configuration keys, derived sizes, one shared cache per TaskManager."""

from __future__ import annotations

from pathlib import Path

import pytest
import rocksdict

from keyedstate.common.config import Configuration
from keyedstate.common.descriptors import StateDescriptor, StateKind
from keyedstate.common.errors import ConfigError
from keyedstate.common.ids import KeyGroupRange, SubtaskId
from keyedstate.taskmanager.state import RocksDBResources, StateLimits, create_backend
from tests.fakes.clock import ManualClock


def test_from_config_reads_every_key() -> None:
    conf = Configuration(
        {
            "taskmanager.memory.managed.size": "512mb",
            "state.backend.rocksdb.block.cache-size": "100mb",
            "state.backend.rocksdb.memory.write-buffer-ratio": 0.25,
            "state.backend.rocksdb.writebuffer.size": "8mb",
            "state.backend.rocksdb.writebuffer.count": 3,
            "state.backend.rocksdb.thread.num": 4,
            "state.backend.rocksdb.use-bloom-filter": "false",
        }
    )
    r = RocksDBResources.from_config(conf)
    assert r == RocksDBResources(512 << 20, 100 << 20, 0.25, 8 << 20, 3, 4, False)
    assert r.write_buffer_bytes == 128 << 20 and r.effective_block_cache_bytes == 100 << 20


def test_defaults_split_managed_memory_between_cache_and_write_buffers() -> None:
    r = RocksDBResources.from_config(Configuration({"taskmanager.memory.managed.size": "64mb"}))
    assert r.write_buffer_bytes == 32 << 20
    assert r.effective_block_cache_bytes == 32 << 20
    assert r.shared().capacity_bytes == 64 << 20


@pytest.mark.parametrize(
    "values, key",
    [
        ({"state.backend.rocksdb.memory.write-buffer-ratio": 1.5}, "write-buffer-ratio"),
        ({"state.backend.rocksdb.memory.write-buffer-ratio": 0}, "write-buffer-ratio"),
        ({"taskmanager.memory.managed.size": "100kb"}, "taskmanager.memory.managed.size"),
        ({"state.backend.rocksdb.writebuffer.size": "1kb"}, "writebuffer.size"),
        ({"state.backend.rocksdb.thread.num": "lots"}, "thread.num"),
    ],
)
def test_unusable_values_name_their_key(values: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        RocksDBResources.from_config(Configuration(values))


def test_one_cache_and_write_buffer_manager_per_resources() -> None:
    r = RocksDBResources(managed_bytes=8 << 20)
    first, second = r.shared(), r.shared()
    assert first is second
    assert first.write_buffer_manager.get_buffer_size() == 4 << 20
    assert isinstance(r.db_options(), rocksdict.Options) and isinstance(r.column_family_options(), rocksdict.Options)


def test_backends_of_one_taskmanager_charge_the_same_cache(tmp_path: Path) -> None:
    r = RocksDBResources(managed_bytes=16 << 20)
    states = [StateDescriptor("v", StateKind.VALUE)]
    backends = [
        create_backend(
            "rocksdb",
            SubtaskId("j", "op", i),
            KeyGroupRange(0, 127),
            128,
            states,
            local_dir=tmp_path,
            limits=StateLimits(),
            clock=ManualClock(),
            resources=r,
        )
        for i in range(2)
    ]
    try:
        for b in backends:
            b.value_put("v", [b"k%d" % i for i in range(2000)], [b"x" * 200] * 2000, b"")
        usage = r.shared().write_buffer_manager.get_usage()
        assert usage > 0
        stats = [b.stats() for b in backends]
        assert stats[0]["block-cache-capacity"] == stats[1]["block-cache-capacity"] == 16 << 20
        assert stats[0]["write-buffer-manager-usage"] == stats[1]["write-buffer-manager-usage"]
    finally:
        for b in backends:
            b.close()


def test_state_limits_from_config_and_validation() -> None:
    conf = Configuration(
        {
            "state.limits.max-key-bytes": "1kb",
            "state.limits.max-value-bytes": "2mb",
            "state.limits.list.max-response-bytes": "3mb",
            "state.limits.list.max-elements": 5,
        }
    )
    assert StateLimits.from_config(conf) == StateLimits(1024, 2 << 20, 3 << 20, 5)
    assert StateLimits.from_config(Configuration()) == StateLimits()
    with pytest.raises(ConfigError, match="^state.limits.list.max-elements: must be at least 1"):
        StateLimits(max_list_elements=0)
