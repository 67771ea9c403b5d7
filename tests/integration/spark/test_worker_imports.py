"""Executors import keyedstate from the shipped zip, next to a user package that is also called ``common``.

The worker functions are defined inside the tests so that cloudpickle ships them by value: the
executors cannot import this test module.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

import keyedstate.common
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.keygroups import key_group
from keyedstate.common.serializers import get_serializer
from keyedstate.common.spark import package_zip, ship_package

pytestmark = pytest.mark.spark

KEYS = [f"user-{i}" for i in range(40)]


def _expected_groups() -> list[tuple[str, int]]:
    ser = get_serializer("str")
    return sorted((k, key_group(ser.dumps(k), 128)) for k in KEYS)


@pytest.fixture(scope="module")
def user_common_zip(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's own top-level package ``common``, shipped the way users ship theirs."""
    path = tmp_path_factory.mktemp("user") / "user_common.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("common/__init__.py", 'WHO = "user"\n')
        archive.writestr("common/client.py", 'def hello():\n    return "user client"\n')
    before = list(sys.path)
    spark.sparkContext.addPyFile(str(path))
    sys.path[:] = before  # addPyFile also puts it on the driver's path; only the workers need it
    return path


@pytest.fixture(scope="module")
def shipped(spark: SparkSession) -> str:
    return ship_package(spark)


@pytest.fixture(scope="module")
def python_without_keyedstate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This interpreter with all its dependencies but without the keyedstate install.

    ``-S`` skips site processing, so the ``.pth`` file of the editable install never runs, while
    site-packages (pyspark, xxhash, grpc, ...) stays importable through PYTHONPATH.
    """
    site_packages = sysconfig.get_paths()["purelib"]
    wrapper = tmp_path_factory.mktemp("python") / "python-without-keyedstate"
    wrapper.write_text(
        f'#!/bin/sh\nPYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{site_packages}" exec "{sys.executable}" -S "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    # The test below means something only if this interpreter really cannot import keyedstate.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = subprocess.run(
        [str(wrapper), "-c", "import xxhash, pyspark\nimport keyedstate.common"],
        capture_output=True,
        text=True,
        cwd=wrapper.parent,
        env=env,
        timeout=60,
    )
    assert "No module named 'keyedstate'" in probe.stderr, probe.stderr
    return wrapper


def test_user_common_package_and_keyedstate_coexist_on_workers(
    spark: SparkSession, user_common_zip: Path, shipped: str
) -> None:
    def probe(keys: Iterable[str]) -> Iterator[dict[str, Any]]:
        import common  # type: ignore[import-not-found]  # the user's package, shipped to the workers only
        import common.client  # type: ignore[import-not-found]  # idem
        import keyedstate.common
        from keyedstate.common.keygroups import key_group
        from keyedstate.common.serializers import get_serializer

        ser = get_serializer("str")
        yield {
            "who": common.WHO,
            "client": common.client.hello(),
            "common_file": common.__file__,
            "keyedstate_file": keyedstate.common.__file__,
            "groups": [(k, key_group(ser.dumps(k), 128)) for k in keys],
        }

    results = spark.sparkContext.parallelize(KEYS, 2).mapPartitions(probe).collect()

    # Workers this Spark session started before ship_package may keep the installed copy.
    ours = (keyedstate.common.__file__, f"{os.path.basename(shipped)}/keyedstate/common/__init__.py")
    assert len(results) == 2
    for r in results:
        assert (r["who"], r["client"]) == ("user", "user client")
        assert f"{user_common_zip.name}/common/__init__.py" in r["common_file"]
        assert r["keyedstate_file"] == ours[0] or r["keyedstate_file"].endswith(ours[1]), r["keyedstate_file"]
    assert sorted(g for r in results for g in r["groups"]) == _expected_groups()


def test_worker_without_keyedstate_installed_imports_the_shipped_zip(
    spark: SparkSession, user_common_zip: Path, shipped: str, python_without_keyedstate: Path
) -> None:
    def probe(keys: Iterable[str]) -> Iterator[dict[str, Any]]:
        import sys

        import common  # the user's package (mypy reported it missing once, above)
        import keyedstate.common
        import keyedstate.common.keygroups as keygroups
        from keyedstate.common.serializers import get_serializer

        ser = get_serializer("str")
        yield {
            "no_site": sys.flags.no_site,
            "who": common.WHO,
            "files": [keyedstate.common.__file__, keygroups.__file__],
            "groups": [(k, keygroups.key_group(ser.dumps(k), 128)) for k in keys],
        }

    sc = spark.sparkContext
    # Jobs carry the interpreter to run in their Python function, and Spark keeps one worker
    # pool per interpreter, so this job gets fresh workers that never saw the keyedstate install.
    saved = sc.pythonExec
    sc.pythonExec = str(python_without_keyedstate)
    try:
        results = sc.parallelize(KEYS, 2).mapPartitions(probe).collect()
    finally:
        sc.pythonExec = saved

    zip_name = os.path.basename(shipped)
    assert len(results) == 2
    for r in results:
        assert r["no_site"] == 1, "the job did not run in the interpreter without keyedstate"
        assert r["who"] == "user"
        assert all(f"{zip_name}/keyedstate/common/" in f for f in r["files"]), r["files"]
    assert sorted(g for r in results for g in r["groups"]) == _expected_groups()


def test_ship_package_is_idempotent_and_leaves_the_driver_path_alone(spark: SparkSession, shipped: str) -> None:
    before = list(sys.path)
    assert ship_package(spark) == shipped
    assert ship_package(spark.sparkContext) == shipped
    assert sys.path == before
    assert shipped not in sys.path and not any(os.path.basename(shipped) in p for p in sys.path)


def test_shipped_zip_holds_every_package_as_namespace_keyedstate(shipped: str) -> None:
    names = set(zipfile.ZipFile(shipped).namelist())
    assert "keyedstate/__init__.py" not in names
    assert {"keyedstate/", "keyedstate/common/", "keyedstate/common/__init__.py"} <= names
    assert "keyedstate/common/spark/_shipping.py" in names
    for package in ("taskmanager", "jobmanager"):
        assert any(n.startswith(f"keyedstate/{package}/") and n.endswith(".py") for n in names), package
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    assert package_zip() == shipped


def test_ship_package_rejects_what_is_not_spark(spark: SparkSession) -> None:
    with pytest.raises(InvalidArgumentError, match="SparkSession or SparkContext"):
        ship_package("local[2]")
