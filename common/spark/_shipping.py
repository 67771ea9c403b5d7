"""Ship the installed keyedstate packages to Spark executors as one zip on their ``sys.path``.

The zip holds ``keyedstate/common``, ``keyedstate/taskmanager`` and ``keyedstate/jobmanager`` as
they are imported on the driver (an editable install maps them from the repository's top-level
folders). ``keyedstate`` itself stays a namespace package (no ``__init__.py``), which zipimport
supports, so the zip merges with a keyedstate that an executor may have installed. Because
everything lives under ``keyedstate.``, a user package called ``common`` on the executor can
neither shadow nor be shadowed by it.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
import zipfile
from pathlib import Path
from typing import Any

from keyedstate.common.errors import ConfigError, InvalidArgumentError

logger = logging.getLogger(__name__)

PACKAGES = ("keyedstate.common", "keyedstate.taskmanager", "keyedstate.jobmanager")
# Fixed timestamps make the archive, and so its name, depend on the sources only.
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)
_SKIP_SUFFIXES = (".pyc", ".pyo")

_lock = threading.Lock()
_zip_path: str | None = None
_shipped: set[tuple[str, str]] = set()


def _package_files() -> list[tuple[str, Path]]:
    """(name in the archive, file on disk) of every file of the packages, sorted."""
    files: list[tuple[str, Path]] = []
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            if package == "keyedstate.common":
                raise ConfigError("keyedstate.common is not importable on the driver: install keyedstate first")
            logger.info("package %s is not installed on the driver; not shipping it", package)
            continue
        prefix = package.replace(".", "/")
        for location in spec.submodule_search_locations:
            root = Path(location)
            if not root.is_dir():
                raise ConfigError(
                    f"{package} is imported from {location}, which is not a directory (a zip or an egg?): "
                    "ship that archive itself with sc.addPyFile instead of ship_package()"
                )
            for dirpath, dirnames, filenames in os.walk(root):
                # Sorted in place so that os.walk's order, and so the archive, is reproducible.
                dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
                for filename in sorted(filenames):
                    if filename.startswith(".") or filename.endswith(_SKIP_SUFFIXES):
                        continue
                    path = Path(dirpath, filename)
                    files.append((f"{prefix}/{path.relative_to(root).as_posix()}", path))
    return sorted(files)


def _build_zip(out_dir: Path) -> Path:
    files = _package_files()
    digest = hashlib.sha256()
    contents = []
    for arcname, path in files:
        data = path.read_bytes()
        digest.update(arcname.encode() + b"\0" + len(data).to_bytes(8, "big") + data)
        contents.append((arcname, data))
    target = out_dir / f"keyedstate-{digest.hexdigest()[:16]}.zip"
    # zipimport (3.11) finds a namespace package only through an explicit directory entry, so
    # every directory, "keyedstate/" first, gets one.
    directories = sorted({arcname[: i + 1] for arcname, _ in contents for i, ch in enumerate(arcname) if ch == "/"})
    with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for directory_name in directories:
            info = zipfile.ZipInfo(directory_name, date_time=_ZIP_DATE)
            info.external_attr = (0o40755 << 16) | 0x10  # a directory, for zip tools as well
            archive.writestr(info, b"")
        for arcname, data in contents:
            info = zipfile.ZipInfo(arcname, date_time=_ZIP_DATE)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
    logger.info("built %s with %d files from the installed keyedstate packages", target, len(contents))
    return target


def package_zip() -> str:
    """Path of a zip of the installed keyedstate packages, built once per process.

    The zip is a snapshot: sources edited later in the same process are not picked up.
    """
    global _zip_path
    with _lock:
        if _zip_path is None or not os.path.exists(_zip_path):
            directory = Path(tempfile.mkdtemp(prefix="keyedstate-ship-"))
            atexit.register(shutil.rmtree, directory, True)
            _zip_path = str(_build_zip(directory))
        return _zip_path


def _spark_context(spark_or_sc: Any) -> Any:
    try:
        from pyspark import SparkContext
        from pyspark.sql import SparkSession
    except ImportError:
        raise ConfigError("ship_package needs pyspark: pip install 'keyedstate[spark]'") from None
    if isinstance(spark_or_sc, SparkContext):
        return spark_or_sc
    if isinstance(spark_or_sc, SparkSession):
        return spark_or_sc.sparkContext
    if hasattr(spark_or_sc, "addArtifacts"):
        raise InvalidArgumentError(
            "a Spark Connect session has no SparkContext: ship the package with "
            "spark.addArtifacts(keyedstate.common.spark.package_zip(), pyfile=True)"
        )
    raise InvalidArgumentError(f"ship_package needs a SparkSession or SparkContext, got {type(spark_or_sc).__name__}")


def ship_package(spark_or_sc: Any) -> str:
    """Make keyedstate importable on every executor of this Spark application; returns the zip's path.

    Idempotent per application. Executors put the zip ahead of site-packages, so they run the
    driver's version of keyedstate even where another one is installed.
    """
    sc = _spark_context(spark_or_sc)
    path = package_zip()
    key = (str(sc.applicationId), path)
    with _lock:
        if key in _shipped:
            return path
        before = set(sys.path)
        sc.addPyFile(path)
        # addPyFile also prepends the archive to the driver's own sys.path (meant for local-mode
        # tests); the driver already has keyedstate installed, and keeping the entry would make it
        # import modules not loaded yet from this snapshot instead of from the install.
        sys.path[:] = [entry for entry in sys.path if entry in before]
        _shipped.add(key)
    logger.info("shipped %s to the executors of Spark application %s", path, sc.applicationId)
    return path
