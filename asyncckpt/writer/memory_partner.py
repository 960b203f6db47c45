"""A partner writer's nodes held in this tier: its replicas taken in, counted, forgotten.

Each writer keeps a copy of its partner's newest generations (memory_replicator.py
sends them, memory_replica.py checks them on arrival), so a node lost leaves its
ranks' images on another node. A replica takes its place in the generation of its
step beside this node's own images, under the same bound (two generations of each
node, `memory_max_bytes`) and the same rules: a step this node skipped takes no
replica, nor one of another world or overlapping a node held; it counts only once
every byte arrived (`received`), and a failed one leaves the rest of its generation
as it was (`discard`). A partner's newer save of a step replaces its older replica
(`_forget_replicas`).

Kept apart from memory_tier.py, which holds the generations and applies the bound:
this is only how a partner's part of a generation comes and goes.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from asyncckpt.errors import MemoryTierFullError, SaveFailedError
from asyncckpt.format.records import RankPart
from asyncckpt.ipc.messages import NodeRanks
from asyncckpt.writer.memory_generation import Generation
from asyncckpt.writer.memory_held import complete
from asyncckpt.writer.memory_image import RankImage

if TYPE_CHECKING:
    from asyncckpt.writer.memory_order import BeginOrder


class PartnerNodes:
    """The memory tier's partner replicas (a base of memory_tier.MemoryTier, which owns
    these attributes and methods; thread-safe: the replica server calls it)."""

    _lock: threading.Lock
    _gens: dict[int, Generation]
    _order: BeginOrder
    peak_bytes: int

    if TYPE_CHECKING:  # MemoryTier's and Held's own (a stub here would hide Held's)
        def _prune(self) -> None: ...
        def _admit(self, first: int, step: int) -> str | None: ...
        def _settle(self, gen: Generation) -> None: ...
        def _drop(self, step: int, error: SaveFailedError) -> None: ...
        def _held(self) -> int: ...
        def _images(self, step: int, parts: list[RankPart],
                    max_frame: int) -> list[RankImage]: ...

    def receive(self, step: int, world_size: int, timeline: Any, node: NodeRanks,
                parts: list[RankPart], max_frame: int) -> list[RankImage]:
        """Images for a partner writer's node `node` of generation `step` (a replica,
        memory_replica.py), in `parts`' order, each holding its header; the caller fills
        them and calls `received` (or `discard`).

        Raises:
            MemoryTierFullError: they would take the memory held past the bound.
            SaveFailedError: the generation disagrees (world, an overlapping node, a
                node already held here).
        """
        first, count = node
        with self._lock:
            gen = self._gens.get(step)
            if gen is not None and first in gen.replicas:  # the partner's newer save of it
                self._forget_replicas(gen, first)
            self._prune()
            skipped = self._order.skip_cause(step)
            cause = (f"this node's step {step} was skipped: {skipped}" if skipped is not None
                     else self._admit(first, step))
            if cause is not None:
                raise MemoryTierFullError(f"memory tier: replica of node {[first, count]} of "
                                          f"step {step} not taken: {cause}", step=step,
                                          rank=first)
            gen = self._gens.get(step)
            if gen is None:
                gen = Generation(step, world_size, timeline)
            if gen.world_size != world_size:
                raise SaveFailedError(f"replica of world {world_size}, the generation here "
                                      f"is of world {gen.world_size}", step=step, rank=first)
            if any(f < first + count and first < f + c for f, c in gen.nodes.items()):
                raise SaveFailedError(f"replica of node {[first, count]} overlaps a node held "
                                      f"here, {sorted(gen.nodes.items())}", step=step,
                                      rank=first)
            images = self._images(step, parts, max_frame)
            gen.nodes[first] = count
            gen.images.update((i.rank, i) for i in images)
            gen.replicas.add(first)
            self._gens[step] = gen
            self.peak_bytes = max(self.peak_bytes, self._held())
            return images

    def received(self, step: int, images: list[RankImage]) -> bool:
        """A replica's images are whole (checked by the caller): they count from now on.
        False when the generation was dropped meanwhile (they are then freed)."""
        with self._lock:
            gen = self._gens.get(step)
            if not complete(gen, images):
                return False
            assert gen is not None  # complete() says so
            gen.received = True
            self._settle(gen)
            return True

    def discard(self, step: int, node: NodeRanks, images: list[RankImage]) -> None:
        """A replica that failed: its node and images are forgotten, the rest stays."""
        with self._lock:
            gen = self._gens.get(step)
            if gen is not None and gen.nodes.get(node[0]) == node[1]:
                del gen.nodes[node[0]]
                gen.replicas.discard(node[0])
                for image in images:
                    if gen.images.get(image.rank) is image:
                        del gen.images[image.rank]
                if not gen.images:
                    del self._gens[step]
            for image in images:
                image.close()

    def _forget_replicas(self, gen: Generation, first: int | None = None) -> None:
        """Drop the partners' replicas held in `gen` (of the node whose first rank is
        `first`, default all); the generation goes if nothing of it is left."""
        for node in [f for f in gen.replicas if first is None or f == first]:
            for rank in range(node, node + gen.nodes.pop(node)):
                image = gen.images.pop(rank, None)
                if image is not None:
                    image.close()
            gen.replicas.discard(node)
        if not gen.images:
            self._drop(gen.step, SaveFailedError("memory generation of an abandoned run",
                                                 step=gen.step))
