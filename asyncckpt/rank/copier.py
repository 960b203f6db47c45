"""Host-memory copy jobs, run by the calling thread and a few helper threads together.

`stage()` (stager.py) queues the copies into a few ring slots as jobs of at most 1 MiB,
whatever tensors they come from, and hands them to `HostCopier.run` as one batch: the
caller copies too, taking jobs as the helpers do, so a helper that is not scheduled
takes nothing and the caller copies alone, waiting at most for the one job a helper
has begun. One copier per process (`host_copier()`), its helpers started on first use;
a forked child starts its own.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import queue
import threading


class HostCopier:
    """Host-memory copies shared by the stager thread and `helpers` daemon threads.

    `run(jobs)` returns once every (dest address, source address, bytes) job is copied,
    or raises the first job's error once every job has been tried; the caller copies
    too, taking jobs as the helpers do, so `run` never waits for a helper that has not
    started. Several callers may run batches at once.
    """

    def __init__(self, helpers: int) -> None:
        self.helpers = helpers
        self._batches: queue.SimpleQueue[_Batch] = queue.SimpleQueue()
        for i in range(helpers):
            threading.Thread(target=self._serve, daemon=True, name=f"asyncckpt-copy-{i}").start()

    def run(self, jobs: list[tuple[int, int, int]]) -> None:
        if not self.helpers or len(jobs) < 2:
            for dest, source, n in jobs:
                ctypes.memmove(dest, source, n)
            return
        batch = _Batch(jobs)
        for _ in range(min(self.helpers, len(jobs) - 1)):
            self._batches.put(batch)
        batch.work()
        batch.done.wait()
        if batch.error is not None:
            raise batch.error

    def _serve(self) -> None:
        while True:
            self._batches.get().work()  # never raises: a job's error goes to its caller


class _Batch:
    def __init__(self, jobs: list[tuple[int, int, int]]) -> None:
        self.jobs = jobs
        self._next = itertools.count()  # next() of a count is atomic under the GIL
        self._left = len(jobs)
        self._lock = threading.Lock()
        self.done = threading.Event()
        self.error: BaseException | None = None  # the first job's that failed
        if not jobs:
            self.done.set()

    def work(self) -> None:
        mine = 0
        while (i := next(self._next)) < len(self.jobs):
            dest, source, n = self.jobs[i]
            try:
                ctypes.memmove(dest, source, n)  # releases the GIL
            except BaseException as e:  # noqa: BLE001 - counted, and raised in `run`
                self.error = self.error or e
            mine += 1
        if mine:  # every job taken is done once each taker has counted its own
            with self._lock:
                self._left -= mine
                if not self._left:
                    self.done.set()


def _helper_count() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(0, min(3, cores - 1))


_copier: HostCopier | None = None
_copier_lock = threading.Lock()


def _forget_copier() -> None:  # a forked child has none of the parent's helper threads
    global _copier, _copier_lock
    _copier, _copier_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_copier)


def host_copier() -> HostCopier:
    """The process's HostCopier (its helper threads start on first use)."""
    global _copier
    with _copier_lock:
        if _copier is None:
            _copier = HostCopier(_helper_count())
        return _copier
