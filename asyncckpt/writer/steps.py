"""Assembling a step from its ranks, until it can be committed or has failed.

A step is committed only when every rank of its world has sent `end` for it; until
then its files sit in one `step-N.tmp-<id>/` that nothing reads. The first failure of
any rank (an I/O error, an abort, a disconnect before its `end`) fails the whole step
for every rank, and the tmp directory is discarded. Ranks that had not yet begun the
failed step learn of the failure when they do, instead of waiting for peers that will
never come (`FailedSteps`). A completed step goes to the committer (committer.py),
which publishes it or fails it the same way.

Across several nodes (a *coordinated* step: the ranks say so in their begin, with the
ranks of their node), a writer sees only its own node's ranks. Their data files go into
a node folder of its tmp directory; once every rank of the node has ended, the writer
writes the node's part file there and tells the node's lead rank (its first), which
announces the node to the others through the job's store (coordination.py). When every
node has announced, the leader rank asks its writer to commit, and that writer moves
every node's folder into its tmp directory (one rename a node) and commits a root
manifest that lists the parts. The node's lead learns the outcome through the store and
tells its writer (`outcome`), which passes it on to the node's other ranks and then
forgets the step or discards its files: the other ranks never touch the store unless
something fails on their node. The two kinds share one table of open steps, because
every rank event (begin, disconnect, shutdown) must see both; what only one kind does
is in its own methods.

With incremental saves a step opens in the writer's dedup index (its lookups pin the
steps they reference) and is released once it ends either way.

Nothing here iterates over a world size: a rank may claim any world up to
`MAX_WORLD`, and the work per event stays proportional to the connected ranks.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncckpt.config import MAX_FRAME_BYTES
from asyncckpt.errors import CheckpointError, SaveFailedError, StepAlreadyCommittedError
from asyncckpt.format.layout import (
    MAX_STEP,
    MAX_WORLD,
    node_dir_name,
    retired_dir_name,
    step_dir_name,
)
from asyncckpt.format.manifest import Manifest
from asyncckpt.format.records import RankPart
from asyncckpt.ipc.messages import NodePart
from asyncckpt.runtime import faults
from asyncckpt.storage.base import Storage
from asyncckpt.storage.location import is_object
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.writer import commit
from asyncckpt.writer.committer import Check, Committer, abandon, release, sweep_dead
from asyncckpt.writer.dedup import DedupIndex
from asyncckpt.writer.owners import OwnerMark
from asyncckpt.writer.retention import is_retired
from asyncckpt.writer.step import FailedSteps, Notify, Step

log = logging.getLogger("asyncckpt.writer")

# a never-connected rank fails a step after absent_rank_timeout / UNSEEN_FRACTION, but no
# sooner than UNSEEN_FLOOR s: ranks started together may reach their first save seconds apart
UNSEEN_FRACTION, UNSEEN_FLOOR = 6, 5.0


class Steps:
    """The open steps of one writer, local and coordinated. Thread-safe; every method
    may be called from any session thread. Completed steps go to the `Committer`
    started here."""

    def __init__(self, root: Path, retention: tuple[int, int] = (0, 0), *,
                 choose_codec: Callable[[], tuple[str, dict[str, Any] | None]] = lambda: ("raw", None),
                 check: Check | None = None,
                 on_commit: Callable[[Manifest, Step], None] | None = None,
                 max_frame_bytes: int = MAX_FRAME_BYTES, index: DedupIndex | None = None,
                 owner: OwnerMark | None = None, storage: Storage | None = None) -> None:
        self.root = root
        self.storage = storage or PosixStorage(root)
        self._owner = owner
        self._index = index
        self._choose_codec = choose_codec
        self._lock = threading.Lock()
        self._open: dict[int, Step] = {}
        self._committing: dict[int, Step] = {}
        self._relaying: dict[int, Step] = {}  # leader: committed or not, its outcome to relay
        self._failed = FailedSteps()
        self._live: collections.Counter[int] = collections.Counter()
        self._seen: set[int] = set()  # ranks that ever said hello to this writer
        self._closing = False
        self._idle = threading.Condition(self._lock)
        self._committer = Committer(self.storage, retention, done=self._committed, check=check,
                                    on_commit=on_commit, max_frame_bytes=max_frame_bytes,
                                    index=index)

    def begin(self, step: int, rank: int, world_size: int, notify: Notify,
              retention: tuple[int, int] | None = None,
              durable: Callable[[str, dict], None] | None = None, *, replace: bool = False,
              keep_from: int | None = None, node: tuple[int, int] | None = None) -> Step:
        """Register `rank`'s part of `step`, opening the step on its first rank (which
        also fixes the step's codec).

        `retention` (keep_last, keep_every), if given, replaces the writer's own policy
        for the deletions that follow this step's commit. With `durable`, the step is
        coordinated across nodes, `node` (first rank, count) naming the ranks of this
        node: once all their parts are durable, the lead's (the first's) `durable(tmp dir
        name, part entry)` is called instead of waiting here for the whole world. With `replace`, a
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
        if durable is not None:
            node = node or (rank, 1)
            if not node[0] <= rank < node[0] + node[1] <= world_size:
                raise SaveFailedError(f"node {list(node)} (first rank, count) does not hold "
                                      f"rank {rank} in a world of {world_size}", step=step,
                                      rank=rank)
        with self._lock:
            if self._closing:
                raise SaveFailedError("the writer is shutting down", step=step, rank=rank)
            error = self._failed.claim(step, rank)
            if error is not None:
                raise error
            current = self._open.get(step)
            if current is None:
                current = self._open_step(step, rank, world_size, durable is not None, replace)
            elif (current.world_size != world_size or current.coordinated != (durable is not None)
                  or current.replace != replace):
                raise SaveFailedError(f"world size {world_size} disagrees with the step's other "
                                      f"ranks ({current.world_size}), or some coordinate "
                                      "across nodes and others not, or some replace the "
                                      "committed step and others not", step=step, rank=rank)
            elif rank in current.waiting:
                raise SaveFailedError("this rank is already saving this step", step=step, rank=rank)
            if node is not None and current.join_node(rank, node) and not is_object(self.root):
                (current.tmp_dir / node_dir_name(node[0])).mkdir()
            current.waiting[rank] = notify
            if durable is not None:
                current.durable[rank] = durable
            if retention is not None:
                current.retention = retention
            if keep_from is not None:
                current.keep_from = keep_from
            return current

    def _open_step(self, step: int, rank: int, world_size: int, coordinated: bool,
                   replace: bool) -> Step:
        """A new open step (its codec chosen, its tmp directory made); under the lock."""
        if replace and is_object(self.root) and self.storage.occupied(step):
            raise SaveFailedError("this step is committed, and an object-store root cannot "
                                  "replace a step atomically: save under another step number "
                                  "or into another prefix", step=step, rank=rank)
        if step in self._committing or (
                not replace and self.storage.occupied(step)):
            raise StepAlreadyCommittedError(
                "this step is already committed; a save replaces a checkpoint only "
                "when asked to (replace=True)", step=step, rank=rank)
        if is_retired(self.storage, step):
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
        current = Step(step, world_size, codec, tmp_dir, choice, coordinated=coordinated,
                       replace=replace)
        self._open[step] = current
        return current

    def end(self, step: int, part: RankPart, stats: dict) -> None:
        """Record a rank's finished, fsynced part. A local step is queued for commit
        once its last rank ended; a coordinated one makes the part durable for the rank
        to announce."""
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
            self._part_durable(current, part)
        else:
            self._committer.submit(current)

    def fail(self, step: int, error: CheckpointError, gone: int | None = None) -> None:
        """Fail `step` for every rank: notify them, forget the step, discard its files.
        If rank `gone` (which died) was a node's lead in a coordinated step, the node's
        next rank is told to speak for the node in the store (`ask`): the lead would
        have, and the other nodes need not wait for its silence to be noticed."""
        with self._lock:
            current = self._open.pop(step, None)
            if current is None:
                return
            # connected ranks that have not begun it yet will be told when they do; a
            # rank not connected now is a new process when it comes, free to retry
            self._failed.note(step, error, self._connected(current.world_size,
                                                           set(current.waiting)))
            self._idle.notify_all()
        log.warning("step %d failed: %s", step, error)
        tell = dict(current.waiting)
        speaker = current.speaker(gone) if gone is not None else None
        if speaker is not None:
            tell[speaker] = functools.partial(tell[speaker], ask=True)
        abandon(self.storage, current, error, tell.values(), self._index)

    def refuse(self, step: int, rank: int, world_size: int, error: CheckpointError) -> None:
        """`rank`'s begin of `step` was refused (its state cannot become a readable
        checkpoint): the step can never complete, so it fails for every rank, including
        connected ranks that begin it later."""
        with self._lock:
            if step not in self._open and step not in self._committing:
                self._failed.note(step, error, self._connected(world_size, {rank}))
                return
        self.fail(step, error)

    def rank_joined(self, rank: int) -> None:
        with self._lock:
            self._live[rank] += 1
            self._seen.add(rank)

    def rank_gone(self, rank: int, began: set[int]) -> None:
        """A connection of `rank` closed: fail the open steps *it* began and had not
        ended, and, once no connection of `rank` is left, the open local steps still
        waiting for `rank` to begin (it died before saving). A step that another
        connection began as `rank` is not this one's to fail; a coordinated step with
        no connected rank left is dropped (`_drop_unheard`)."""
        with self._lock:
            self._live[rank] -= 1
            gone = self._live[rank] <= 0
            doomed = {s.number for step in began if (s := self._open.get(step)) is not None
                      and rank in s.waiting and rank not in s.parts}
            orphaned = []
            if gone:
                del self._live[rank]
                self._failed.forget_rank(rank)
                doomed |= {s.number for s in self._open.values()
                           if rank < s.world_size and rank not in s.waiting and not s.coordinated}
                orphaned = [s for s in [*self._open.values(), *self._relaying.values()]
                            if rank in s.durable_nodes]
            self._drop_unheard(doomed)
        for step in sorted(doomed):
            self.fail(step, SaveFailedError("rank disconnected before ending its save",
                                            step=step, rank=rank), gone=rank)
        for s in orphaned:  # another rank learns the outcome from the store in its place
            speaker = s.speaker(rank)
            if speaker is not None:
                s.waiting[speaker](SaveFailedError(
                    f"this node's lead rank {rank} is gone while the step was being agreed",
                    step=s.number, rank=rank), None, {}, ask=True)

    def fail_absent(self, timeout: float) -> None:
        """Fail steps open for over `timeout` s that wait on a rank: for a local step, a
        rank of the world with no connection (one that died before it began the step, or
        never started); for a coordinated one, any rank of this writer's nodes that has
        not begun it (connected or not: a live node whose rank skips a save would
        otherwise be waited for without end, its lead's heartbeat keeping it alive).

        A local step waiting on a rank that never said hello to this writer fails sooner,
        after `timeout` / `UNSEEN_FRACTION` s (`UNSEEN_FLOOR` s at least, `timeout` at
        most): on one node the ranks of a job that all save connect within seconds of
        each other (a client connects at its first save),
        so a rank still unheard of by then is most likely one that never saves -- only
        some ranks saving (Lightning's DDP saves on rank 0 only) -- and the error says
        so, and what to do.
        """
        now = time.monotonic()
        unseen_after = min(timeout, max(timeout / UNSEEN_FRACTION, UNSEEN_FLOOR))
        with self._lock:
            live = {r for r, n in self._live.items() if n > 0}
            doomed = []
            for s in self._open.values():
                age = now - s.started
                if s.coordinated:  # its node's ranks, connected or not, must all begin
                    nodes = list(s.nodes_here.items())
                    present = len(s.waiting)
                    unseen = False
                else:
                    nodes = [(0, s.world_size)]
                    present = len(s.waiting) + sum(1 for r in live if r not in s.waiting
                                                   and r < s.world_size)
                    unseen = sum(1 for r in self._seen if r < s.world_size) < s.world_size
                if present >= sum(count for _, count in nodes):
                    continue
                if age >= timeout or (unseen and age >= unseen_after):
                    doomed.append((s, nodes, set(s.waiting), set(self._seen) if unseen else None,
                                   age))
        for s, nodes, waiting, seen, age in doomed:
            self.fail(s.number, SaveFailedError(_absence(s, nodes, waiting, live, seen, age),
                                                step=s.number))

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
        self._committer.stop(deadline - time.monotonic())

    # -- coordinated steps (several nodes) ---------------------------------------------

    def commit_nodes(self, step: int, world_size: int, nodes: tuple[NodePart, ...],
                     requester: Notify) -> None:
        """Commit coordinated `step` from the parts every node announced (the leader's
        writer, asked by the leader rank); `requester` hears the result."""
        with self._lock:
            current = self._open.get(step)
            if (current is None or not current.coordinated or current.world_size != world_size
                    or current.durable_nodes != set(current.nodes_here)):
                error: CheckpointError | None = SaveFailedError(
                    "cannot commit: this writer has no such coordinated step open with its "
                    "node's part durable", step=step)
            else:
                error = None
                del self._open[step]
                self._committing[step] = self._relaying[step] = current
                current.nodes, current.requester = nodes, requester
        if error is not None:
            requester(error, None, {})
            return
        self._committer.submit(current)

    def outcome(self, step: int, error: CheckpointError | None, sender: int) -> None:
        """How coordinated `step` ended, as rank `sender` of this node learned it through
        the store: the node's other ranks hear it, then the step is forgotten, its files
        discarded if it failed (if it committed, the leader took them)."""
        with self._lock:
            current = self._relaying.pop(step, None)
            if current is None:
                current = self._open.get(step)
                if current is None or not current.coordinated:
                    return
                del self._open[step]
            committing = step in self._committing  # its files are the committer's
            self._idle.notify_all()
        path = None if error else self.storage.root / step_dir_name(step)
        for rank, notify in current.waiting.items():
            if rank != sender:
                notify(error, path, current.stats.get(rank, {}), relayed=True)
        release(step, self._index)
        if error is not None and not committing:  # and what dead writers left (several nodes)
            self.storage.discard(current.tmp_dir)
            sweep_dead(self.root)

    def _part_durable(self, current: Step, part: RankPart) -> None:
        """Once every rank of the node has ended: write the node's part file beside
        their data, then tell the node's lead rank its tmp dir and part."""
        first = current.node_of[part.rank]
        count = current.nodes_here[first]
        with self._lock:
            if (first in current.durable_nodes or self._open.get(current.number) is not current
                    or any(r not in current.parts for r in range(first, first + count))):
                return
            current.durable_nodes.add(first)
        try:
            entry = commit.write_node_part(self.storage, current.tmp_dir, current.number,
                                           [current.parts[r] for r in range(first, first + count)])
            faults.point("part_written")
        except Exception as e:
            self.fail(current.number, commit.io_error(e, step=current.number, rank=part.rank)
                      if isinstance(e, OSError) else SaveFailedError(
                          f"node part not written: {type(e).__name__}: {e}",
                          step=current.number, rank=part.rank))
            return
        current.durable[first](current.tmp_dir.name, entry)

    def _drop_unheard(self, failing: set[int]) -> None:
        """Forget coordinated steps (other than `failing`) none of whose ranks is
        connected: no rank is left to hear the outcome; the files stay for the leader
        (swept later if it never comes). Under the lock."""
        for s in [s for s in self._open.values() if s.coordinated and s.number not in failing
                  and not any(self._live.get(r, 0) > 0 for r in s.waiting)]:
            del self._open[s.number]
            release(s.number, self._index)
            self._idle.notify_all()

    # -- shared -----------------------------------------------------------------------

    def _connected(self, world_size: int, excluded: set[int]) -> set[int]:
        """Connected ranks of a `world_size` world, but `excluded`; under the lock."""
        return {r for r, n in self._live.items() if n > 0 and r < world_size and r not in excluded}

    def _committed(self, step: int) -> None:
        """The committer is done with `step` (committed or failed)."""
        with self._lock:
            self._committing.pop(step, None)
            self._idle.notify_all()


def _absence(s: Step, nodes: list[tuple[int, int]], waiting: set[int], live: set[int],
             seen: set[int] | None, age: float) -> str:
    """Why step `s` fails for its absent ranks (the first few named), `age` s after it
    began; `seen`: the ranks that ever connected, when some rank of the world never did."""
    absent = []
    for r in (r for f, c in nodes for r in range(f, f + c)):  # stops at the first few
        if r not in waiting and (s.coordinated or r not in live) and (
                seen is None or r not in seen):
            absent.append(r)
            if len(absent) > 8:
                break
    names = ", ".join(map(str, absent[:8])) + (", ..." if len(absent) > 8 else "")
    ranks = f"rank{'s' if len(absent) > 1 else ''} {names}"
    if s.coordinated:
        return f"{ranks} of this node did not begin the step {age:.1f} s after it began " \
               "(dead, never started, or not saving this step)"
    if seen is None:
        return f"{ranks} not connected {age:.1f} s after the step began (dead, never " \
               "started, or not saving this step)"
    saving = sorted(waiting)
    shown = ", ".join(map(str, saving[:8])) + (", ..." if len(saving) > 8 else "")
    return (f"{ranks} not connected: never connected to this writer, {age:.1f} s after the "
            f"step began (rank{'s' if len(saving) > 1 else ''} {shown} of a world of "
            f"{s.world_size} saved it). If only some ranks save (Lightning's DDP saves on "
            "rank 0 only), use world_size=1 on the saving rank; otherwise the missing ranks "
            "never started or save to another writer")
