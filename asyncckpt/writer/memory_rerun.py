"""A job gone back below the steps this writer holds: a rerun, or a relaunch in another world.

A job that resumes from an older step (a rank crashed, the job restarted from the
last committed step) saves the steps it held again; a relaunch after a node loss may
also run in another world (a job shrunk or grown: its nodes and ranks numbered anew,
rank 2 of world 3 becoming rank 1 of world 2). What this writer holds of those steps
belongs to the abandoned run: held beside the rerun's images it would make a generation
of two runs, one of another world would refuse the relaunch's begin ("memory generation
of world 3, this rank says 2"), and the skips its node decided would skip a rank
numbered anew. So at a rank's begin the tier asks whether the job went back
(`_rerun_if_back`), and if so drops the abandoned run's generations and forgets what
the node's begin order, durable saves and commit knew of them (`_went_back`).

Kept apart from memory_tier.py, which holds the generations and applies the bound:
this is only how a rerun is recognised and what it makes the tier forget.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from asyncckpt.errors import SaveFailedError

if TYPE_CHECKING:
    from asyncckpt.writer.memory_commit import JobCommit
    from asyncckpt.writer.memory_generation import Generation
    from asyncckpt.writer.memory_order import BeginOrder, DurableSaves

log = logging.getLogger("asyncckpt.writer")


class Reruns:
    """The memory tier's side of a rerun (a base of memory_tier.MemoryTier, which owns
    these attributes and `_drop`)."""

    _lock: threading.Lock
    _gens: dict[int, Generation]
    _order: BeginOrder
    _durable: DurableSaves
    job: JobCommit
    _world: int | None  # the world of this node's ranks' last begin

    def _drop(self, step: int, error: SaveFailedError) -> None:
        raise NotImplementedError

    def _rerun_if_back(self, step: int, rank: int, world_size: int) -> None:
        """`rank` begins `step` in a world of `world_size` ranks: a rerun if it began a
        newer step before (or one of its images is held in a newer generation, as a
        replacement's taken back from the partner), or if it is the node's first begin
        in another world, or a begin of a step held whole for another (memory_tier.py
        `MemoryTier.begin`). Under the lock."""
        newer = self._order.went_back(rank, step)
        if newer is None:  # (a replacement's: newer ones taken back from a partner)
            newer = min((s for s, g in self._gens.items() if s > step and rank in g.images),
                        default=None)
        if newer is not None:
            self._went_back(step, rank, newer)
        old = self._gens.get(step)
        if self._world not in (None, world_size) or (
                old is not None and old.world_size != world_size and old.whole):
            self._went_back(step, rank, step, world_size)  # a relaunch in another world
        self._world = world_size

    def _went_back(self, step: int, rank: int, newer: int, world: int | None = None) -> None:
        """`rank` began `step`, older than `newer`, which it began before (or of which
        an image of it is held): the job resumed below it. What is held of `step` and
        newer -- this node's images and the partners' replicas -- belongs to the
        abandoned run (a rerun need not compute the same bytes): held beside the
        rerun's images of those steps, it would make a generation of two runs, or a
        newer one that supersedes the rerun's. It goes; the partners' replicas of the
        rerun come as usual. A replacement's writer knows it by the newer generations
        holding its ranks' images it took back from the partner (its ranks never began
        anything here). Only `rank`'s own order says so: a peer's late begin is no
        rerun (memory_order.py). `world`: a relaunch in a world of that size (a job
        shrunk or grown, its ranks numbered anew) began `step`: the other world's
        generations from `step` on go, and what its ranks' order said of them (the
        skips it decided, which a rank numbered anew would take for its node's)."""
        gone = sorted(s for s, g in self._gens.items()
                      if s >= step and (world is None or g.world_size != world))
        how = f"after step {newer}" if world is None else f"in a world of {world} ranks"
        log.info("memory: rank %d began step %d %s: the job went back; generations from "
                 "%d dropped: %s", rank, step, how, step, gone)
        self._order.rerun_from(step)
        self._durable.rerun_from(step)
        self.job.rerun(step)
        for s in gone:
            self._drop(s, SaveFailedError(f"memory generation of an abandoned run (rank "
                                          f"{rank} began step {step} {how})", step=s))
