"""Ingestion on Ray: the byte ranges of `ingest.parallel` run as Ray tasks instead of local processes.

The engine hands its workers calls through `submit(fn, *args) -> concurrent.futures.Future`, the interface of
a `ProcessPoolExecutor`; `RayPool` is that interface over Ray tasks. Planning the ranges, taking results in
file order and the bookkeeping stay the local engine's own, so the dataset is the same. A task writes its
part files straight into the dataset's temporary folder and sends back only a small `ChunkResult`, as a local
worker does: on a cluster, the logs and the output folder must be on a file system every node sees.

A task whose worker process dies (killed, out of memory, its node lost) runs again, up to `MAX_RETRIES`
times; its part files are written whole by the attempt that finishes. An exception raised by the task itself
(bad input) is not retried: it surfaces unwrapped, as from the local pool. Ray is imported only here, and
only through `ray_session`, so a missing Ray is a one-line error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import ExitStack
from typing import Any, TypeVar

from offline_agent.ingest.parallel import keep_freed_memory
from offline_agent.ray_backend import ray_session

MAX_RETRIES = 3

R = TypeVar("R")


class RayPool:
    """`submit(fn, *args)` runs `fn(*args)` as a Ray task named after `fn` (its worker's title is
    `ray::{fn.__name__}`). Joins or starts Ray as `ray_session(address)` does; `shutdown` lets it go."""

    def __init__(self, address: str | None = None) -> None:
        self._session = ExitStack()
        self._ray = self._session.enter_context(ray_session(address))
        self._task = self._ray.remote(max_retries=MAX_RETRIES, retry_exceptions=False)(_run)
        self._unfinished: set[Any] = set()  # ObjectRefs, for `shutdown` to cancel and wait for
        self._lock = threading.Lock()  # done-callbacks run on Ray's threads
        try:
            #: one task per CPU of the cluster runs at a time; the engine keeps two per CPU in flight
            self.workers = max(1, int(self._ray.cluster_resources().get("CPU", 1)))
            for _ in range(self.workers):  # workers import the adapters while the driver hashes the first file
                self.submit(_import_adapters)
        except BaseException:
            self._session.close()
            raise

    def submit(self, fn: Callable[..., R], *args: Any) -> Future[R]:
        ref = self._task.options(name=fn.__name__).remote(fn, *args)
        future: Future[R] = Future()
        with self._lock:
            self._unfinished.add(ref)
        ref.future().add_done_callback(lambda done: self._settle(ref, done, future))
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """Cancel tasks not finished (`cancel_futures`) and wait for every task to end (`wait`): then no task
        is still writing into the folder that is about to be removed. Leaves a Ray it started."""
        with self._lock:
            unfinished = list(self._unfinished)
        try:
            if cancel_futures:
                for ref in unfinished:
                    self._ray.cancel(ref)
            if wait and unfinished:
                self._ray.wait(unfinished, num_returns=len(unfinished))
        finally:
            self._session.close()

    def _settle(self, ref: Any, done: Future, future: Future) -> None:
        with self._lock:
            self._unfinished.discard(ref)
        try:
            future.set_result(done.result())
        except self._ray.exceptions.RayTaskError as exc:
            # The task's own exception, so that a UserError reads as one line, as from the local pool.
            future.set_exception(exc.cause if isinstance(exc.cause, BaseException) else exc)
        except BaseException as exc:  # noqa: BLE001 (a worker lost after its retries, a cancelled task)
            future.set_exception(exc)


_worker_ready = False


def _run(fn: Callable[..., R], *args: Any) -> R:
    """Task side: sets up the worker process once, then runs the call."""
    global _worker_ready
    if not _worker_ready:
        # A worker turns ranges into parts one after another, as a local ingest worker does (see there). Its
        # process may be shared with other Ray work, so unlike a local worker it keeps pandas importable.
        keep_freed_memory()
        _worker_ready = True
    return fn(*args)


def _import_adapters() -> None:
    import offline_agent.ingest.registry  # noqa: F401  (the adapters and pyarrow, once per worker)
