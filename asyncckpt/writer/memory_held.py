"""The generations a writer's memory tier holds, as the rest of the writer reads them:
listed (`memory_list`, a partner's LIST), opened for a restore or a flush, sent to the
partner or served to a replacement, and their memory counted.

The base of `MemoryTier` (memory_tier.py), which decides how generations come (ranks'
saves, partners' replicas) and go, under the same lock; kept apart so that each module
holds one job.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from asyncckpt.format.records import RankPart
from asyncckpt.writer.memory_generation import Generation
from asyncckpt.writer.memory_image import RankImage


class Held:
    """The generations held, by step, and the spare images kept to refill (every
    method takes the lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gens: dict[int, Generation] = {}
        self._spare: list[RankImage] = []  # whole images of dropped generations, to refill

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held()

    def _held(self) -> int:
        return sum(g.bytes for g in self._gens.values()) + sum(i.size for i in self._spare)

    def outgoing(self, step: int | None, node: int | None = None, hold: bool = False
                 ) -> tuple[Generation, list[RankPart], list[int]]:
        """The whole images of generation `step` (None: the newest that holds them) of
        the node whose first rank is `node` -- this writer's own or a replica it holds
        -- or, with `node` None, of this writer's own nodes (what is sent to the
        partner): their entries and read-only descriptors (the caller closes them).
        With `hold`, the generation counts as being sent (never dropped to make room,
        memory_tier.py `_admit`) until `released(gen)`.

        Raises:
            KeyError: no such generation, or those images are not held whole.
        """
        with self._lock:
            def ranks(gen: Generation) -> list[int]:
                if node is not None:
                    count = gen.nodes.get(node, 0)
                    return list(range(node, node + count))
                return sorted(r for r in gen.images if not any(
                    f <= r < f + gen.nodes[f] for f in gen.replicas))

            def whole(gen: Generation) -> bool:
                wanted = ranks(gen)
                return bool(wanted) and all(
                    r in gen.images and gen.images[r].whole for r in wanted)
            if step is None:
                step = max((s for s, g in self._gens.items() if whole(g)), default=-1)
            gen = self._gens[step]
            if not whole(gen):
                raise KeyError(step)
            images = [gen.images[r] for r in ranks(gen)]
            out = gen, [i.part() for i in images], [i.read_only() for i in images]
            gen.out += hold
            return out

    def released(self, gen: Generation) -> None:
        """An `outgoing(hold=True)` of `gen` is sent (or failed): its descriptors closed."""
        with self._lock:
            gen.out -= 1

    def allocated_bytes(self) -> int:
        """The memory the tier's images hold now, by their memfds' pages (what the
        kernel allocated; `held_bytes` is their sizes), spares included."""
        with self._lock:
            images = [i for g in self._gens.values() for i in g.images.values()]
            fds = [i.fd for i in images + self._spare if i.fd >= 0]
            return sum(os.fstat(fd).st_blocks * 512 for fd in fds)

    def generations(self) -> list[dict[str, Any]]:
        """Every generation held, oldest first (`describe`)."""
        with self._lock:
            return [self._gens[s].describe() for s in sorted(self._gens)]

    def newest_complete(self) -> int | None:
        """The newest whole generation of which every rank of its world is held here."""
        with self._lock:
            return max((s for s, g in self._gens.items() if g.whole
                        and sorted(g.images) == list(range(g.world_size))), default=None)

    def open(self, step: int, ranks: list[int] | None = None
             ) -> tuple[Generation, list[RankPart], list[int]]:
        """The whole images of generation `step` (of `ranks`, default every whole one):
        their manifest entries and a read-only descriptor each (the caller closes them).

        Raises:
            KeyError: no such generation, or a rank asked for is not held whole.
        """
        with self._lock:
            gen = self._gens[step]
            wanted = sorted(r for r, i in gen.images.items() if i.whole) if ranks is None \
                else ranks
            images = [gen.images[r] for r in wanted]
            if not all(i.whole for i in images):
                raise KeyError(step)
            return gen, [i.part() for i in images], [i.read_only() for i in images]

    def close(self) -> None:
        with self._lock:
            for gen in self._gens.values():
                gen.close()
            self._gens.clear()
            for image in self._spare:
                image.close()
            self._spare.clear()
