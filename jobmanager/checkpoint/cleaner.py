"""Deletes discarded checkpoints: their exclusive directory and the shared files only they used."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from typing import Any

from keyedstate.common.storage import CheckpointStorage
from keyedstate.jobmanager.checkpoint import _paths

logger = logging.getLogger(__name__)

REVISITS = 2
"""How many later :meth:`CheckpointsCleaner.revisit` calls delete a ``revisit`` directory again."""


class InlineExecutor(Executor):
    """Runs each task in the submitting thread (tests, and the synchronous ``statectl`` paths)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # the future carries it, as a pool would
            future.set_exception(exc)
        return future


class CheckpointsCleaner:
    """Deletes checkpoint files through the storage on an executor, off the caller's thread.

    Every deletion re-checks ``keep`` just before it happens, so a file that became referenced
    again after the decision (a newer checkpoint registered it) survives. Failures are logged and
    counted, never raised: a file left behind is garbage that ``statectl checkpoint gc`` finds.
    """

    def __init__(self, storage: CheckpointStorage, executor: Executor | None = None) -> None:
        self._storage = storage
        self._owns_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(max_workers=2, thread_name_prefix="checkpoint-cleaner")
        self._futures: set[Future[list[str]]] = set()
        self._lock = threading.Lock()
        # directory -> visits still due; see discard(revisit=...)
        self._revisits: dict[str, int] = {}
        self.failures = 0

    def discard(
        self,
        *,
        directories: Iterable[str] = (),
        files: Iterable[str] = (),
        keep: Callable[[str], bool] | None = None,
        what: str = "checkpoint files",
        revisit: Iterable[str] = (),
    ) -> Future[list[str]]:
        """Delete ``directories`` (whole trees) first, then ``files``; the future holds what was deleted.

        Directories go first so that a discarded checkpoint loses its ``_metadata`` before any
        file it references: a crash in between leaves orphans, never a broken checkpoint.

        ``revisit`` directories are deleted now and again by the next :data:`REVISITS` calls of
        :meth:`revisit`: what a dead TaskManager was uploading can still land after the first
        deletion (its last request bodies were already on the way), so an aborted checkpoint's
        directories are swept again once later checkpoints complete.
        """
        revisit = [_paths.normalize(d) for d in revisit]
        if revisit:
            with self._lock:
                self._revisits.update((d, REVISITS) for d in revisit)
            directories = [*directories, *revisit]
        dirs, paths = [_paths.normalize(d) for d in directories], [_paths.normalize(f) for f in files]
        if not dirs and not paths:
            done: Future[list[str]] = Future()
            done.set_result([])
            return done
        future = self._executor.submit(self._run, dirs, paths, keep or (lambda _p: False), what)
        with self._lock:
            self._futures.add(future)
        future.add_done_callback(self._forget)
        return future

    def revisit(
        self, keep: Callable[[str], bool] | None = None, what: str = "late uploads of aborted checkpoints"
    ) -> Future[list[str]]:
        """Delete the directories passed as ``revisit`` to :meth:`discard` again (call when a checkpoint completes)."""
        with self._lock:
            due = sorted(self._revisits)
            for d in due:
                self._revisits[d] -= 1
                if self._revisits[d] <= 0:
                    del self._revisits[d]
        return self.discard(directories=due, keep=keep, what=what)

    def _forget(self, future: Future[list[str]]) -> None:
        with self._lock:
            self._futures.discard(future)

    def _run(self, dirs: list[str], files: list[str], keep: Callable[[str], bool], what: str) -> list[str]:
        deleted: list[str] = []
        for path, is_dir in [(d, True) for d in dirs] + [(f, False) for f in files]:
            if keep(path):
                logger.info("not deleting %s (%s): it is still referenced by a retained checkpoint", path, what)
                continue
            try:
                if is_dir:
                    self._storage.delete_dir(path)
                else:
                    self._storage.delete(path)
                deleted.append(path)
            except Exception:
                with self._lock:
                    self.failures += 1
                logger.warning(
                    "could not delete %s (%s); statectl checkpoint gc can remove it later", path, what, exc_info=True
                )
        if deleted:
            logger.debug("deleted %d path(s) of %s", len(deleted), what)
        return deleted

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted deletion finished; False if ``timeout`` ran out first."""
        with self._lock:
            futures = list(self._futures)
        _, not_done = wait(futures, timeout=timeout)
        return not not_done

    def close(self) -> None:
        """Finish queued deletions and release the executor (if this cleaner created it)."""
        if self._owns_executor:
            self._executor.shutdown(wait=True)
        else:
            self.flush()
