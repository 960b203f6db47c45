"""Assembling a step from its ranks, and committing it once all have ended.

A step is committed only when every rank of its world has sent `end` for it; until
then its files sit in one `step-N.tmp-<id>/` that nothing reads. The first failure of
any rank (an I/O error, an abort, a disconnect before its `end`) fails the whole step
for every rank, and the tmp directory is discarded. Ranks that had not yet begun the
failed step learn of the failure when they do, instead of waiting for peers that will
never come. "Every rank of the step" is the only place the commit depends on the world;
across nodes it would become "every node's part" with the same shape.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import commit
from .errors import CheckpointError, SaveFailedError
from .format import MAX_STEP
from .manifest import Manifest, RankPart

log = logging.getLogger("asyncckpt.writer")

# notify(rank, error or None, path or None, stats) reaches the rank's client
Notify = Callable[[CheckpointError | None, Path | None, dict], None]
_MAX_FAILED_RECORDS = 4096


@dataclass
class Step:
    step: int
    world_size: int
    codec: str
    tmp_dir: Path
    started: float = field(default_factory=time.monotonic)
    waiting: dict[int, Notify] = field(default_factory=dict)   # rank -> how to tell it
    parts: dict[int, RankPart] = field(default_factory=dict)
    stats: dict[int, dict] = field(default_factory=dict)
    retention: tuple[int, int] | None = None


class Steps:
    """The open steps of one writer. Thread-safe; every method may be called from any
    session thread."""

    def __init__(self, root: Path, retention: tuple[int, int] = (0, 0),
                 on_commit: Callable[[Manifest, float], None] | None = None) -> None:
        self.root = root
        self.retention = retention  # (keep_last, keep_every) unless a save names its own
        self._lock = threading.Lock()
        self._commit_lock = threading.Lock()
        self._open: dict[int, Step] = {}
        self._failed: dict[int, tuple[CheckpointError, set[int]]] = {}
        self._live: collections.Counter[int] = collections.Counter()
        self._closing = False
        self._idle = threading.Condition(self._lock)
        self._on_commit = on_commit

    def begin(self, step: int, rank: int, world_size: int, codec: str, notify: Notify,
              retention: tuple[int, int] | None = None) -> Step:
        """Register `rank`'s part of `step`, opening the step on its first rank.

        `retention` (keep_last, keep_every), if given, replaces the writer's own policy
        for the deletions that follow this step's commit.

        Raises:
            SaveFailedError: the writer is closing, the step failed earlier or is already
                committed, or the rank/world/codec disagree with the step's other ranks.
        """
        with self._lock:
            if self._closing:
                raise SaveFailedError("the writer is shutting down", step=step, rank=rank)
            if step in self._failed:
                error, pending = self._failed[step]
                if rank in pending:
                    pending.discard(rank)
                    if not pending:
                        del self._failed[step]
                    raise error
            if not 0 <= step <= MAX_STEP:
                raise SaveFailedError(f"step {step} is outside 0..{MAX_STEP}", rank=rank)
            if not 0 <= rank < world_size:
                raise SaveFailedError(f"rank {rank} is outside world size {world_size}",
                                      step=step, rank=rank)
            current = self._open.get(step)
            if current is None:
                if step in commit.committed_steps(self.root):
                    raise SaveFailedError("this step is already committed; saves never "
                                          "overwrite a checkpoint", step=step, rank=rank)
                current = Step(step, world_size, codec, commit.make_tmp_dir(self.root, step))
                self._open[step] = current
            elif current.world_size != world_size or current.codec != codec:
                raise SaveFailedError(
                    f"world size {world_size} / codec {codec} disagree with the step's other "
                    f"ranks ({current.world_size} / {current.codec})", step=step, rank=rank)
            elif rank in current.waiting:
                raise SaveFailedError("this rank is already saving this step", step=step, rank=rank)
            current.waiting[rank] = notify
            if retention is not None:
                current.retention = retention
            return current

    def end(self, step: int, part: RankPart, stats: dict) -> None:
        """Record a rank's finished, fsynced part; commit the step if it was the last."""
        with self._lock:
            current = self._open.get(step)
            if current is None:
                return  # already failed
            current.parts[part.rank] = part
            current.stats[part.rank] = stats
            if len(current.parts) < current.world_size:
                return
            del self._open[step]
        self._commit(current)

    def fail(self, step: int, error: CheckpointError) -> None:
        """Fail `step` for every rank: notify them, forget the step, discard its files."""
        with self._lock:
            current = self._open.pop(step, None)
            if current is None:
                return
            # connected ranks that have not begun it yet will be told when they do; a
            # rank not connected now is a new process when it comes, free to retry
            pending = {r for r in range(current.world_size)
                       if r not in current.waiting and self._live[r] > 0}
            if pending:
                if len(self._failed) >= _MAX_FAILED_RECORDS:
                    self._failed.pop(next(iter(self._failed)))
                self._failed[step] = (error, pending)
            self._idle.notify_all()
        log.warning("step %d failed: %s", step, error)
        commit.discard(current.tmp_dir)
        for notify in current.waiting.values():
            notify(error, None, {})

    def rank_joined(self, rank: int) -> None:
        with self._lock:
            self._live[rank] += 1

    def rank_gone(self, rank: int) -> None:
        """A rank's connection closed: fail the open steps it had not ended."""
        with self._lock:
            self._live[rank] -= 1
            doomed = [s for s in self._open.values() if rank < s.world_size and rank not in s.parts]
            for record in self._failed.values():
                record[1].discard(rank)
        for s in doomed:
            self.fail(s.step, SaveFailedError("rank disconnected before ending its save",
                                              step=s.step, rank=rank))

    def fail_absent(self, timeout: float) -> None:
        """Fail steps open for over `timeout` s that wait on a rank with no connection
        (one that died before it began the step, or never started)."""
        now = time.monotonic()
        with self._lock:
            doomed = []
            for s in self._open.values():
                absent = [r for r in range(s.world_size)
                          if r not in s.waiting and self._live[r] <= 0]
                if absent and now - s.started >= timeout:
                    doomed.append((s.step, absent))
        for step, absent in doomed:
            names = ", ".join(map(str, absent[:8])) + (", ..." if len(absent) > 8 else "")
            self.fail(step, SaveFailedError(
                f"rank{'s' if len(absent) > 1 else ''} {names} not connected {timeout:g} s after "
                "the step began (dead or never started)", step=step))

    def close(self, timeout: float) -> None:
        """Refuse new steps; wait up to `timeout` s for open ones, then fail the rest.

        Call after the listener is closed: a step waiting on a rank that is not
        connected can then never complete, so it fails at once.
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closing = True
        self.fail_absent(0)
        with self._lock:
            self._closing = True
            while self._open and time.monotonic() < deadline:
                self._idle.wait(deadline - time.monotonic())
            left = list(self._open)
        for step in left:
            self.fail(step, SaveFailedError("the writer shut down before all ranks ended",
                                            step=step))

    def _prune(self, current: Step) -> None:
        keep_last, keep_every = current.retention or self.retention
        try:
            deleted = commit.prune(self.root, keep_last, keep_every)
        except OSError as e:  # retention is best effort; the new step is already durable
            log.warning("retention failed: %s", e)
            return
        if deleted:
            log.info("retention (keep_last=%d, keep_every=%d) deleted steps %s",
                     keep_last, keep_every, deleted)

    def _commit(self, current: Step) -> None:
        manifest = Manifest(step=current.step, world_size=current.world_size,
                            ranks=[current.parts[r] for r in range(current.world_size)])
        try:
            with self._commit_lock:
                path = commit.publish(self.root, current.tmp_dir, manifest)
                self._prune(current)
        except CheckpointError as error:
            commit.discard(current.tmp_dir)
            log.warning("step %d failed at commit: %s", current.step, error)
            for notify in current.waiting.values():
                notify(error, None, {})
        else:
            seconds = time.monotonic() - current.started
            if self._on_commit:
                self._on_commit(manifest, seconds)
            stats = {"raw_bytes": manifest.raw_size, "stored_bytes": manifest.stored_size,
                     "seconds": seconds}
            for rank, notify in current.waiting.items():
                notify(None, path, {**stats, **current.stats.get(rank, {})})
        finally:
            with self._lock:
                self._idle.notify_all()
