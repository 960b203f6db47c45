"""One step as a writer assembles it, and the failures its late ranks are to hear.

A `Step` is the record the step table (steps.py) keeps per open step: its tmp directory,
the ranks waiting on it and their parts; for a step coordinated across nodes also the
nodes whose ranks this writer serves, which of them are durable, and who speaks for a
node whose lead rank is gone. The table's lock guards every field.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncckpt.errors import CheckpointError, SaveFailedError
from asyncckpt.format.layout import node_dir_name
from asyncckpt.format.records import RankPart
from asyncckpt.format.timeline import TimelineStart
from asyncckpt.ipc.messages import NodePart, NodeRanks
from asyncckpt.ipc.options import SaveOptions

if TYPE_CHECKING:
    from asyncckpt.storage.paths import Location

# notify(error or None, path or None, stats; relayed=) reaches one rank's client
Notify = Callable[..., None]
_MAX_FAILED_RECORDS = 4096


@dataclass
class Step:
    number: int
    world_size: int
    codec: str
    tmp_dir: Location
    choice: dict[str, Any] | None = None  # codec "auto": what the chooser saw
    started: float = field(default_factory=time.monotonic)
    waiting: dict[int, Notify] = field(default_factory=dict)   # rank -> how to tell it
    parts: dict[int, RankPart] = field(default_factory=dict)
    stats: dict[int, dict] = field(default_factory=dict)
    retention: tuple[int, int] | None = None
    keep_from: int | None = None              # retention deletes no step from this one on
    keep_steps: tuple[int, ...] = ()          # nor these
    replace: bool = False                     # the save asked to replace a committed step
    timeline: TimelineStart | None = None     # the timeline the save begins (timelines.py)
    coordinated: bool = False
    # coordinated: the nodes whose ranks this writer serves, first rank -> count (one in
    # a job; a test may run several nodes' ranks against one writer), those whose part
    # file is written, and each rank's node
    nodes_here: dict[int, int] = field(default_factory=dict)
    durable_nodes: set[int] = field(default_factory=set)
    node_of: dict[int, int] = field(default_factory=dict)
    durable: dict[int, Callable[[str, dict], None]] = field(default_factory=dict)
    nodes: tuple[NodePart, ...] | None = None  # leader: every node's announcement
    requester: Notify | None = None           # leader: the save that asked for the commit

    def take_options(self, options: SaveOptions) -> None:
        """A rank's SaveOptions: a retention, keep_from or keep_steps it names is the
        step's (the last rank to name one wins; ranks normally agree)."""
        if options.retention is not None:
            self.retention = options.retention
        if options.keep_from is not None:
            self.keep_from = options.keep_from
        if options.keep_steps:
            self.keep_steps = options.keep_steps

    def folder(self, rank: int) -> str:
        """Where in the tmp directory `rank`'s files go: its node's folder ("" for a
        local step)."""
        return node_dir_name(self.node_of[rank]) if self.coordinated else ""

    def join_node(self, rank: int, node: NodeRanks) -> bool:
        """Place `rank` in its node (first, count) of this coordinated step; True on the
        node's first rank (its folder is to be made).

        Raises:
            SaveFailedError: the node overlaps another node of the step.
        """
        first, count = node
        new = self.nodes_here.get(first) != count
        if new:
            if first in self.nodes_here or any(
                    f < first + count and first < f + c for f, c in self.nodes_here.items()):
                raise SaveFailedError(f"node {list(node)} (first rank, count) overlaps another "
                                      f"node of the step, {sorted(self.nodes_here.items())}",
                                      step=self.number, rank=rank)
            self.nodes_here[first] = count
        self.node_of[rank] = first
        return new

    def speaker(self, lead: int) -> int | None:
        """Who speaks for `lead`'s node now that `lead` is gone: the node's lowest other
        waiting rank (None if `lead` led no node here)."""
        if self.node_of.get(lead) != lead:
            return None
        return min((r for r in self.waiting if self.node_of.get(r) == lead and r != lead),
                   default=None)


class FailedSteps:
    """Failed steps that some connected ranks have not begun yet: each such rank hears
    the step's error at its begin, once. Bounded; not thread-safe (the table's lock)."""

    def __init__(self) -> None:
        self._records: dict[int, tuple[CheckpointError, set[int]]] = {}

    def note(self, step: int, error: CheckpointError, pending: set[int]) -> None:
        """Remember that ranks `pending` are still to hear that `step` failed."""
        if not pending:
            return
        if len(self._records) >= _MAX_FAILED_RECORDS:
            self._records.pop(next(iter(self._records)))
        self._records[step] = (error, pending)

    def claim(self, step: int, rank: int) -> CheckpointError | None:
        """The error `rank` is to hear at its begin of `step` (then forgotten for it)."""
        record = self._records.get(step)
        if record is None or rank not in record[1]:
            return None
        record[1].discard(rank)
        if not record[1]:
            del self._records[step]
        return record[0]

    def forget_rank(self, rank: int) -> None:
        """`rank` has no connection left: it is a new process when it comes back."""
        for _, pending in self._records.values():
            pending.discard(rank)
