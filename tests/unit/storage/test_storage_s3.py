"""S3 specifics against a real moto server: configuration, retries, cache freshness, failures."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from keyedstate.common.config import Configuration
from keyedstate.common.errors import ConfigError, InvalidArgumentError, StorageError
from keyedstate.common.storage import RetryPolicy, S3Storage, open_storage, s3fs_options
from tests.fixtures.s3 import boto3_client, make_flaky_s3_filesystem, s3_configuration

pytestmark = pytest.mark.s3

EXACT = RetryPolicy(max_attempts=3, initial_backoff_s=0.1, multiplier=2.0, jitter=0)


class RecordingWaiter:
    def __init__(self) -> None:
        self.waits: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        return False


# -- configuration ------------------------------------------------------------------------------
def test_flink_keys_map_onto_s3fs_options() -> None:
    conf = Configuration(
        {
            "s3.endpoint": "http://minio:9000",
            "s3.access-key": "AK",
            "s3.secret-key": "SK",
            "s3.path.style.access": "true",
            "s3.region": "eu-west-1",
        }
    )
    opts = s3fs_options(conf, environ={"AWS_REGION": "ignored", "AWS_ENDPOINT_URL": "http://ignored"})
    assert opts["endpoint_url"] == "http://minio:9000"
    assert (opts["key"], opts["secret"]) == ("AK", "SK")
    assert opts["client_kwargs"] == {"region_name": "eu-west-1"}
    assert opts["config_kwargs"]["s3"] == {"addressing_style": "path"}
    assert opts["skip_instance_cache"] is True and opts["use_listings_cache"] is False


def test_aws_environment_fills_unset_keys() -> None:
    opts = s3fs_options(Configuration(), environ={"AWS_ENDPOINT_URL": "http://env:9000", "AWS_REGION": "ap-south-1"})
    assert opts["endpoint_url"] == "http://env:9000"
    assert opts["client_kwargs"] == {"region_name": "ap-south-1"}
    assert "key" not in opts and "secret" not in opts  # left to the AWS credential chain
    assert "s3" not in opts["config_kwargs"]
    s3_specific = s3fs_options(None, environ={"AWS_ENDPOINT_URL": "http://a", "AWS_ENDPOINT_URL_S3": "http://s3-only"})
    assert s3_specific["endpoint_url"] == "http://s3-only"


def test_an_endpoint_without_scheme_means_https() -> None:
    assert (
        s3fs_options(Configuration({"s3.endpoint": "minio.local:9000"}), environ={})["endpoint_url"]
        == "https://minio.local:9000"
    )


def test_access_key_without_secret_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="s3.secret-key"):
        s3fs_options(Configuration({"s3.access-key": "AK"}), environ={})


def test_credentials_and_endpoint_from_aws_env_vars_work(
    s3_bucket: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, bucket = s3_bucket
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    storage = open_storage(f"s3://{bucket}/ck")
    storage.write_bytes(f"s3://{bucket}/ck/x", b"via env")
    assert boto3_client(endpoint).get_object(Bucket=bucket, Key="ck/x")["Body"].read() == b"via env"


def test_missing_credentials_say_how_to_set_them(
    s3_bucket: tuple[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    endpoint, bucket = s3_bucket
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    storage = open_storage(f"s3://{bucket}", Configuration({"s3.endpoint": endpoint, "s3.region": "us-east-1"}))
    with pytest.raises(StorageError) as info:
        storage.write_bytes(f"s3://{bucket}/x", b"1")
    assert f"s3://{bucket}/x" in info.value.message
    assert "s3.access-key" in info.value.message


# -- URLs ---------------------------------------------------------------------------------------
def test_s3a_urls_work_and_list_as_s3a(s3_bucket: tuple[str, str], s3_config: Configuration) -> None:
    _, bucket = s3_bucket
    storage = open_storage(f"s3a://{bucket}", s3_config)
    storage.write_bytes(f"s3a://{bucket}/d/f", b"1")
    assert [i.path for i in storage.list(f"s3a://{bucket}/d")] == [f"s3a://{bucket}/d/f"]
    assert storage.read_bytes(f"s3://{bucket}/d/f") == b"1"


@pytest.mark.parametrize("url", ["s3://", "s3:///key", "file:///x", "/plain/path"])
def test_urls_s3_storage_does_not_serve_are_refused(url: str, s3_config: Configuration) -> None:
    with pytest.raises(InvalidArgumentError):
        open_storage("s3://b", s3_config).read_bytes(url)


def test_delete_dir_refuses_a_bucket_root_and_keeps_the_bucket(
    s3_bucket: tuple[str, str], s3_config: Configuration
) -> None:
    _endpoint, bucket = s3_bucket
    storage = open_storage(f"s3://{bucket}", s3_config)
    storage.write_bytes(f"s3://{bucket}/keep", b"1")
    with pytest.raises(InvalidArgumentError):
        storage.delete_dir(f"s3://{bucket}")
    with pytest.raises(InvalidArgumentError):
        storage.delete_dir(f"s3://{bucket}/")
    assert storage.read_bytes(f"s3://{bucket}/keep") == b"1"


def test_writing_to_a_missing_bucket_says_to_create_it(s3_bucket: tuple[str, str], s3_config: Configuration) -> None:
    storage = open_storage("s3://b", s3_config)
    with pytest.raises(StorageError) as info:
        storage.write_bytes("s3://no-such-bucket-here/x", b"1")
    assert "no-such-bucket-here" in info.value.message and "create the bucket" in info.value.message
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("s3://no-such-bucket-here/x")


# -- freshness across writers --------------------------------------------------------------------
def test_listings_and_exists_see_other_writers_at_once(s3_bucket: tuple[str, str], s3_config: Configuration) -> None:
    endpoint, bucket = s3_bucket
    storage = open_storage(f"s3://{bucket}", s3_config)
    other = boto3_client(endpoint)
    assert list(storage.list(f"s3://{bucket}/chk")) == []
    assert not storage.exists(f"s3://{bucket}/chk/a")
    other.put_object(Bucket=bucket, Key="chk/a", Body=b"1")
    assert [i.path for i in storage.list(f"s3://{bucket}/chk")] == [f"s3://{bucket}/chk/a"]
    assert storage.exists(f"s3://{bucket}/chk/a")
    other.delete_object(Bucket=bucket, Key="chk/a")
    assert list(storage.list(f"s3://{bucket}/chk", recursive=True)) == []
    assert not storage.exists(f"s3://{bucket}/chk/a")


# -- retries ------------------------------------------------------------------------------------
def _flaky_storage(
    config: Configuration, failures: dict[str, int], **kwargs: Any
) -> tuple[S3Storage, Any, RecordingWaiter]:
    fs = make_flaky_s3_filesystem(s3fs_options(config), failures, **kwargs)
    waiter = RecordingWaiter()
    return S3Storage(fs=fs, retry=EXACT, waiter=waiter), fs, waiter


def test_throttled_put_is_retried_with_backoff(s3_bucket: tuple[str, str], s3_config: Configuration) -> None:
    endpoint, bucket = s3_bucket
    storage, fs, waiter = _flaky_storage(s3_config, {"put_object": 2})
    storage.write_bytes(f"s3://{bucket}/m", b"payload")
    assert fs.injected == ["put_object", "put_object"]
    assert waiter.waits == [0.1, 0.2]
    assert boto3_client(endpoint).get_object(Bucket=bucket, Key="m")["Body"].read() == b"payload"


def test_server_errors_on_reads_are_retried(s3_bucket: tuple[str, str], s3_config: Configuration) -> None:
    _, bucket = s3_bucket
    open_storage("s3://b", s3_config).write_bytes(f"s3://{bucket}/r", b"abc")
    storage, fs, waiter = _flaky_storage(s3_config, {"get_object": 2}, code="InternalError", status=500)
    assert storage.read_bytes(f"s3://{bucket}/r") == b"abc"
    assert len(fs.injected) == 2 and len(waiter.waits) == 2


def test_persistent_throttling_becomes_a_storage_error_naming_path_and_fix(
    s3_bucket: tuple[str, str], s3_config: Configuration
) -> None:
    _, bucket = s3_bucket
    storage, fs, waiter = _flaky_storage(s3_config, {"put_object": 100})
    with pytest.raises(StorageError) as info:
        storage.write_bytes(f"s3://{bucket}/m", b"x")
    assert f"s3://{bucket}/m" in info.value.message
    assert "after 3 attempts" in info.value.message and "throttling" in info.value.message
    assert isinstance(info.value.__cause__, OSError)
    assert len(fs.injected) == 3 and waiter.waits == [0.1, 0.2]


def test_exclusive_create_whose_answer_was_lost_is_not_reported_as_a_conflict(
    s3_bucket: tuple[str, str], s3_config: Configuration
) -> None:
    _, bucket = s3_bucket
    # The first conditional PUT stores the object, then the answer is "lost" (503); the retry
    # meets our own object and must succeed rather than raise FileExistsError.
    storage, fs, _ = _flaky_storage(s3_config, {"put_object": 1}, after_success=True)
    storage.create_exclusive(f"s3://{bucket}/_metadata", b"mine")
    assert fs.injected == ["put_object"]
    assert storage.read_bytes(f"s3://{bucket}/_metadata") == b"mine"
    # ... while someone else's object still is a conflict.
    with pytest.raises(FileExistsError):
        storage.create_exclusive(f"s3://{bucket}/_metadata", b"other")


def test_unreachable_endpoint_is_retried_then_reported(s3_config: Configuration) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    opts = s3fs_options(s3_configuration(f"http://127.0.0.1:{port}"))
    opts["config_kwargs"]["retries"] = {"total_max_attempts": 1}  # keep botocore from sleeping
    waiter = RecordingWaiter()
    storage = S3Storage(opts, retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.1, jitter=0), waiter=waiter)
    with pytest.raises(StorageError) as info:
        storage.exists("s3://bucket/x")  # a network failure must not read as "missing"
    assert "s3://bucket/x" in info.value.message
    assert f"127.0.0.1:{port}" in info.value.message and "s3.endpoint" in info.value.message
    assert waiter.waits == [0.1]
