"""A small pool of frame threads, shared by every rank a writer serves (and by a load).

Hashing, compressing and writing release the GIL (xxh3, zstd, numpy, os.write), so a
few Python threads turn spare cores into throughput (zstd's scaling: docs/design/codec.md).
One pool serves all rings rather than one thread per rank, so that a single busy rank
can use every core and many ranks do not oversubscribe them.

Memory stays bounded: `submit` takes one of `max_inflight` credits and blocks while
none is left; the caller returns the credit (`release`) only once the frame is written
(or dropped), so encoded frames that wait for an earlier one to be appended count
against the same bound. A blocked `submit` stops the session thread reading its
socket, the rank's ring fills, and the rank's stager waits: back-pressure from the disk
to the training process, with no queue in between that could grow.

Each thread has its own `context` dict (codec objects hold compressor state and are
not thread-safe); jobs receive it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("asyncckpt.pool")

Job = Callable[[dict], None]


class FramePool:
    """`threads` daemon threads running submitted jobs in FIFO order."""

    def __init__(self, threads: int, max_inflight: int, name: str = "asyncckpt-frame") -> None:
        if threads < 1 or max_inflight < threads:
            raise ValueError(f"pool of {threads} threads with {max_inflight} frames in flight: "
                             "need at least 1 thread and as many frames as threads")
        self.threads = threads
        self.max_inflight = max_inflight
        self._credits = threading.BoundedSemaphore(max_inflight)
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._workers = [threading.Thread(target=self._run, daemon=True, name=f"{name}-{i}")
                         for i in range(threads)]
        for w in self._workers:
            w.start()

    def submit(self, job: Job) -> None:
        """Queue `job`, first taking a credit (blocks while `max_inflight` are out). The
        job, or whoever it hands its result to, must call `release()` exactly once."""
        self._credits.acquire()
        self._jobs.put(job)

    def release(self) -> None:
        self._credits.release()

    def close(self) -> None:
        """Stop the threads once queued jobs have run (does not wait)."""
        for _ in self._workers:
            self._jobs.put(None)

    def _run(self) -> None:
        context: dict = {}
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job(context)
            except Exception:  # jobs handle their own errors; never lose a thread
                log.exception("frame job failed")
