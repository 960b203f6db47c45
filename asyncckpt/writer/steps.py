"""Assembling a step from its ranks, and committing it once all have ended.

A step is committed only when every rank of its world has sent `end` for it; until
then its files sit in one `step-N.tmp-<id>/` that nothing reads. The first failure of
any rank (an I/O error, an abort, a disconnect before its `end`) fails the whole step
for every rank, and the tmp directory is discarded. Ranks that had not yet begun the
failed step learn of the failure when they do, instead of waiting for peers that will
never come.

The commit itself (manifest, rename, `latest`, retention) runs on one committer thread,
not on the session thread of whichever rank ended last: that rank's connection keeps
serving (its next save's chunks, its slot credits) while the step is made visible and
old steps are deleted, and commits happen one at a time in the order steps completed.
Before anything is published the manifest is parsed back with the reader's own rules,
so the writer never commits a checkpoint that `load` or `verify` would reject, and
retention never deletes a good step on the strength of a bad one. Any exception in
that sequence fails the step for all its ranks and discards its files.

Across several nodes (a *coordinated* step: the ranks say so in their begin), a writer
sees only its own node's ranks. It makes each rank's part durable (data file fsynced,
then a part file beside it) and tells that rank, which announces it to the others
through the job's store (coordination.py); when every rank of the world has announced,
the ranks' leader asks its writer to commit, and that writer gathers every node's parts
into its tmp directory and runs the same committer. A node learns the outcome from its
ranks (`outcome`), and then forgets the step or discards its files. Only the writer that
commits prunes and sweeps: housekeeping happens once, on the leader.

With incremental saves the steps keep the writer's dedup index in step: a step opens
there (its lookups pin the steps they reference), is checked before publishing for
references to steps that are gone, is added once committed, and is released once it
ends either way; retention asks the index which steps kept ones reference.

Nothing here iterates over a world size: a rank may claim any world up to
`MAX_WORLD`, and the work per event stays proportional to the connected ranks.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from asyncckpt.errors import CheckpointError, SaveFailedError, StepAlreadyCommittedError
from asyncckpt.format.layout import MAX_STEP, retired_dir_name
from asyncckpt.format.manifest import Manifest, RankPart
from asyncckpt.runtime import faults
from asyncckpt.storage.base import Storage
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.writer import commit, owners
from asyncckpt.writer import retention as lifetimes
from asyncckpt.writer.dedup import DedupIndex
from asyncckpt.writer.owners import OwnerMark

log = logging.getLogger("asyncckpt.writer")

# notify(error or None, path or None, stats) reaches one rank's client
Notify = Callable[[CheckpointError | None, Path | None, dict], None]
# check(manifest bytes, manifest): raises CheckpointError if a reader would refuse it
Check = Callable[[bytes, Manifest], None]
MAX_WORLD = 1 << 20  # the manifest's bound
_MAX_FAILED_RECORDS = 4096


@dataclass
class Step:
    step: int
    world_size: int
    codec: str
    tmp_dir: Path
    choice: dict[str, Any] | None = None  # codec "auto": what the chooser saw
    started: float = field(default_factory=time.monotonic)
    waiting: dict[int, Notify] = field(default_factory=dict)   # rank -> how to tell it
    parts: dict[int, RankPart] = field(default_factory=dict)
    stats: dict[int, dict] = field(default_factory=dict)
    retention: tuple[int, int] | None = None
    keep_from: int | None = None              # retention deletes no step from this one on
    replace: bool = False                     # a committed step of this number is replaced
    coordinated: bool = False
    durable: dict[int, Callable[[str], None]] = field(default_factory=dict)  # coordinated
    announced: dict[int, str] | None = None   # leader: rank -> tmp dir name of its part
    requester: Notify | None = None           # leader: the save that asked for the commit


class Steps:
    """The open steps of one writer. Thread-safe; every method may be called from any
    session thread. Commits run on the committer thread started here."""

    def __init__(self, root: Path, retention: tuple[int, int] = (0, 0), *,
                 choose_codec: Callable[[], tuple[str, dict[str, Any] | None]] = lambda: ("raw", None),
                 check: Check | None = None,
                 on_commit: Callable[[Manifest, Step], None] | None = None,
                 max_frame_bytes: int = 256 << 20, index: DedupIndex | None = None,
                 owner: OwnerMark | None = None, storage: Storage | None = None) -> None:
        self.root = root
        self.storage = storage or PosixStorage(root)
        self._owner = owner
        self._index = index
        self._max_frame_bytes = max_frame_bytes
        self.retention = retention  # (keep_last, keep_every) unless a save names its own
        self._choose_codec = choose_codec
        self._check = check
        self._on_commit = on_commit
        self._lock = threading.Lock()
        self._open: dict[int, Step] = {}
        self._committing: dict[int, Step] = {}
        self._failed: dict[int, tuple[CheckpointError, set[int]]] = {}
        self._live: collections.Counter[int] = collections.Counter()
        self._closing = False
        self._idle = threading.Condition(self._lock)
        self._ready: queue.SimpleQueue[Step | None] = queue.SimpleQueue()
        self._committer = threading.Thread(target=self._commit_loop, daemon=True,
                                           name="asyncckpt-commit")
        self._committer.start()

    def begin(self, step: int, rank: int, world_size: int, notify: Notify,
              retention: tuple[int, int] | None = None,
              durable: Callable[[str], None] | None = None, *, replace: bool = False,
              keep_from: int | None = None) -> Step:
        """Register `rank`'s part of `step`, opening the step on its first rank (which
        also fixes the step's codec).

        `retention` (keep_last, keep_every), if given, replaces the writer's own policy
        for the deletions that follow this step's commit. With `durable`, the step is
        coordinated across nodes: once the rank's part is durable, `durable(tmp dir
        name)` is called instead of waiting here for the whole world. With `replace`, a
        committed step of this number is replaced once the new one is durable (every
        rank must say so). `keep_from`: the retention after this step's commit deletes
        no step from that one on.

        Raises:
            StepAlreadyCommittedError: the step is committed and not `replace`d, or it is
                retired.
            SaveFailedError: the writer is closing, the step failed earlier, or the
                rank/world disagree with the step's other ranks or are out of range.
            OSError: the tmp directory cannot be made.
        """
        if not 0 <= step <= MAX_STEP:
            raise SaveFailedError(f"step {step} is outside 0..{MAX_STEP}", rank=rank)
        if not 1 <= world_size <= MAX_WORLD or not 0 <= rank < world_size:
            raise SaveFailedError(f"rank {rank} / world size {world_size} out of range "
                                  f"(world size 1..{MAX_WORLD})", step=step, rank=rank)
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
            current = self._open.get(step)
            if current is None:
                if step in self._committing or (
                        not replace and self.storage.occupied(step)):
                    raise StepAlreadyCommittedError(
                        "this step is already committed; a save replaces a checkpoint only "
                        "when asked to (replace=True)", step=step, rank=rank)
                if lifetimes.is_retired(self.storage, step):
                    raise StepAlreadyCommittedError(
                        "this step was deleted by retention but its data is still referenced "
                        f"({retired_dir_name(step)}): save under another step number",
                        step=step, rank=rank)
                codec, choice = self._choose_codec()
                if self._index is not None:
                    self._index.refresh()
                    self._index.open(step)
                    if replace:  # no later save on this node may reference the old step
                        self._index.replacing(step)
                tmp_dir = commit.make_tmp_dir(self.storage, step, self._owner)
                current = Step(step, world_size, codec, tmp_dir, choice,
                               coordinated=durable is not None, replace=replace)
                self._open[step] = current
            elif (current.world_size != world_size or current.coordinated != (durable is not None)
                  or current.replace != replace):
                raise SaveFailedError(f"world size {world_size} disagrees with the step's other "
                                      f"ranks ({current.world_size}), or some coordinate "
                                      "across nodes and others not, or some replace the "
                                      "committed step and others not", step=step, rank=rank)
            elif rank in current.waiting:
                raise SaveFailedError("this rank is already saving this step", step=step, rank=rank)
            current.waiting[rank] = notify
            if durable is not None:
                current.durable[rank] = durable
            if retention is not None:
                current.retention = retention
            if keep_from is not None:
                current.keep_from = keep_from
            return current

    def end(self, step: int, part: RankPart, stats: dict) -> None:
        """Record a rank's finished, fsynced part; queue the step for commit if it was
        the last."""
        with self._lock:
            current = self._open.get(step)
            if current is None or part.rank not in current.waiting:
                return  # already failed
            current.parts[part.rank] = part
            current.stats[part.rank] = stats
            if not current.coordinated:
                if len(current.parts) < current.world_size:
                    return
                del self._open[step]
                self._committing[step] = current
        if current.coordinated:
            try:
                commit.write_part(current.tmp_dir, step, part)
                faults.point("part_written")
            except Exception as e:
                self.fail(step, commit.io_error(e, step=step, rank=part.rank)
                          if isinstance(e, OSError) else SaveFailedError(
                              f"part not written: {type(e).__name__}: {e}", step=step,
                              rank=part.rank))
                return
            current.durable[part.rank](current.tmp_dir.name)
            return
        self._ready.put(current)

    def commit_parts(self, step: int, world_size: int, announced: dict[int, str],
                     requester: Notify) -> None:
        """Commit coordinated `step` from the parts every rank announced (the leader's
        writer, asked by the leader rank); `requester` hears the result."""
        with self._lock:
            current = self._open.get(step)
            if (current is None or not current.coordinated or current.world_size != world_size
                    or set(announced) != set(range(world_size))):
                error = SaveFailedError("cannot commit: this writer has no such coordinated step "
                                        "open, or the announced ranks are not the world",
                                        step=step)
            else:
                error = None
                del self._open[step]
                self._committing[step] = current
                current.announced, current.requester = announced, requester
        if error is not None:
            requester(error, None, {})
            return
        self._ready.put(current)

    def outcome(self, step: int, committed: bool) -> None:
        """How a coordinated step ended elsewhere: forget it, and discard its files if it
        failed (if it committed, the leader took them)."""
        with self._lock:
            current = self._open.get(step)
            if current is None or not current.coordinated:
                return
            del self._open[step]
            self._idle.notify_all()
        self._release(step)
        if not committed:  # and what writers that died in it left (several nodes)
            self.storage.discard(current.tmp_dir)
            self._sweep_dead()

    def fail(self, step: int, error: CheckpointError) -> None:
        """Fail `step` for every rank: notify them, forget the step, discard its files."""
        with self._lock:
            current = self._open.pop(step, None)
            if current is None:
                return
            # connected ranks that have not begun it yet will be told when they do; a
            # rank not connected now is a new process when it comes, free to retry
            pending = {r for r, n in self._live.items()
                       if n > 0 and r < current.world_size and r not in current.waiting}
            if pending:
                if len(self._failed) >= _MAX_FAILED_RECORDS:
                    self._failed.pop(next(iter(self._failed)))
                self._failed[step] = (error, pending)
            self._idle.notify_all()
        log.warning("step %d failed: %s", step, error)
        self._release(step)
        self.storage.discard(current.tmp_dir)
        _tell(current.waiting.values(), error)

    def refuse(self, step: int, rank: int, world_size: int, error: CheckpointError) -> None:
        """`rank`'s begin of `step` was refused (its state cannot become a readable
        checkpoint): the step can never complete, so it fails for every rank, including
        connected ranks that begin it later."""
        with self._lock:
            if step not in self._open and step not in self._committing:
                pending = {r for r, n in self._live.items()
                           if n > 0 and r < world_size and r != rank}
                if pending:
                    if len(self._failed) >= _MAX_FAILED_RECORDS:
                        self._failed.pop(next(iter(self._failed)))
                    self._failed[step] = (error, pending)
                return
        self.fail(step, error)

    def rank_joined(self, rank: int) -> None:
        with self._lock:
            self._live[rank] += 1

    def rank_gone(self, rank: int, began: set[int]) -> None:
        """A connection of `rank` closed: fail the open steps *it* began and had not
        ended, and, once no connection of `rank` is left, the open steps still waiting
        for `rank` to begin (it died before saving). A step that another connection
        began as `rank` is not this one's to fail."""
        with self._lock:
            self._live[rank] -= 1
            gone = self._live[rank] <= 0
            doomed = {s.step for step in began if (s := self._open.get(step)) is not None
                      and rank in s.waiting and rank not in s.parts}
            if gone:
                del self._live[rank]
                for record in self._failed.values():
                    record[1].discard(rank)
                doomed |= {s.step for s in self._open.values()
                           if rank < s.world_size and rank not in s.waiting and not s.coordinated}
            for s in [s for s in self._open.values() if s.coordinated and s.step not in doomed
                      and not any(self._live.get(r, 0) > 0 for r in s.waiting)]:
                del self._open[s.step]  # no rank left to hear the outcome; the files stay
                self._release(s.step)
                self._idle.notify_all()  # for the leader (swept later if it never comes)
        for step in sorted(doomed):
            self.fail(step, SaveFailedError("rank disconnected before ending its save",
                                            step=step, rank=rank))

    def fail_absent(self, timeout: float) -> None:
        """Fail steps open for over `timeout` s that wait on a rank with no connection
        (one that died before it began the step, or never started)."""
        now = time.monotonic()
        with self._lock:
            live = {r for r, n in self._live.items() if n > 0}
            doomed = []
            for s in self._open.values():
                if now - s.started < timeout or s.coordinated:  # its ranks are mostly remote
                    continue
                present = len(s.waiting) + sum(1 for r in live
                                               if r < s.world_size and r not in s.waiting)
                if present < s.world_size:
                    doomed.append((s.step, s.world_size, set(s.waiting)))
        for step, world, waiting in doomed:
            absent = []
            for r in range(world):  # outside the lock; stops at the first few
                if r not in waiting and r not in live:
                    absent.append(r)
                    if len(absent) > 8:
                        break
            names = ", ".join(map(str, absent[:8])) + (", ..." if len(absent) > 8 else "")
            self.fail(step, SaveFailedError(
                f"rank{'s' if len(absent) > 1 else ''} {names} not connected {timeout:g} s after "
                "the step began (dead or never started)", step=step))

    def close(self, timeout: float) -> None:
        """Refuse new steps; wait up to `timeout` s for open and committing ones, then
        fail the rest and stop the committer.

        Call after the listener is closed: a step waiting on a rank that is not
        connected can then never complete, so it fails at once.
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closing = True
        self.fail_absent(0)
        with self._lock:
            while (self._open or self._committing) and time.monotonic() < deadline:
                self._idle.wait(max(0.0, deadline - time.monotonic()))
            left = list(self._open)
        for step in left:
            self.fail(step, SaveFailedError("the writer shut down before all ranks ended",
                                            step=step))
        self._ready.put(None)
        self._committer.join(max(0.0, deadline - time.monotonic()) + 1)

    # -- committer thread ------------------------------------------------------------

    def _commit_loop(self) -> None:
        while (current := self._ready.get()) is not None:
            try:
                self._commit(current)
            except Exception:  # the thread must outlive any bug, or every later step hangs
                log.exception("committer: step %d", current.step)
            finally:
                with self._lock:
                    self._committing.pop(current.step, None)
                    self._idle.notify_all()

    def _commit(self, current: Step) -> None:
        tell = [current.requester] if current.requester else list(current.waiting.values())
        try:
            if current.announced is not None:
                parts = commit.gather_parts(self.root, current.tmp_dir, current.step,
                                            current.announced, self._max_frame_bytes)
            else:
                parts = [current.parts[r] for r in range(current.world_size)]
            manifest = Manifest(step=current.step, world_size=current.world_size, ranks=parts)
            data = manifest.to_bytes()
            if self._check is not None:
                self._check(data, manifest)
            lifetimes.check_references(self.storage, manifest)
            if current.replace:
                lifetimes.check_replaceable(self.storage, current.step, self._index)
            path = commit.publish(self.storage, current.tmp_dir, current.step, data,
                                  replace=current.replace)
        except Exception as e:  # whatever it is, every rank of the step must hear of it
            error = e if isinstance(e, CheckpointError) else SaveFailedError(
                f"commit failed: {type(e).__name__}: {e}", step=current.step)
            self.storage.discard(current.tmp_dir)
            self._release(current.step)
            log.warning("step %d failed at commit: %s", current.step, error)
            _tell(tell, error)
            return
        if self._index is not None:
            self._index.add(manifest)
        self._release(current.step)
        self._prune(current)
        if current.announced is not None:  # what writers that are gone left
            self._sweep_dead()
        if self._on_commit:
            try:
                self._on_commit(manifest, current)
            except Exception:
                log.exception("commit hook failed")
        stats = {"raw_bytes": manifest.raw_size, "stored_bytes": manifest.stored_size,
                 "new_bytes": manifest.raw_size - manifest.referenced_size,
                 "referenced_bytes": manifest.referenced_size,
                 "seconds": time.monotonic() - current.started}
        if current.requester is not None:
            current.requester(None, path, {**stats, **current.stats.get(0, {})})
            return
        for rank, notify in current.waiting.items():
            notify(None, path, {**stats, **current.stats.get(rank, {})})

    def _prune(self, current: Step) -> None:
        keep_last, keep_every = current.retention or self.retention
        try:
            done = lifetimes.prune(self.storage, keep_last, keep_every, newest=current.step,
                                   keep_from=current.keep_from, index=self._index)
        except Exception as e:  # retention is best effort; the new step is already durable
            log.warning("retention failed: %s: %s", type(e).__name__, e)
            return
        if done.deleted or done.retired or done.reclaimed:
            log.info("retention (keep_last=%d, keep_every=%d) deleted steps %s, retired %s "
                     "(still referenced), reclaimed retired %s", keep_last, keep_every,
                     done.deleted, done.retired, done.reclaimed)

    def _sweep_dead(self) -> None:
        for name in owners.sweep_dead(self.root):
            log.info("removed %s, left by a writer that is gone", name)

    def _release(self, step: int) -> None:
        if self._index is not None:
            self._index.release(step)


def _tell(notifies: Any, error: CheckpointError) -> None:
    for notify in list(notifies):
        notify(error, None, {})
