"""Configuration parsing: typed values, legacy keys, YAML files (flat and nested) and -D overrides."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from keyedstate.common.config import Configuration, parse_duration_ms, parse_memory_bytes
from keyedstate.common.config import options as o
from keyedstate.common.config._parsers import bool_parser, enum_parser, int_parser, port_range_parser
from keyedstate.common.errors import ConfigError, Reason

CONFIG_LOGGER = "keyedstate.common.config._configuration"


# -- durations -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw,ms",
    [
        ("10 s", 10_000),
        ("500ms", 500),
        ("1 min", 60_000),
        ("1.5 s", 1_500),
        ("2h", 7_200_000),
        ("1d", 86_400_000),
        ("30", 30),
        ("0", 0),
        (" 10  s ", 10_000),
        ("10 S", 10_000),
        ("3 seconds", 3_000),
        ("2 mins", 120_000),
        (250, 250),
        (0, 0),
    ],
)
def test_durations(raw: Any, ms: int) -> None:
    assert parse_duration_ms(raw, "heartbeat.timeout") == ms


@pytest.mark.parametrize("raw", ["5parsecs", "", "s", "1e3", "ten s", "1.5.2 s", "-5 s", -1, True, "10 s 5 ms"])
def test_bad_durations_name_the_key_and_the_units(raw: Any) -> None:
    with pytest.raises(ConfigError) as info:
        parse_duration_ms(raw, "heartbeat.timeout")
    assert info.value.message.startswith("heartbeat.timeout: ")
    assert info.value.reason is Reason.CONFIG


def test_bad_duration_message_lists_the_units() -> None:
    with pytest.raises(ConfigError, match=r"ms, s, min, h or d \(for example '30 s'\)"):
        parse_duration_ms("5parsecs", "heartbeat.timeout")


@pytest.mark.parametrize("raw", [None, "", "none", "off", "disabled"])
def test_optional_duration_can_be_disabled(raw: Any) -> None:
    assert Configuration({"execution.checkpointing.interval": raw}).get(o.CHECKPOINT_INTERVAL) is None


# -- memory sizes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw,size",
    [
        ("256mb", 256 << 20),
        ("1 gb", 1 << 30),
        ("64k", 64 << 10),
        ("100", 100),
        ("100b", 100),
        ("0.5kb", 512),
        ("1.5 GB", 3 << 29),
        ("2 mebibytes", 2 << 20),
        ("1t", 1 << 40),
        (4096, 4096),
    ],
)
def test_memory_sizes(raw: Any, size: int) -> None:
    assert parse_memory_bytes(raw, "taskmanager.memory.managed.size") == size


@pytest.mark.parametrize("raw", ["lots", "1 pb", "", "-1", -1, True, "10 mib", "mb"])
def test_bad_memory_sizes_name_the_key(raw: Any) -> None:
    with pytest.raises(ConfigError) as info:
        parse_memory_bytes(raw, "taskmanager.memory.managed.size")
    assert info.value.message.startswith("taskmanager.memory.managed.size: ")


# -- ports, booleans, enums, integers ------------------------------------------------------------


@pytest.mark.parametrize(
    "raw,expected",
    [
        ("9249", (9249, 9249)),
        ("9250-9260", (9250, 9260)),
        (" 9250 - 9260 ", (9250, 9260)),
        ("0", (0, 0)),
        ("-1", (-1, -1)),
        (9249, (9249, 9249)),
    ],
)
def test_port_ranges(raw: Any, expected: tuple[int, int]) -> None:
    assert port_range_parser("metrics.reporter.prom.port", raw) == expected


@pytest.mark.parametrize(
    "raw,fragment",
    [
        ("9260-9250", "not a valid port range"),
        ("70000", "not a valid port range"),
        ("-5", "not a valid port range"),
        ("abc", "expected a port or a range"),
        ("1-2-3", "expected a port or a range"),
    ],
)
def test_bad_port_ranges(raw: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=f"^metrics.reporter.prom.port: .*{fragment}"):
        port_range_parser("metrics.reporter.prom.port", raw)


def test_single_ports_are_bounded() -> None:
    assert Configuration({"jobmanager.rpc.port": "65535"}).get(o.JOBMANAGER_PORT) == 65535
    with pytest.raises(ConfigError, match="jobmanager.rpc.port: must be at most 65535"):
        Configuration({"jobmanager.rpc.port": "65536"}).get(o.JOBMANAGER_PORT)
    with pytest.raises(ConfigError, match="jobmanager.rpc.port: expected an integer"):
        Configuration({"jobmanager.rpc.port": "http"}).get(o.JOBMANAGER_PORT)


@pytest.mark.parametrize(
    "raw,value",
    [
        (True, True),
        (False, False),
        ("true", True),
        ("Yes", True),
        ("on", True),
        ("1", True),
        (1, True),
        ("FALSE", False),
        ("no", False),
        ("off", False),
        ("0", False),
        (0, False),
    ],
)
def test_booleans(raw: Any, value: bool) -> None:
    assert bool_parser("state.backend.rocksdb.use-bloom-filter", raw) is value


@pytest.mark.parametrize("raw", ["maybe", "", None, 2, "t"])
def test_bad_booleans(raw: Any) -> None:
    with pytest.raises(ConfigError, match="^state.backend.rocksdb.use-bloom-filter: expected true or false"):
        bool_parser("state.backend.rocksdb.use-bloom-filter", raw)


def test_enums_are_case_insensitive_and_list_the_choices() -> None:
    parse = enum_parser("rocksdb", "hashmap")
    assert parse("state.backend.type", "RocksDB") == "rocksdb"
    assert parse("state.backend.type", " hashmap ") == "hashmap"
    with pytest.raises(ConfigError, match="^state.backend.type: 'filesystem' is not one of rocksdb, hashmap$"):
        parse("state.backend.type", "filesystem")


@pytest.mark.parametrize(
    "raw,fragment",
    [
        ("abc", "expected an integer, got 'abc'"),
        (True, "expected an integer"),
        (2.5, "expected an integer"),
        ("0", "must be at least 1, got 0"),
        ("5000", "must be at most 4096, got 5000"),
    ],
)
def test_bad_integers(raw: Any, fragment: str) -> None:
    with pytest.raises(ConfigError, match=f"^taskmanager.numberOfTaskSlots: {fragment}"):
        int_parser(1, 4096)("taskmanager.numberOfTaskSlots", raw)


def test_integers_accept_yaml_ints_and_padded_strings() -> None:
    parse = int_parser(1, 4096)
    assert parse("taskmanager.numberOfTaskSlots", 4) == 4
    assert parse("taskmanager.numberOfTaskSlots", " 7 ") == 7


def test_defaults_apply_when_unset() -> None:
    conf = Configuration()
    assert conf.get(o.TASKMANAGER_SLOTS) == 1
    assert conf.get(o.HEARTBEAT_TIMEOUT) == 50_000
    assert conf.get(o.STATE_BACKEND) == "rocksdb"
    assert conf.get(o.CHECKPOINTS_DIR) is None
    assert not conf.is_set(o.TASKMANAGER_SLOTS)


# -- legacy keys ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "legacy_value,backend",
    [("filesystem", "hashmap"), ("jobmanager", "hashmap"), ("rocksdb", "rocksdb"), ("FileSystem", "hashmap")],
)
def test_legacy_state_backend_maps_with_a_deprecation_warning(
    caplog: pytest.LogCaptureFixture, legacy_value: str, backend: str
) -> None:
    conf = Configuration({"state.backend": legacy_value})
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        assert conf.get(o.STATE_BACKEND) == backend
        assert conf.get(o.STATE_BACKEND) == backend
    warnings = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(warnings) == 1, "warn once per key, not per read"
    assert "'state.backend'" in warnings[0] and "'state.backend.type'" in warnings[0]
    assert conf.is_set(o.STATE_BACKEND)


def test_legacy_checkpoint_keys() -> None:
    conf = Configuration({"state.checkpoints.num-retained": "3", "state.backend.incremental": "true"})
    assert conf.get(o.CHECKPOINT_NUM_RETAINED) == 3
    assert conf.get(o.CHECKPOINT_INCREMENTAL) is True


def test_new_key_wins_over_its_legacy_key() -> None:
    conf = Configuration(
        {
            "state.backend": "filesystem",
            "state.backend.type": "rocksdb",
            "state.checkpoints.num-retained": "3",
            "execution.checkpointing.num-retained": "5",
        }
    )
    assert conf.get(o.STATE_BACKEND) == "rocksdb"
    assert conf.get(o.CHECKPOINT_NUM_RETAINED) == 5


def test_bad_legacy_value_is_reported_under_the_legacy_key() -> None:
    with pytest.raises(ConfigError, match="^state.backend.incremental: expected true or false, got 'sometimes'"):
        Configuration.load(overrides=["state.backend.incremental=sometimes"])
    with pytest.raises(ConfigError, match="^state.backend: 'cassandra' is not one of rocksdb, hashmap"):
        Configuration.load(overrides=["state.backend=cassandra"])


def test_legacy_keys_are_not_unknown(caplog: pytest.LogCaptureFixture) -> None:
    conf = Configuration({"state.backend": "filesystem", "state.checkpoints.num-retained": 2})
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        warnings = conf.validate()
    assert warnings == []
    assert any("deprecated" in r.getMessage() for r in caplog.records)


# -- unknown keys --------------------------------------------------------------------------------


def test_unknown_key_warns_naming_the_closest_key(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        conf = Configuration.load(overrides=["taskmanager.numberOfTaskSlot=4", "heartbeat.timout=5 s"])
    messages = [r.getMessage() for r in caplog.records]
    assert (
        "unknown config key 'taskmanager.numberOfTaskSlot' is ignored; did you mean 'taskmanager.numberOfTaskSlots'?"
        in messages
    )
    assert "unknown config key 'heartbeat.timout' is ignored; did you mean 'heartbeat.timeout'?" in messages
    # Ignored, as announced: the real keys keep their defaults.
    assert conf.get(o.TASKMANAGER_SLOTS) == 1 and conf.get(o.HEARTBEAT_TIMEOUT) == 50_000


def test_unknown_key_without_a_close_match_has_no_hint() -> None:
    assert Configuration({"zzz.qqq": 1}).validate() == ["unknown config key 'zzz.qqq' is ignored"]


# -- YAML files ----------------------------------------------------------------------------------


def test_nested_yaml_is_flattened_and_mixes_with_flat_keys(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "taskmanager:\n"
        "  numberOfTaskSlots: 4\n"
        "  memory:\n"
        "    managed:\n"
        "      size: 512mb\n"
        "state.backend.type: hashmap\n"
        "heartbeat:\n"
        "  interval: 2 s\n"
        "  timeout: 20 s\n"
        "execution.checkpointing:\n"
        "  incremental: true\n"
    )
    conf = Configuration.load(path)
    assert conf.get(o.TASKMANAGER_SLOTS) == 4
    assert conf.get(o.MANAGED_MEMORY) == 512 << 20
    assert conf.get(o.STATE_BACKEND) == "hashmap"
    assert (conf.get(o.HEARTBEAT_INTERVAL), conf.get(o.HEARTBEAT_TIMEOUT)) == (2_000, 20_000)
    assert conf.get(o.CHECKPOINT_INCREMENTAL) is True
    assert "taskmanager.memory.managed.size" in conf.to_dict()


def test_overrides_win_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("taskmanager:\n  numberOfTaskSlots: 4\njobmanager.rpc.address: jm.example\n")
    conf = Configuration.load(path, ["taskmanager.numberOfTaskSlots=8", " jobmanager.rpc.port = 7000 "])
    assert conf.get(o.TASKMANAGER_SLOTS) == 8
    assert conf.get(o.JOBMANAGER_ADDRESS) == "jm.example"
    assert conf.get(o.JOBMANAGER_PORT) == 7000


def test_empty_yaml_file_is_an_empty_configuration(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("# nothing set yet\n")
    assert Configuration.load(path).to_dict() == {}


@pytest.mark.parametrize(
    "content,fragment",
    [
        ("- a\n- b\n", "must hold a mapping of keys to values, not list"),
        ("42\n", "must hold a mapping of keys to values, not int"),
        ("a: [\n", "is not valid YAML at line 2, column 1"),
        ("a: 1\n\tb: 2\n", "is not valid YAML at line 2"),
        (b"\xff\xfe\x00", "is not UTF-8 text"),
    ],
)
def test_bad_yaml_files(tmp_path: Path, content: str | bytes, fragment: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError) as info:
        Configuration.load(path)
    assert str(path) in info.value.message and fragment in info.value.message
    assert "\n" not in info.value.message  # one line, for the daemon's one-line start-up error


def test_missing_or_unreadable_yaml_file(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match="cannot read config file .*No such file.*pass an existing YAML file to --config"
    ):
        Configuration.load(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="cannot read config file .*Is a directory"):
        Configuration.load(tmp_path)


def test_bad_value_in_the_file_names_the_flattened_key(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("heartbeat:\n  timeout: 5parsecs\n")
    with pytest.raises(ConfigError, match="^heartbeat.timeout: cannot parse duration '5parsecs'"):
        Configuration.load(path)


# -- -D overrides --------------------------------------------------------------------------------


@pytest.mark.parametrize("item", ["novalue", "=4", " = 4", ""])
def test_malformed_overrides(item: str) -> None:
    with pytest.raises(ConfigError) as info:
        Configuration.load(overrides=[item])
    assert f"-D {item!r}: expected key=value" in info.value.message
    assert "-D taskmanager.numberOfTaskSlots=4" in info.value.message


def test_override_values_may_contain_equals_signs() -> None:
    conf = Configuration.load(overrides=["state.checkpoints.dir=s3://bucket/path?a=b"])
    assert conf.get(o.CHECKPOINTS_DIR) == "s3://bucket/path?a=b"


def test_override_with_a_bad_value_is_refused_at_load() -> None:
    with pytest.raises(ConfigError, match="^taskmanager.numberOfTaskSlots: expected an integer, got 'abc'"):
        Configuration.load(overrides=["taskmanager.numberOfTaskSlots=abc"])


@pytest.mark.parametrize(
    "key,raw",
    [
        *(
            (key, raw)
            for key in (
                "state.limits.max-key-bytes",
                "state.limits.max-value-bytes",
                "state.limits.list.max-response-bytes",
            )
            for raw in ("0", "0 kb", "0.5")
        ),
        ("state.limits.list.max-elements", "0"),
    ],
)
def test_a_zero_limit_is_refused_naming_the_config_key(key: str, raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        Configuration.load(overrides=[f"{key}={raw}"])
    assert info.value.message.startswith(f"{key}: must be at least 1"), info.value.message
    assert "StateLimits" not in info.value.message and "max_" not in info.value.message


def test_state_limits_name_the_config_key() -> None:
    from keyedstate.taskmanager.state import StateLimits

    with pytest.raises(ConfigError, match="^state.limits.max-value-bytes: must be at least 1, got 0$"):
        StateLimits(max_value_bytes=0)


def test_every_option_default_passes_its_own_parser() -> None:
    for option in o.ALL:
        if option.default is None:
            continue
        raw = option.default
        if option.type_name == "port range":
            raw = f"{raw[0]}-{raw[1]}"
        assert option.parser(option.key, raw) == option.default, option.key


def test_per_job_values_are_layered_on_a_copy() -> None:
    base = Configuration({"execution.checkpointing.timeout": "1 min"})
    job = base.with_values({"execution.checkpointing": {"timeout": "10 s"}})
    assert job.get(o.CHECKPOINT_TIMEOUT) == 10_000
    assert base.get(o.CHECKPOINT_TIMEOUT) == 60_000


# -- Flink's state backend and checkpoint storage names -------------------------------------------


@pytest.mark.parametrize(
    "value,backend",
    [
        ("HashMapStateBackend", "hashmap"),
        ("org.apache.flink.runtime.state.hashmap.HashMapStateBackend", "hashmap"),
        ("MemoryStateBackend", "hashmap"),
        ("org.apache.flink.runtime.state.memory.MemoryStateBackend", "hashmap"),
        ("FsStateBackend", "hashmap"),
        ("org.apache.flink.runtime.state.filesystem.FsStateBackend", "hashmap"),
        ("EmbeddedRocksDBStateBackend", "rocksdb"),
        ("org.apache.flink.contrib.streaming.state.EmbeddedRocksDBStateBackend", "rocksdb"),
        ("org.apache.flink.state.rocksdb.EmbeddedRocksDBStateBackend", "rocksdb"),
        ("RocksDBStateBackend", "rocksdb"),
        ("org.apache.flink.contrib.streaming.state.RocksDBStateBackendFactory", "rocksdb"),
        ("jobmanager", "hashmap"),
        ("filesystem", "hashmap"),
    ],
)
@pytest.mark.parametrize("key", ["state.backend.type", "state.backend"])
def test_flink_class_names_and_legacy_values_map_with_a_warning_naming_key_and_value(
    caplog: pytest.LogCaptureFixture, key: str, value: str, backend: str
) -> None:
    conf = Configuration.load(overrides=[f"{key}={value}"])
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        assert conf.get(o.STATE_BACKEND) == backend
    warnings = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert repr(value) in warnings[0] and f"; set state.backend.type: {backend}" in warnings[0]
    memory = value in ("jobmanager", "MemoryStateBackend", "org.apache.flink.runtime.state.memory.MemoryStateBackend")
    note = " (Flink's MemoryStateBackend also kept checkpoints in the JobManager's memory; for that, also set "
    assert (note in warnings[0]) is memory, warnings[0]
    assert warnings[0].endswith("execution.checkpointing.storage: jobmanager)" if memory else backend)


@pytest.mark.parametrize("value", ["rocksdb", "hashmap", "RocksDB", " hashmap "])
def test_current_backend_names_draw_no_warning(caplog: pytest.LogCaptureFixture, value: str) -> None:
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        conf = Configuration.load(overrides=[f"state.backend.type={value}"])
        assert conf.get(o.STATE_BACKEND) == value.strip().lower()
    assert not caplog.records


@pytest.mark.parametrize("value", ["forst", "ForSt", "org.apache.flink.state.forst.ForStStateBackend"])
@pytest.mark.parametrize("key", ["state.backend.type", "state.backend"])
def test_forst_is_refused_naming_what_this_runtime_offers_instead(key: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        Configuration.load(overrides=[f"{key}={value}"])
    message = info.value.message
    assert message.startswith(f"{key}: {value!r} is not supported: ForSt keeps the working state on remote storage")
    assert "execution.state-recovery.from-local" in message and "state.changelog.enabled" in message
    assert message.endswith("set state.backend.type: rocksdb")


def test_an_unknown_class_name_is_not_guessed() -> None:
    with pytest.raises(
        ConfigError, match="^state.backend.type: 'org.apache.flink.Other' is not one of rocksdb, hashmap"
    ):
        Configuration.load(overrides=["state.backend.type=org.apache.flink.Other"])


@pytest.mark.parametrize("key", ["execution.checkpointing.storage", "state.checkpoint-storage"])
@pytest.mark.parametrize(
    "value,storage",
    [
        ("filesystem", "filesystem"),
        ("FileSystemCheckpointStorage", "filesystem"),
        ("org.apache.flink.runtime.state.storage.FileSystemCheckpointStorage", "filesystem"),
        ("jobmanager", "jobmanager"),
        ("JobManagerCheckpointStorage", "jobmanager"),
        ("org.apache.flink.runtime.state.storage.JobManagerCheckpointStorage", "jobmanager"),
    ],
)
def test_checkpoint_storage_under_flinks_keys_names_and_class_names(
    caplog: pytest.LogCaptureFixture, key: str, value: str, storage: str
) -> None:
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        assert Configuration.load(overrides=[f"{key}={value}"]).get(o.CHECKPOINT_STORAGE) == storage
    warnings = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(warnings) == (key != o.CHECKPOINT_STORAGE.key or value != storage)
    assert all(w.endswith(f"set execution.checkpointing.storage: {storage}") for w in warnings)


def test_checkpoint_storage_defaults_to_filesystem_and_refuses_other_names() -> None:
    assert Configuration().get(o.CHECKPOINT_STORAGE) == "filesystem"
    assert not o.checkpoints_in_jobmanager_memory(Configuration())
    with pytest.raises(
        ConfigError, match="^execution.checkpointing.storage: 'rocksdb' is not one of filesystem, jobmanager"
    ):
        Configuration.load(overrides=["execution.checkpointing.storage=rocksdb"])


def test_jobmanager_storage_max_state_size_defaults_to_flinks_5_mb() -> None:
    assert Configuration().get(o.JOBMANAGER_STORAGE_MAX_STATE_SIZE) == 5 << 20
    key = o.JOBMANAGER_STORAGE_MAX_STATE_SIZE.key
    assert Configuration.load(overrides=[f"{key}=64kb"]).get(o.JOBMANAGER_STORAGE_MAX_STATE_SIZE) == 64 << 10
    with pytest.raises(ConfigError, match=f"^{key}: must be at least 1 byte"):
        Configuration.load(overrides=[f"{key}=0"])


def test_jobmanager_storage_is_refused_with_high_availability() -> None:
    conf = Configuration.load(overrides=["execution.checkpointing.storage=jobmanager"])
    assert o.checkpoints_in_jobmanager_memory(conf)
    conf = Configuration.load(
        overrides=["execution.checkpointing.storage=jobmanager", "high-availability.type=filesystem"]
    )
    with pytest.raises(ConfigError) as info:
        o.checkpoints_in_jobmanager_memory(conf)
    assert info.value.message == (
        "execution.checkpointing.storage: jobmanager keeps checkpoints in the JobManager's memory, which a restarted "
        "JobManager cannot find, so it cannot be combined with high-availability.type: filesystem; set "
        "execution.checkpointing.storage: filesystem with state.checkpoints.dir, or high-availability.type: none"
    )
