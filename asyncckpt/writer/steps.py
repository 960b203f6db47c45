"""Assembling a step from its ranks, until it can be committed or has failed.

A step is committed only when every rank of its world has sent `end` for it; until
then its files sit in one `step-N.tmp-<id>/` that nothing reads. The first failure of
any rank (an I/O error, an abort, a disconnect before its `end`) fails the whole step
for every rank, and the tmp directory is discarded. Ranks that had not yet begun the
failed step learn of the failure when they do, instead of waiting for peers that will
never come (`FailedSteps`). A completed step goes to the committer (committer.py),
which publishes it or fails it the same way.

Across several nodes (a *coordinated* step) a writer sees only its own node's ranks.
The two kinds share one table of open steps, because every rank event (begin,
disconnect, shutdown) must see both; what follows a rank's end is each kind's policy
(nodes.py: `OneNode`, `SeveralNodes`).

With incremental saves a step opens in the writer's dedup index (its lookups pin the
steps they reference) and is released once it ends either way.

Nothing here iterates over a world size: a rank may claim any world up to
`MAX_WORLD`, and the work per event stays proportional to the connected ranks.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from asyncckpt.config import MAX_FRAME_BYTES
from asyncckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    SaveFailedError,
    StepAlreadyCommittedError,
)
from asyncckpt.format.layout import (
    MAX_STEP,
    MAX_WORLD,
    node_dir_name,
    retired_dir_name,
)
from asyncckpt.format.manifest import Manifest
from asyncckpt.format.records import RankPart
from asyncckpt.format.timeline import Timeline
from asyncckpt.ipc.messages import NodePart
from asyncckpt.ipc.options import NO_OPTIONS, SaveOptions, is_step
from asyncckpt.runtime import faults
from asyncckpt.storage.base import Storage
from asyncckpt.storage.paths import Location
from asyncckpt.storage.timeline import abandoned_steps, write_current
from asyncckpt.writer import commit
from asyncckpt.writer.committer import Busy, Check, Committer, abandon
from asyncckpt.writer.dedup import DedupIndex
from asyncckpt.writer.nodes import NodeJoin, OneNode, SeveralNodes
from asyncckpt.writer.owners import OwnerMark
from asyncckpt.writer.retention import is_retired, reclaim
from asyncckpt.writer.step import FailedSteps, Notify, Step
from asyncckpt.writer.timelines import ALREADY_COMMITTED, Settled, settle

log = logging.getLogger("asyncckpt.writer")

# a never-connected rank fails a step after absent_rank_timeout / UNSEEN_FRACTION, but no
# sooner than UNSEEN_FLOOR s: ranks started together may reach their first save seconds apart
UNSEEN_FRACTION, UNSEEN_FLOOR = 6, 5.0


def _raw() -> tuple[str, dict[str, Any] | None]:
    """The codec of a writer that chooses none: raw, with nothing seen."""
    return "raw", None


class Steps:
    """The open steps of one writer, local and coordinated. Thread-safe; every method
    may be called from any session thread. Completed steps go to the `Committer`
    started here.

    Args:
        root: the checkpoint root (`storage`'s).
        retention: the writer's (keep_last, keep_every), unless a save names its own.
        storage: the root's storage; every file of a step is made through it.
        choose_codec: () -> (codec, what the chooser saw) for a new step.
        check, on_commit, max_frame_bytes, index: the committer's (committer.py).
        owner: this writer's owner mark (names its tmp directories).
        busy: held around each commit (the writer's memory sampler: runtime/procstat.py).
    """

    def __init__(self, root: Location, retention: tuple[int, int] = (0, 0), *, storage: Storage,
                 choose_codec: Callable[[], tuple[str, dict[str, Any] | None]] = _raw,
                 check: Check | None = None,
                 on_commit: Callable[[Manifest, Step], None] | None = None,
                 max_frame_bytes: int = MAX_FRAME_BYTES, index: DedupIndex | None = None,
                 owner: OwnerMark | None = None,
                 busy: Busy = contextlib.nullcontext) -> None:
        self.root = root
        self.storage = storage
        self.index = index
        self._owner = owner
        self._choose_codec = choose_codec
        # the table: guarded by `lock`, shared with the policies (nodes.py)
        self.lock = threading.Lock()
        self.open: dict[int, Step] = {}
        self.committing: dict[int, Step] = {}
        self.live: collections.Counter[int] = collections.Counter()
        self.idle = threading.Condition(self.lock)
        self._failed = FailedSteps()
        self._seen: set[int] = set()  # ranks that ever said hello to this writer
        self._closing = False
        self.committer = Committer(self.storage, retention, done=self._committed, check=check,
                                   on_commit=on_commit, max_frame_bytes=max_frame_bytes,
                                   index=index, busy=busy)
        self._one = OneNode(self)
        self.nodes = SeveralNodes(self)
        self._no_targets(None)

    def _policy(self, current: Step) -> OneNode | SeveralNodes:
        return self.nodes if current.coordinated else self._one

    def begin(self, step: int, rank: int, world_size: int, notify: Notify,
              options: SaveOptions = NO_OPTIONS, join: NodeJoin | None = None) -> Step:
        """Register `rank`'s part of `step`, opening the step on its first rank (which
        also fixes the step's codec).

        `options` (SaveOptions): its retention, if given, replaces the writer's own
        policy for the deletions that follow this step's commit; `keep_from`: that
        retention deletes no step from that one on, nor any of `keep_steps`;
        `replace`: a committed step of this number is replaced once the new one is
        durable (every rank must say so; a step of an abandoned timeline is replaced
        without it); `timeline`: the timeline the save begins (every rank must carry
        the same). With
        `join`, the step is coordinated across nodes, `join.node` naming the ranks of
        this rank's node: once all their parts are durable, the lead's (the first's)
        `join.durable(tmp dir name, part entry)` is called instead of waiting here for
        the whole world.

        Raises:
            StepAlreadyCommittedError: the step is committed, live and not `replace`d, or
                it is retired.
            TimelineMovedError: the save begins a timeline from a restore, and another
                run began one on the root since.
            SaveFailedError: the writer is closing, the step failed earlier, or the
                rank/world disagree with the step's other ranks or are out of range.
            OSError: the tmp directory cannot be made.
        """
        if not is_step(step):
            raise SaveFailedError(f"step {step} is outside 0..{MAX_STEP}", rank=rank)
        if not 1 <= world_size <= MAX_WORLD or not 0 <= rank < world_size:
            raise SaveFailedError(f"rank {rank} / world size {world_size} out of range "
                                  f"(world size 1..{MAX_WORLD})", step=step, rank=rank)
        node = None if join is None else join.node
        if node is not None and not node.first <= rank < node.first + node.size <= world_size:
            raise SaveFailedError(f"node {list(node)} (first rank, count) does not hold "
                                  f"rank {rank} in a world of {world_size}", step=step,
                                  rank=rank)
        with self.lock:
            if self._closing:
                raise SaveFailedError("the writer is shutting down", step=step, rank=rank)
            error = self._failed.claim(step, rank)
            if error is not None:
                raise error
            current = self.open.get(step)
            if current is None:
                current = self._open_step(step, rank, world_size, join is not None, options,
                                          lead=node is None or node.first == 0)
            elif (current.world_size != world_size or current.coordinated != (join is not None)
                  or current.replace != options.replace
                  or current.timeline != options.timeline):
                raise SaveFailedError(f"world size {world_size} disagrees with the step's other "
                                      f"ranks ({current.world_size}), or some coordinate "
                                      "across nodes and others not, or some replace the "
                                      "committed step and others not, or they begin different "
                                      "timelines", step=step, rank=rank)
            elif rank in current.waiting:
                raise SaveFailedError("this rank is already saving this step", step=step, rank=rank)
            if node is not None and current.join_node(rank, node):
                self.storage.make_node_folder(current.tmp_dir, node_dir_name(node.first))
            current.waiting[rank] = notify
            if join is not None:
                current.durable[rank] = join.durable
            current.take_options(options)
            return current

    def _open_step(self, step: int, rank: int, world_size: int, coordinated: bool,
                   options: SaveOptions, lead: bool = True) -> Step:
        """A new open step (its codec chosen, its tmp directory made); under the lock.
        A committed step of its number is refused, or replaced, by the commit's rule
        (timelines.py), asked now so a refused save writes nothing; a retired step of
        its number is deleted first when nothing references it (retention.reclaim; a
        coordinated step leaves that to the leader's retention), else refused. A step
        that begins a timeline writes the root's timeline file now on the writer of the
        leader's node (`lead`: the node of rank 0, or the only node), before any byte of
        the step."""
        replace = options.replace
        if step in self.committing:
            raise StepAlreadyCommittedError(ALREADY_COMMITTED, step=step, rank=rank)
        occupied = self.storage.occupied(step)
        if occupied or options.timeline is not None:
            try:
                settled = settle(self.storage, step, options.timeline, replace, rank)
            except CorruptCheckpointError as e:  # the root's timeline file
                raise SaveFailedError(str(e), step=step, rank=rank) from None
            replace = settled.replace
            if settled.new and lead:
                self._begin_timeline(step, settled)
        if replace and occupied and not self.storage.replaces:
            raise SaveFailedError("this step is committed, and an object-store root cannot "
                                  "replace a step atomically: save under another step number "
                                  "or into another prefix", step=step, rank=rank)
        if is_retired(self.storage, step) and (coordinated  # only the leader deletes
                                               or not reclaim(self.storage, step, self.index)):
            raise StepAlreadyCommittedError(
                "this step was deleted by retention but its data is still referenced "
                f"({retired_dir_name(step)}): save under another step number",
                step=step, rank=rank)
        codec, choice = self._choose_codec()
        if self.index is not None:
            self.index.refresh()
            self.index.open(step)
            if replace and occupied:  # no later save on this node may reference the old step
                self.index.replacing(step)
        tmp_dir = commit.make_tmp_dir(self.storage, step, self._owner)
        current = Step(step, world_size, codec, tmp_dir, choice, coordinated=coordinated,
                       replace=options.replace, timeline=options.timeline)
        self.open[step] = current
        return current

    def _no_targets(self, current: Timeline | None) -> None:
        """Make the steps abandoned under `current` (default: the root's) no dedup
        targets: a save of the live history must not reference them, or retention
        could only retire them and a new save of their number could not replace them."""
        if self.index is None:
            return
        try:
            abandoned = abandoned_steps(self.storage, current)
        except CorruptCheckpointError as e:  # saves report it; nothing to skip here
            log.warning("incremental: %s", e)
            return
        for step in abandoned:
            self.index.replacing(step)

    def _begin_timeline(self, step: int, settled: Settled) -> None:
        """Write the root's timeline file for the timeline `step`'s save begins, now,
        before any of its bytes: a job that restored an older step and dies during its
        first save must resume from that step, not from the steps it rolled back. Across
        nodes only the leader's node writes it (then again at the commit if a crash
        undid nothing: the commit finds it current).

        Raises:
            SaveFailedError: it cannot be written (nothing changed).
        """
        try:
            write_current(self.storage, settled.record)
        except OSError as e:
            raise commit.io_error(e, step=step, file=str(e.filename or self.root)) from e
        log.info("step %d begins %s, forked from step %s", step, settled.record.describe(),
                 settled.record.lineage[-1][1] if settled.record.lineage else "-")
        faults.point("timeline_written")
        self._no_targets(settled.record)

    def end(self, step: int, part: RankPart, stats: dict) -> None:
        """Record a rank's finished, fsynced part; the step's policy (nodes.py) decides
        what follows: a local step is queued for commit once its last rank ended, a
        coordinated one makes its node's part durable for the node's lead to announce."""
        with self.lock:
            current = self.open.get(step)
            if current is None or part.rank not in current.waiting:
                return  # already failed
            current.parts[part.rank] = part
            current.stats[part.rank] = stats
        self._policy(current).ended(current, part)

    def fail(self, step: int, error: CheckpointError, gone: int | None = None) -> None:
        """Fail `step` for every rank: notify them, forget the step, discard its files.
        If rank `gone` (which died) was a node's lead in a coordinated step, the node's
        next rank is told to speak for the node in the store (`ask`): the lead would
        have, and the other nodes need not wait for its silence to be noticed."""
        with self.lock:
            current = self.open.pop(step, None)
            if current is None:
                return
            # connected ranks that have not begun it yet will be told when they do; a
            # rank not connected now is a new process when it comes, free to retry
            self._failed.note(step, error, self._connected(current.world_size,
                                                           set(current.waiting)))
            self.idle.notify_all()
        log.warning("step %d failed: %s", step, error)
        tell = dict(current.waiting)
        speaker = current.speaker(gone) if gone is not None else None
        if speaker is not None:
            tell[speaker] = functools.partial(tell[speaker], ask=True)
        abandon(self.storage, current, error, tell.values(), self.index)

    def refuse(self, step: int, rank: int, world_size: int, error: CheckpointError) -> None:
        """`rank`'s begin of `step` was refused (its state cannot become a readable
        checkpoint): the step can never complete, so it fails for every rank, including
        connected ranks that begin it later."""
        with self.lock:
            if step not in self.open and step not in self.committing:
                self._failed.note(step, error, self._connected(world_size, {rank}))
                return
        self.fail(step, error)

    def rank_joined(self, rank: int) -> None:
        with self.lock:
            self.live[rank] += 1
            self._seen.add(rank)

    def rank_gone(self, rank: int, began: set[int]) -> None:
        """A connection of `rank` closed: fail the open steps *it* began and had not
        ended, and, once no connection of `rank` is left, the open local steps still
        waiting for `rank` to begin (it died before saving). A step that another
        connection began as `rank` is not this one's to fail; a coordinated step with
        no connected rank left is dropped (`SeveralNodes.drop_unheard`)."""
        with self.lock:
            self.live[rank] -= 1
            gone = self.live[rank] <= 0
            doomed = {s.number for step in began if (s := self.open.get(step)) is not None
                      and rank in s.waiting and rank not in s.parts}
            orphaned = []
            if gone:
                del self.live[rank]
                self._failed.forget_rank(rank)
                doomed |= {s.number for s in self.open.values()
                           if rank < s.world_size and rank not in s.waiting and not s.coordinated}
                orphaned = self.nodes.orphaned_by(rank)
            self.nodes.drop_unheard(doomed)
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
        with self.lock:
            live = {r for r, n in self.live.items() if n > 0}
            doomed = []
            for s in self.open.values():
                age = now - s.started
                nodes = self._policy(s).expected(s)
                if s.coordinated:  # its node's ranks, connected or not, must all begin
                    present = len(s.waiting)
                    unseen = False
                else:
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
        with self.lock:
            self._closing = True
        self.fail_absent(0)
        with self.lock:
            while (self.open or self.committing) and time.monotonic() < deadline:
                self.idle.wait(max(0.0, deadline - time.monotonic()))
            left = list(self.open)
        for step in left:
            self.fail(step, SaveFailedError("the writer shut down before all ranks ended",
                                            step=step))
        self.committer.stop(deadline - time.monotonic())

    # -- coordinated steps (several nodes): nodes.py ---------------------------------

    def commit_nodes(self, step: int, world_size: int, nodes: tuple[NodePart, ...],
                     requester: Notify) -> None:
        """The leader rank asks to commit coordinated `step` (SeveralNodes.commit_nodes)."""
        self.nodes.commit_nodes(step, world_size, nodes, requester)

    def outcome(self, step: int, error: CheckpointError | None, sender: int) -> None:
        """How coordinated `step` ended, as rank `sender` learned it (SeveralNodes.outcome)."""
        self.nodes.outcome(step, error, sender)

    # -- shared -----------------------------------------------------------------------

    def _connected(self, world_size: int, excluded: set[int]) -> set[int]:
        """Connected ranks of a `world_size` world, but `excluded`; under the lock."""
        return {r for r, n in self.live.items() if n > 0 and r < world_size and r not in excluded}

    def _committed(self, step: int) -> None:
        """The committer is done with `step` (committed or failed)."""
        with self.lock:
            self.committing.pop(step, None)
            self.idle.notify_all()


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
