"""What follows a rank's end: the step table's two policies, one node or several.

The step table (steps.py) keeps the open steps and their lock; what happens once a rank
has ended its part depends on how the step is committed, and that is decided here.

On one node (`OneNode`) the writer sees every rank of the world: once the last rank has
ended, the step goes to the committer.

Across several nodes (`SeveralNodes`, a *coordinated* step: the ranks say so in their
begin, with the ranks of their node) a writer sees only its own node's ranks. Their data
files go into a node folder of its tmp directory; once every rank of the node has
ended, the writer writes the node's part file there, moves the folder into the save's
shared tmp directory (one rename on each node, in parallel: shared.py), and tells the
node's lead rank (its first), which announces the node to the others through the job's
store (coordination.py). When every node has announced, the leader rank asks its writer
to commit (`commit_nodes`), and that writer commits the shared directory: one listing,
the root manifest that lists the parts, one rename (a node whose folder is elsewhere, a
begin that named no shared directory, is moved in as before: one rename for it). The
node's lead learns the outcome through the store and tells its writer (`outcome`), which
passes it on to the node's other ranks and then removes its emptied tmp directory; on a
failure, the leader's writer removes the shared directory (a node never takes its folder
back out of it: the leader may be committing it). The other ranks never touch the store
unless something fails on their node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncckpt.errors import CheckpointError, SaveFailedError
from asyncckpt.format.layout import step_dir_name
from asyncckpt.format.records import RankPart
from asyncckpt.ipc.messages import NodePart, NodeRanks
from asyncckpt.runtime import faults
from asyncckpt.writer import commit, shared
from asyncckpt.writer.committer import release, sweep_dead
from asyncckpt.writer.step import Notify, Step

if TYPE_CHECKING:
    from asyncckpt.writer.steps import Steps

# durable(tmp dir name, part entry): tells a node's lead rank its node's part is durable
Durable = Callable[[str, dict], None]


@dataclass(frozen=True)
class Announce:
    """How a node's lead is told its node's part is durable (`tell`), and the save's
    shared tmp directory its begin named (None: the node's folder stays in its own)."""

    tell: Durable
    shared: str | None

    def __call__(self, tmp: str, entry: dict) -> None:
        self.tell(tmp, entry)


@dataclass(frozen=True)
class NodeJoin:
    """A rank's begin of a coordinated step: the ranks of its node, how the node's lead
    is told once the node's part is durable, and the save's shared tmp directory
    (`shared.shared_name`; None: none, as an older client's begin)."""

    node: NodeRanks
    durable: Durable
    shared: str | None = None

    def __post_init__(self) -> None:
        if self.shared is not None:  # the step table keeps `durable`: the name rides on it
            object.__setattr__(self, "durable", Announce(self.durable, self.shared))


class OneNode:
    """This writer sees every rank of the world: the last rank's end commits the step."""

    def __init__(self, steps: Steps) -> None:
        self._steps = steps

    def ended(self, current: Step, part: RankPart) -> None:
        """`part` was recorded: once the world's parts are all in, queue the commit."""
        steps = self._steps
        with steps.lock:
            if (steps.open.get(current.number) is not current
                    or len(current.parts) < current.world_size):
                return
            del steps.open[current.number]
            steps.committing[current.number] = current
        steps.committer.submit(current)

    @staticmethod
    def expected(current: Step) -> list[tuple[int, int]]:
        """The ranks (first, count) that must begin `current`: the whole world."""
        return [(0, current.world_size)]


class SeveralNodes:
    """Coordinated steps: this writer makes its nodes' parts durable, the leader's
    writer commits, the node's lead relays the outcome (the module docstring)."""

    def __init__(self, steps: Steps) -> None:
        self._steps = steps
        self._relaying: dict[int, Step] = {}  # leader: committed or not, its outcome to relay
        self._placed: dict[tuple[int, int], str] = {}  # (step, node) -> where its folder is

    def ended(self, current: Step, part: RankPart) -> None:
        """Once every rank of `part`'s node has ended: write the node's part file beside
        their data, then tell the node's lead rank its tmp dir and part."""
        steps = self._steps
        first = current.node_of[part.rank]
        count = current.nodes_here[first]
        with steps.lock:
            if (first in current.durable_nodes or steps.open.get(current.number) is not current
                    or any(r not in current.parts for r in range(first, first + count))):
                return
            current.durable_nodes.add(first)
        tell = current.durable[first]
        try:
            entry = commit.write_node_part(steps.storage, current.tmp_dir, current.number,
                                           [current.parts[r] for r in range(first, first + count)])
            where = commit.place_node(steps.storage, current.tmp_dir, current.number, entry,
                                      _shared_of(tell))
            with steps.lock:
                for key in [k for k in self._placed if k[0] not in steps.open
                            and k[0] not in steps.committing]:
                    del self._placed[key]  # steps failed through the table
                self._placed[(current.number, first)] = where
            faults.point("part_written")
        except Exception as e:
            steps.fail(current.number, commit.io_error(e, step=current.number, rank=part.rank)
                       if isinstance(e, OSError) else e if isinstance(e, SaveFailedError)
                       else SaveFailedError(
                           f"node part not written: {type(e).__name__}: {e}",
                           step=current.number, rank=part.rank))
            return
        tell(where, entry)

    @staticmethod
    def expected(current: Step) -> list[tuple[int, int]]:
        """The ranks (first, count) that must begin `current`: its nodes' here."""
        return list(current.nodes_here.items())

    def commit_nodes(self, step: int, world_size: int, nodes: tuple[NodePart, ...],
                     requester: Notify) -> None:
        """Commit coordinated `step` from the parts every node announced (the leader's
        writer, asked by the leader rank); `requester` hears the result."""
        steps = self._steps
        refused = ("cannot commit: this writer has no such coordinated step open with its "
                   "node's part durable")
        with steps.lock:
            current = steps.open.get(step)
            lead = next((n.tmp for n in nodes if n.first == 0), None)
            placed = self._placed.get((step, 0))
            if (current is None or not current.coordinated or current.world_size != world_size
                    or current.durable_nodes != set(current.nodes_here)):
                current = None
            elif lead != placed and (shared.is_shared(placed or "")
                                     or shared.is_shared(lead or "")):
                # the commit is made from the leader's node's shared directory: the one
                # this writer put its folder in, whatever the store says
                refused = (f"cannot commit: the leader's node announced {lead!r:.80}, but "
                           f"this writer put its part in {placed!r}")
                current = None
            else:
                del steps.open[step]
                steps.committing[step] = self._relaying[step] = current
                current.nodes, current.requester = nodes, requester
        if current is None:
            requester(SaveFailedError(refused, step=step), None, {})
            return
        steps.committer.submit(current)

    def outcome(self, step: int, error: CheckpointError | None, sender: int) -> None:
        """How coordinated `step` ended, as rank `sender` of this node learned it through
        the store: the node's other ranks hear it, then the step is forgotten, its files
        discarded if it failed (if it committed, the leader took them)."""
        steps = self._steps
        with steps.lock:
            current = self._relaying.pop(step, None)
            if current is None:
                current = steps.open.get(step)
                if current is None or not current.coordinated:
                    return
                del steps.open[step]
            committing = step in steps.committing  # its files are the committer's
            placed = {self._placed.pop((step, first), None) for first in current.nodes_here}
            steps.idle.notify_all()
        path = None if error else steps.storage.root / step_dir_name(step)
        for rank, notify in current.waiting.items():
            if rank != sender:
                notify(error, path, current.stats.get(rank, {}), relayed=True)
        release(step, steps.index)
        if error is None:  # its folder was moved out: its emptied tmp dir (and shared
            # directory, if the leader took its folder from there)
            commit.drop_own_tmp(steps.storage, step, current.tmp_dir,
                                {p for p in placed if p is not None})
        elif not committing:  # and what dead writers left (several nodes)
            steps.storage.discard(current.tmp_dir)
            if 0 in current.nodes_here:  # the leader's writer: the save's shared directory
                name = _shared_of(current.durable.get(0))
                if name is not None:
                    shared.drop(steps.storage, step, name)
            sweep_dead(steps.storage)

    def orphaned_by(self, rank: int) -> list[Step]:
        """The coordinated steps whose node `rank` led and had made durable: another
        rank of the node must learn their outcome in its place. Under the lock."""
        return [s for s in [*self._steps.open.values(), *self._relaying.values()]
                if rank in s.durable_nodes]

    def drop_unheard(self, failing: set[int]) -> None:
        """Forget coordinated steps (other than `failing`) none of whose ranks is
        connected: no rank is left to hear the outcome; the files stay for the leader
        (swept later if it never comes). Under the lock."""
        steps = self._steps
        for s in [s for s in steps.open.values() if s.coordinated and s.number not in failing
                  and not any(steps.live.get(r, 0) > 0 for r in s.waiting)]:
            del steps.open[s.number]
            for first in s.nodes_here:
                self._placed.pop((s.number, first), None)
            release(s.number, steps.index)
            steps.idle.notify_all()


def _shared_of(tell: Durable | None) -> str | None:
    """The shared tmp directory a node's begin named (`Announce`), if any."""
    return tell.shared if isinstance(tell, Announce) else None
