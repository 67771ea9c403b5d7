"""URL routing, lazy imports and missing dependencies; HDFS routing (no HDFS can run here)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from keyedstate.common.errors import ConfigError, InvalidArgumentError, StorageError
from keyedstate.common.storage import (
    HdfsStorage,
    LocalStorage,
    RetryPolicy,
    S3Storage,
    _registry,
    join_url,
    open_storage,
    register_storage,
    scheme_of,
    supported_schemes,
)


class RecordingWaiter:
    def __init__(self) -> None:
        self.waits: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        return False


@pytest.mark.parametrize(
    ("url", "cls"),
    [
        ("/var/checkpoints", LocalStorage),
        ("relative/dir", LocalStorage),
        ("file:///var/checkpoints", LocalStorage),
        ("FILE:///var/checkpoints", LocalStorage),
        ("s3://bucket/prefix", S3Storage),
        ("s3a://bucket/prefix", S3Storage),
        ("s3n://bucket/prefix", S3Storage),
        ("hdfs://namenode:8020/flink/checkpoints", HdfsStorage),
        ("hdfs:///flink/checkpoints", HdfsStorage),
        ("webhdfs://namenode:9870/flink/checkpoints", HdfsStorage),
    ],
)
def test_scheme_picks_the_implementation_without_connecting(url: str, cls: type) -> None:
    assert type(open_storage(url)) is cls


def test_hdfs_urls_keep_scheme_and_namenode() -> None:
    storage = open_storage("webhdfs://nn.example:9870/ckpt")
    assert isinstance(storage, HdfsStorage)
    assert (storage.scheme, storage.netloc) == ("webhdfs", "nn.example:9870")
    assert storage.join("webhdfs://nn.example:9870/ckpt", "job", "chk-1") == "webhdfs://nn.example:9870/ckpt/job/chk-1"
    with pytest.raises(InvalidArgumentError, match="NameNode"):
        storage.read_bytes("webhdfs://other:9870/ckpt/x")
    with pytest.raises(InvalidArgumentError):
        storage.read_bytes("hdfs://nn.example:9870/ckpt/x")


def test_unknown_scheme_lists_the_supported_ones() -> None:
    with pytest.raises(ConfigError) as info:
        open_storage("gs://bucket/x")
    assert "gs://" in info.value.message
    for scheme in ("file://", "s3://", "hdfs://", "webhdfs://"):
        assert scheme in info.value.message
    assert set(supported_schemes()) >= {"file", "s3", "s3a", "hdfs", "webhdfs"}


def test_empty_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="state.checkpoints.dir"):
        open_storage("  ")


def test_scheme_of() -> None:
    assert scheme_of("S3://b/k") == "s3"
    assert scheme_of("/abs/path") == ""
    assert scheme_of("c:relative") == ""


def test_local_storage_does_not_import_s3fs() -> None:
    code = (
        "import sys; from keyedstate.common.storage import open_storage; "
        "open_storage('/tmp'); open_storage('file:///tmp'); print('s3fs' in sys.modules, 'pyarrow' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_missing_s3fs_names_the_package_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes "import s3fs" fail exactly as if it were not installed.
    monkeypatch.setitem(sys.modules, "s3fs", None)
    monkeypatch.delitem(sys.modules, "keyedstate.common.storage._s3", raising=False)
    with pytest.raises(StorageError) as info:
        open_storage("s3://bucket/x")
    assert "pip install s3fs" in info.value.message
    assert isinstance(info.value.__cause__, ImportError)


def test_registered_scheme_with_missing_module_gives_its_install_hint() -> None:
    register_storage("ksfake", "keyedstate_not_installed_module:FakeStorage", "pip install keyedstate-fake")
    try:
        with pytest.raises(StorageError) as info:
            open_storage("ksfake://x/y")
        assert "pip install keyedstate-fake" in info.value.message
    finally:
        _registry._REGISTRY.pop("ksfake", None)


@pytest.mark.parametrize(("scheme", "target"), [("", "m:C"), ("bad scheme", "m:C"), ("ok", "no-colon")])
def test_register_storage_validates(scheme: str, target: str) -> None:
    with pytest.raises(InvalidArgumentError):
        register_storage(scheme, target, "hint")


def test_join_url() -> None:
    assert join_url("s3://b/x", "a", "b/c") == "s3://b/x/a/b/c"
    assert join_url("s3://b/x/", "/a/") == "s3://b/x/a"
    assert join_url("file:///", "a") == "file:///a"
    assert join_url("/", "a") == "/a"
    assert join_url("s3://b/x") == "s3://b/x"
    for bad in ("..", "a/..", ".", "", "//"):
        with pytest.raises(InvalidArgumentError):
            join_url("s3://b/x", bad)
    with pytest.raises(InvalidArgumentError):
        join_url("", "a")


@pytest.mark.skipif(
    any(os.environ.get(v) for v in ("HADOOP_HOME", "ARROW_LIBHDFS_DIR", "HADOOP_CONF_DIR")),
    reason="a Hadoop client is configured here; this checks the message shown without one",
)
def test_hdfs_without_a_hadoop_client_says_what_to_install() -> None:
    storage = open_storage("hdfs://127.0.0.1:1/ckpt")
    with pytest.raises(StorageError) as info:
        storage.exists("hdfs://127.0.0.1:1/ckpt/x")
    message = info.value.message
    assert "pip install pyarrow" in message and "HADOOP_HOME" in message and "webhdfs://" in message
    assert len(message.splitlines()) == 1  # not pyarrow's list of every JVM path it tried


def test_webhdfs_unreachable_namenode_is_retried_then_reported(tmp_path: Path) -> None:
    pytest.importorskip("requests")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    waiter = RecordingWaiter()
    storage = open_storage(
        f"webhdfs://127.0.0.1:{port}/ckpt",
        retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.1, jitter=0),
        waiter=waiter,
    )
    url = f"webhdfs://127.0.0.1:{port}/ckpt/chk-1/_metadata"
    with pytest.raises(StorageError) as info:
        storage.read_bytes(url)
    assert url in info.value.message and "after 3 attempts" in info.value.message
    assert "NameNode" in info.value.message
    assert waiter.waits == [0.1, 0.2]
