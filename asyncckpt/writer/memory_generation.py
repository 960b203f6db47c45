"""A memory generation (one step held by a writer) and the rule that bounds how many.

Kept apart from the tier's bookkeeping (memory_tier.py: locking, the images' lives, the
ranks' replies) because the bound is a rule of its own, and the one whose reasoning
matters: how many generations of a node a writer may hold without losing the crash
guarantee, docs/MEMORY_TIER.md "Bounds".
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from asyncckpt.writer.memory_commit import JobCommit
from asyncckpt.writer.memory_image import RankImage


def physical_memory() -> int:
    """Bytes of physical memory of this host."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class Generation:
    """One step held in memory: its ranks here, grouped by node (first rank, count)."""

    step: int
    world_size: int
    timeline: Any  # the TimelineStart (JSON) the ranks carried, or None
    nodes: dict[int, int] = field(default_factory=dict)
    images: dict[int, RankImage] = field(default_factory=dict)
    waiting: dict[int, Any] = field(default_factory=dict)  # rank: notify (memory_tier)
    replicas: set[int] = field(default_factory=set)  # nodes held as a partner's replica
    started: float = field(default_factory=time.monotonic)  # when its first rank began
    out: int = 0  # its images being sent (to the partner, or served to a replacement)
    sending: dict[int, int] = field(default_factory=dict)  # rank: its image's sends under way
    received: bool = False  # holds a partner's replica received whole (memory_commit.py)

    @property
    def busy(self) -> bool:
        """Some of it is still arriving (a rank staging, a replica in flight) or is
        being sent: dropping it now would lose that work, or leave its memory held by
        the sender's descriptors, outside the count."""
        return bool(self.out) or not all(i.whole for i in self.images.values()) or any(
            r not in self.images for f, c in self.nodes.items() for r in range(f, f + c))

    @property
    def whole(self) -> bool:
        """Every rank of every node that began it has ended."""
        return bool(self.nodes) and all(
            r in self.images and self.images[r].whole
            for first, count in self.nodes.items() for r in range(first, first + count))

    @property
    def bytes(self) -> int:
        return sum(i.size for i in self.images.values())

    def describe(self) -> dict[str, Any]:
        """What `memory_list` tells about it (`nodes`: [first rank, count] of each node
        it holds, own and replicas: what a `memory_fetch` names)."""
        return {"step": self.step, "world_size": self.world_size, "timeline": self.timeline,
                "ranks": sorted(r for r, i in self.images.items() if i.whole),
                "whole": self.whole, "bytes": self.bytes,
                "replicas": sorted([f, self.nodes[f]] for f in self.replicas),
                "nodes": sorted([f, c] for f, c in self.nodes.items())}

    def close(self) -> None:
        for image in self.images.values():
            image.close()



def room(gens: dict[int, Generation], first: int, step: int,
         job: JobCommit | None = None, leaving: list[Generation] | None = None
         ) -> tuple[str | None, int | None]:
    """Whether node `first`'s images of `step` may be held beside `gens` (this node's
    ranks beginning it, or a partner's replica arriving): (None, None) yes; (None, s)
    once generation `s` is dropped (then ask again); (cause, None) no.

    The bound: at most two generations hold a node's images. Two are what the crash
    guarantee needs -- the newest held for every node (the one a lost node's replacement
    resumes at) and a newer one being made -- and they are enough: a third, newer, takes
    the place of the newer one when that one is idle (whole, its partner's part never
    came: it can never be held for every node before the third is); while it is busy
    (still arriving, or being sent) the third is not taken. The older one is never
    dropped here: only a newer whole generation holding every node it holds drops it.

    With the job-wide commit on (`job`, memory_commit.py) the older one is the newest
    committed across the job, or one that can never be (`doomed`: dropped first, when
    idle); the newer one gives way only while it is not promised -- reported held in
    two places, or holding a partner's replica, while it can still be committed: then
    the third is not taken until the job commits it or some node settles it as not.

    `leaving`: generations dropped while being sent, whose images stay held until the
    send ends (memory_tier.py `_drop`): one that still holds node `first`'s images
    counts as one of its two, and cannot be dropped to make room -- without it, a
    generation superseded mid-send would leave its bytes alive in the sender's
    descriptors beside two newer ones of the node, 5 x the shard on a 2-node ring."""
    held = sorted(s for s, g in gens.items() if s != step and first in g.nodes)
    going = sorted(g.step for g in leaving or () if any(
        r in g.images for r in range(first, first + g.nodes.get(first, 0))))
    if going and len(held) + len(going) >= 2:
        return (f"node {first} is held at steps {held} and its step {going[0]} was dropped "
                "while being sent: its images stay held until the send ends (the host "
                "memory bound: two generations of each node)"), None
    if len(held) < 2:
        return None, None
    older, newer = held[-2], gens[held[-1]]
    if newer.step > step:
        return f"node {first} is held at steps {older} and {newer.step}, past {step}", None
    if job is not None and job.on:
        old = gens[older]
        if not old.busy and job.doomed(older):
            return None, older
    if newer.busy:
        return (f"node {first} is held at steps {older} and {newer.step}, and {newer.step} "
                "is still arriving or being sent (the host memory bound: two generations "
                "of each node)"), None
    if job is not None and job.on and job.promised(newer.step, newer.received):
        return (f"node {first} is held at steps {older} and {newer.step}, and {newer.step} "
                "is held in two places but not yet committed across the job (the host "
                "memory bound: two generations of each node)"), None
    return None, newer.step
