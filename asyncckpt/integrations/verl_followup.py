"""What the verl drop-in does after a save is handed over: its follow-ups, in order.

A committed step still needs work the training loop must not wait for in async mode
(rank 0: the marker, the hf_model export, the tracker, the directories of deleted steps;
the other ranks: their share of the export). `FollowUps` runs them on one thread per
rank, in save order, and keeps each failure until the next save takes it, so that a
follow-up that fails after `save_checkpoint` returned is still raised (by the next
save, on every rank) rather than lost in a log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncckpt.rank.handle import SaveHandle
from asyncckpt.storage.location import Location, is_object, upload_tree

log = logging.getLogger("asyncckpt.verl")


@dataclasses.dataclass
class Job:
    """One save's follow-up."""

    step: int
    local_path: Location
    handle: SaveHandle
    hf_model: bool
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    failure: str | None = None  # a follow-up that failed after the commit


class FollowUps:
    """`run(job)` for each job added, in order, on a thread started with the first.

    Args:
        run: the follow-up; it sets `job.failure` for a failure that must be raised,
            and any exception it lets out counts as one.
    """

    def __init__(self, run: Callable[[Job], None]) -> None:
        self._run = run
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self.pending: list[Job] = []   # added, not yet done
        self._failures: list[str] = []  # failed since the last `take_failures`
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, job: Job) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="asyncckpt-verl",
                                            daemon=True)
            self._thread.start()
        self.pending.append(job)
        self._jobs.put(job)

    def running_steps(self) -> list[int]:
        """The steps whose follow-up is not done yet."""
        return [job.step for job in self.pending if not job.done.is_set()]

    def take_failures(self) -> list[str]:
        with self._lock:
            failures, self._failures = self._failures, []
        return failures

    def wait(self) -> None:
        """Until every job added so far is done."""
        for job in list(self.pending):
            job.done.wait()

    def close(self) -> None:
        """Stop the thread once the jobs added are done."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._run(job)
            except Exception as e:  # noqa: BLE001 - the thread must go on with the next job
                job.failure = job.failure or f"step {job.step}: {type(e).__name__}: {e}"
            finally:
                if job.failure:
                    log.error("asyncckpt: %s", job.failure)
                    with self._lock:
                        self._failures.append(job.failure)
                job.done.set()
                self.pending.remove(job)


@contextlib.contextmanager
def local_dir(directory: Location) -> Any:
    """A local directory to write `directory`'s files into: `directory` itself, or for
    an object-store prefix a temporary one, uploaded when the block ends without error."""
    if not is_object(directory):
        yield directory
        return
    with tempfile.TemporaryDirectory(prefix="asyncckpt-verl-") as scratch:
        yield Path(scratch)
        upload_tree(Path(scratch), directory)
