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
import json
import logging
import queue
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncckpt.errors import CheckpointError
from asyncckpt.integrations.verl_paths import (
    MARKER,
    TRACKER,
    holds,
    read_tracker,
    relative_root,
    trainer_dir,
)
from asyncckpt.rank.handle import SaveHandle
from asyncckpt.read.export import export_hf
from asyncckpt.storage.location import (
    Location,
    exists,
    is_object,
    remove_tree,
    root_path,
    upload_tree,
    write_bytes,
)

log = logging.getLogger("asyncckpt.verl")


@dataclasses.dataclass
class Job:
    """One save's follow-up."""

    step: int
    local_path: Location
    handle: SaveHandle
    hf_model: bool
    memory: bool = False  # saved to the node writers' memory tier, not the root
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


def shares_export(local_path: Location, world_size: int) -> bool:
    """Whether every rank writes a share of the hf_model export (a local or shared
    directory; into an object store rank 0 exports alone, then uploads)."""
    return world_size > 1 and not is_object(local_path)


def export_share(job: Job, root: Location, rank: int, world_size: int) -> None:
    """A rank other than 0, once `job`'s step is committed: its share of the shards
    (the rank that writes the last one writes the index); a failure set on `job`."""
    try:
        job.handle.wait()
    except CheckpointError:
        return  # not committed: nothing to export (rank 0 reports it)
    try:
        export_hf(root, Path(job.local_path) / "huggingface", step=job.step,
                  part=(rank, world_size))
    except Exception as e:  # noqa: BLE001 - raised on every rank by a save
        job.failure = (f"step {job.step} is committed but rank {rank}'s share of its "
                       f"hf_model export failed: {type(e).__name__}: {e}")


def committed(job: Job, root: Location, saved: dict[str, int], kept: Callable[[], list[int]],
              world_size: int, move_tracker: bool) -> None:
    """Rank 0, once `job`'s step is committed: marker, hf_model export, tracker (when
    `move_tracker`: async mode), then the `local_path`s of steps the writer's retention
    deleted (`kept`: the root's committed steps, judged from the disk). A memory-tier
    step (`job.memory`: held by the writers, "committed" once its node holds it) keeps
    its `local_path` (the trainer's data.pt) while it is the newest save; the step the
    tracker names keeps its own whatever its tier; an older memory step's goes.

    Args:
        saved: the `local_path`s of the steps saved and kept, with their steps, oldest
            first: updated in place (this step added, the deleted ones removed).
    """
    try:
        job.handle.wait()
    except CheckpointError as e:  # every rank's save_checkpoint (or the next) raises it
        log.error("asyncckpt: step %d was not committed (%s): the tracker keeps the "
                  "last committed step", job.step, e)
        _unmade(job.local_path)
        return
    if job.memory and job.handle.stats.tier == "skipped":  # held nowhere: not a step
        log.warning("asyncckpt: step %d was skipped by the memory tier (two generations "
                    "per node): the tracker keeps the last step saved", job.step)
        _unmade(job.local_path)
        return
    write_bytes(job.local_path / MARKER, (json.dumps(
        {"root": relative_root(root, job.local_path), "step": job.step}) + "\n").encode())
    saved.pop(str(job.local_path), None)  # saved again: now the newest
    saved[str(job.local_path)] = job.step
    try:
        if job.hf_model:
            share = (0, world_size) if shares_export(job.local_path, world_size) else (0, 1)
            with local_dir(job.local_path / "huggingface") as directory:
                export_hf(root, directory, step=job.step, part=share)
    except Exception as e:  # noqa: BLE001 - the step is committed: the tracker moves on
        job.failure = (f"step {job.step} is committed but its hf_model export to "
                       f"{job.local_path / 'huggingface'} failed: {type(e).__name__}: {e}")
    base = trainer_dir(job.local_path)
    if move_tracker and base is not None:
        write_bytes(base / TRACKER, str(job.step).encode())
    left = set(kept()) | ({job.step} if job.memory else set())
    tracked = read_tracker(job.local_path)  # where a restart resumes until the tracker
    if tracked is not None:                 # moves (a memory step's is in no root)
        left.add(tracked)
    for old, step in list(saved.items()):
        if step not in left and not holds(root_path(old), root):
            remove_tree(root_path(old))
            del saved[old]


def _unmade(local_path: Location) -> None:
    """A save that made no step: what it wrote at `local_path`, unless a marker says
    an earlier save of the step made one there."""
    if not exists(local_path / MARKER):
        remove_tree(local_path / "huggingface")
        if isinstance(local_path, Path):  # a local directory
            with contextlib.suppress(OSError):
                local_path.rmdir()  # only if nothing else is in it
