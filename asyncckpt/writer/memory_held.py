"""The generations a writer's memory tier holds, as the rest of the writer reads them:
listed (`memory_list`, a partner's LIST), opened for a restore or a flush, sent to the
partner or served to a replacement, and their memory counted. Beside them, the images
fetched from other writers for a restore (memory_fetch.py): held apart from the
generations (never listed, sent, flushed, nor counted as a node's generation by the
bound of two), counted against `memory_max_bytes`, and let go at the next save. And
the generations dropped while being sent (`_leaving`): never listed, their sealed
images held and counted until the send ends.

The base of `MemoryTier` (memory_tier.py), which decides how generations come (ranks'
saves, partners' replicas) and go, under the same lock; kept apart so that each module
holds one job.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from asyncckpt.errors import SaveFailedError
from asyncckpt.format.records import RankPart
from asyncckpt.ipc.messages import NodeRanks, TensorEntry
from asyncckpt.writer.memory_generation import Generation
from asyncckpt.writer.memory_image import RankImage

Opened = tuple[Generation, list[RankPart], list[int]]  # a generation, entries, descriptors


class Held:
    """The generations held, by step, and the spare images kept to refill (every
    method takes the lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gens: dict[int, Generation] = {}
        self._spare: list[RankImage] = []  # whole images of dropped generations, to refill
        self._fetched: dict[int, Generation] = {}  # fetched for a restore, by step
        # generations dropped while being sent (`out`): their sealed images, whose memory
        # the sender's descriptors keep alive, held and counted until the send ends
        self._leaving: list[Generation] = []

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held()

    def _held(self) -> int:
        return (sum(g.bytes for g in self._gens.values()) + sum(i.size for i in self._spare)
                + sum(g.bytes for g in self._fetched.values())
                + sum(g.bytes for g in self._leaving))

    def _image(self, step: int, rank: int, table: list[TensorEntry], tree: Any,
               max_frame: int) -> RankImage:
        """A new image within `memory_max_bytes` (memory_tier.py). Under the lock."""
        raise NotImplementedError

    def _images(self, step: int, parts: list[RankPart], max_frame: int) -> list[RankImage]:
        """New images for `parts` (`_image` each), all or none: those made are closed
        when one fails. Under the lock."""
        images: list[RankImage] = []
        try:
            for part in parts:
                table = [(t.name, t.dtype, tuple(t.shape)) for t in part.tensors]
                images.append(self._image(step, part.rank, table, part.tree, max_frame))
        except BaseException:
            for image in images:
                image.close()
            raise
        return images

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
            if hold:
                gen.out += 1
                for r in ranks(gen):
                    gen.sending[r] = gen.sending.get(r, 0) + 1
            return out

    def released(self, gen: Generation, ranks: list[int]) -> None:
        """An `outgoing(hold=True)` of `ranks`' images of `gen` is sent (or failed): its
        descriptors closed. A generation dropped meanwhile (`_leaving`) frees each image
        once no send of it is left, and leaves once none is."""
        with self._lock:
            gen.out -= 1
            for r in ranks:
                gen.sending[r] = gen.sending.get(r, 0) - 1
                if gen.sending[r] <= 0:
                    del gen.sending[r]
            if not any(g is gen for g in self._leaving):
                return
            for r in [r for r in gen.images if r not in gen.sending]:
                gen.images.pop(r).close()
            if gen.out <= 0:
                self._leaving = [g for g in self._leaving if g is not gen]
                gen.close()

    def allocated_bytes(self) -> int:
        """The memory the tier's images hold now, by their memfds' pages (what the
        kernel allocated; `held_bytes` is their sizes), spares included."""
        with self._lock:
            images = [i for g in [*self._gens.values(), *self._fetched.values(),
                                  *self._leaving] for i in g.images.values()]
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

    def open_node(self, step: int, node: int) -> Opened | None:
        """The whole images of node `node` (its first rank) of generation `step` held
        here -- in a generation of this writer's, own or a replica, or fetched for a
        restore -- with a read-only descriptor each (the caller closes them); None when
        they are not all held whole here."""
        with self._lock:
            for gen in (self._gens.get(step), self._fetched.get(step)):
                count = None if gen is None else gen.nodes.get(node)
                if gen is None or count is None:
                    continue
                images = [gen.images.get(r) for r in range(node, node + count)]
                if all(i is not None and i.whole for i in images):
                    held = [i for i in images if i is not None]
                    return gen, [i.part() for i in held], [i.read_only() for i in held]
            return None

    def receive_fetched(self, step: int, world_size: int, timeline: Any, node: NodeRanks,
                        parts: list[RankPart], max_frame: int) -> list[RankImage]:
        """Images for node `node`'s ranks of generation `step`, fetched from another
        writer for a restore (memory_fetch.py), in `parts`' order, each holding its
        header; the caller fills them and calls `fetched_whole` (or `discard_fetched`).
        What an earlier restore fetched of another step goes first.

        Raises:
            MemoryTierFullError: they would take the memory held past `memory_max_bytes`.
            SaveFailedError: the world disagrees with what was fetched of the step, or
                the node overlaps a node fetched.
        """
        first, count = node
        with self._lock:
            self._drop_fetched(keep=step)
            gen = self._fetched.get(step)
            if gen is None:
                gen = Generation(step, world_size, timeline)
            if gen.world_size != world_size or any(
                    f < first + count and first < f + c for f, c in gen.nodes.items()):
                raise SaveFailedError(f"fetched node {[first, count]} of world {world_size} "
                                      f"does not fit what was fetched of the step: world "
                                      f"{gen.world_size}, nodes {sorted(gen.nodes.items())}",
                                      step=step, rank=first)
            images = self._images(step, parts, max_frame)
            gen.nodes[first] = count
            gen.images.update((i.rank, i) for i in images)
            self._fetched[step] = gen
            return images

    def fetched_whole(self, step: int, images: list[RankImage]) -> bool:
        """Fetched images checked whole: they can be opened from now on. False when
        they were let go meanwhile (then freed)."""
        with self._lock:
            return complete(self._fetched.get(step), images)

    def discard_fetched(self, step: int, node: NodeRanks, images: list[RankImage]) -> None:
        """A fetch that failed: its images are freed and forgotten."""
        with self._lock:
            gen = self._fetched.get(step)
            if gen is not None and gen.nodes.get(node[0]) == node[1]:
                del gen.nodes[node[0]]
                for image in images:
                    if gen.images.get(image.rank) is image:
                        del gen.images[image.rank]
                if not gen.nodes:
                    del self._fetched[step]
            for image in images:
                image.close()

    def _drop_fetched(self, keep: int | None = None) -> None:
        """Let go of what was fetched for a restore (but step `keep`'s). Under the lock.
        A descriptor already handed to a reader keeps its image's memory until closed."""
        for step in [s for s in self._fetched if s != keep]:
            self._fetched.pop(step).close()

    def close(self) -> None:
        with self._lock:
            for gen in [*self._gens.values(), *self._fetched.values(), *self._leaving]:
                gen.close()
            self._gens.clear()
            self._fetched.clear()
            self._leaving.clear()
            for image in self._spare:
                image.close()
            self._spare.clear()


def complete(gen: Generation | None, images: list[RankImage]) -> bool:
    """Images written whole into `gen`, under the tier's lock: they count from now on.
    False, and the images freed, when `gen` is gone or holds other images of those
    ranks (it was dropped or let go while they were written)."""
    if gen is None or any(gen.images.get(i.rank) is not i for i in images):
        for image in images:
            image.close()
        return False
    for image in images:
        image.complete()
    return True
