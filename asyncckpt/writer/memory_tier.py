"""The memory tier: the newest generations of this node's ranks, held in host memory.

A memory save (`Client.save(..., tier="memory")`) reaches the writer exactly as a
durable one does -- begin, chunks through the rank's ring, end -- so the rank's cost is
the staging copy and nothing more. Instead of encoding and writing the chunks, the
writer copies each one from the ring into the rank's image: one anonymous memory file
(memfd) per rank and generation, laid out as the rank's raw safetensors stream (header,
then tensor bytes), with the xxh3 of every frame. A generation (a step) is whole on this
node once every rank of the node's ranks that began it has ended; those ranks then
hear `committed` with `tier` "memory".

Why memfds: they are host memory that dies with the writer (no segment outlives its
process: a node lost is its memory lost, nothing to sweep), and one can be handed to a
rank as a descriptor, so a restore reads its bytes in place (read/ verifies every frame
as from disk) with no copy through a socket. A whole image is sealed against writes
before anyone but the writer sees it, so a rank it is handed to cannot change it.

Held (the bound, docs/MEMORY_TIER.md "Bounds"): at most two generations of each node,
its own or a partner's replica -- the newest held for every node (the one a lost node's
replacement resumes at) and one newer being made. An older generation is dropped only
once a newer whole one holds every node it holds (once a lead told it the job's word,
memory_commit.py: only once a newer one is committed across the job); a third
generation of a node takes the newer one's place when that one is idle (whole, its
partner's part never came; with the job's word: and not promised -- a promise holds
saves back for at most SILENT_S of silence, memory_commit.py), and is not taken
while it is busy (still arriving, or being sent): a rank's save of it is then
skipped (`stats.tier` "skipped", nothing held: `_admit`), a replica refused. Dropped
images are kept to be refilled by the next image of their size, and freed before any
other is made, so they never add to the peak; a generation dropped while it is being
sent keeps its sealed images, held and counted, until the send ends (the sender's
descriptors keep their memory anyway), as one of its node's two. With a partner of the
same size, host memory is at most 4 x the node's shard at any instant (2 x own, 2 x the
partner's), and 4 x less a chunk is the least that keeps the crash guarantee
(docs/MEMORY_TIER.md "Why not 3 x"); every byte is also counted against
`memory_max_bytes` (knob): a begin past it is refused with MemoryTierFullError naming
the figures.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from asyncckpt.errors import MemoryTierFullError, SaveFailedError
from asyncckpt.format.layout import layout
from asyncckpt.format.records import RankPart
from asyncckpt.ipc.messages import NodeRanks, TensorEntry
from asyncckpt.writer.memory_commit import Committing, JobCommit
from asyncckpt.writer.memory_generation import Generation, physical_memory, room
from asyncckpt.writer.memory_held import Held, Opened, complete
from asyncckpt.writer.memory_image import RankImage, SkippedImage
from asyncckpt.writer.memory_order import BeginOrder, DurableSaves

log = logging.getLogger("asyncckpt.writer")

TIER = "memory"
SKIPPED = "skipped"  # `stats.tier` of a memory save not held (the bound, `_admit`)
DROPPED_KEPT = 8  # generations whose reason for being dropped is remembered
# notify(error or None, path or None, stats): reaches one rank's client (session.py)
Notify = Callable[..., None]


class MemoryTier(Committing, Held):
    """The generations this writer holds (thread-safe: the sessions call it): how
    they come (ranks' saves, partners' replicas) and go; how they are read, Held."""

    def __init__(self, max_bytes: int, root: str) -> None:
        """Args:
            max_bytes: the bound on every image held together (0: half the host's
                physical memory).
            root: the durable root, named in the `committed` replies and the listing.
        """
        super().__init__()
        self.max_bytes = max_bytes or physical_memory() // 2
        self.root = root
        # why the newest dropped generations went, for a rank whose end comes after
        self._dropped: dict[int, SaveFailedError] = {}
        self.on_node_whole: Callable[[int], None] | None = None  # step: this node's ranks whole
        # set by the replicator (memory_replicator.py): its replica server ("host:port"),
        # and fetch(step, node, source) -> Opened, which memory_fetch answers with
        self.replica_address = ""
        self.fetcher: Callable[[int, int, str], Opened] | None = None
        # each rank's last begin, the node's skipped steps (the ranks' begins interleave)
        self._order = BeginOrder()
        self._durable = DurableSaves()  # which ranks are staging a durable save here
        self._world: int | None = None  # the world of this node's ranks' last begin
        self.peak_bytes = 0
        self.job = JobCommit()  # the job-wide commit, once a lead tells (memory_commit.py)
        self._settling = threading.Condition(self._lock)  # an outcome became final

    def begin(self, step: int, rank: int, world_size: int, node: NodeRanks | None,
              table: list[TensorEntry], tree: Any, timeline: Any,
              max_frame: int, launch: str | None = None) -> RankImage:
        """Start `rank`'s image of generation `step`.

        A rank beginning a step it already holds whole (a step saved again) drops that
        generation first. Older generations than the newest whole one are dropped.
        Returns a `SkippedImage` (holds nothing; its rank hears `stats.tier` "skipped")
        when the node's step is past the bound of two generations per node (`_admit`):
        the node's first rank to begin it decides for all, however late the others
        come. A rank beginning a step older than one it began before (or than one of
        its images held, as a replacement's taken back from the partner) is a rerun
        (`_went_back`); a peer's late begin is not (memory_order.py); a first begin in
        another world, or of a step held whole for another (a relaunch, shrunk or
        grown: its ranks numbered anew), is.
        `launch`: the node lead's begin's (memory_commit.py `JobCommit.launched`).

        Raises:
            MemoryTierFullError: the image would take the memory held past the bound.
            SaveFailedError: the rank's world or node disagrees with the generation's,
                or the memory could not be had.
        """
        first, count = node or NodeRanks(rank, 1)
        with self._lock:
            self._drop_fetched()  # a save: the restore they were fetched for is over
            self.job.launched(launch)  # a new launch saving: its rule (pruned below)
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
            skipped = self._order.skipped(step, rank)
            self._order.began(rank, step, skipped is not None)
            if skipped is not None:  # the node's step is skipped
                self._final(step, False)
                return SkippedImage(step, rank, table, tree, skipped)
            gen = self._gens.get(step)
            if gen is not None and rank in gen.images:  # saved again: start it over
                self.job.rerun(step)  # what was known of its first save is not this one's
                self._drop(step, SaveFailedError("the step is being saved again", step=step))
                gen = None
            self._prune()
            gen = self._gens.get(step)  # a partner's replica of it may be gone with _prune
            if gen is None or first not in gen.nodes:
                cause = self._admit(first, step)
                if cause is not None:
                    self._order.skip(step, rank, cause)
                    self._order.began(rank, step, True)
                    self._final(step, False)
                    log.info("memory step %d skipped on this node: %s", step, cause)
                    return SkippedImage(step, rank, table, tree, cause)
            if gen is None:
                gen = Generation(step, world_size, timeline)
            if gen.world_size != world_size:
                raise SaveFailedError(f"memory generation of world {gen.world_size}, this rank "
                                      f"says {world_size}", step=step, rank=rank)
            if gen.nodes.get(first, count) != count or any(
                    f != first and f < first + count and first < f + c
                    for f, c in gen.nodes.items()):
                raise SaveFailedError(f"node {[first, count]} overlaps another node of the "
                                      f"generation, {sorted(gen.nodes.items())}",
                                      step=step, rank=rank)
            image = self._image(step, rank, table, tree, max_frame)
            gen.nodes[first] = count
            gen.images[rank] = image
            self._gens[step] = gen
            self.job.began(step)
            self.peak_bytes = max(self.peak_bytes, self._held())
            return image

    def _image(self, step: int, rank: int, table: list[TensorEntry], tree: Any,
               max_frame: int) -> RankImage:
        """A new image of `rank` for `step` (a spare one refilled when one fits), within
        the bound. Under the lock.

        Raises:
            MemoryTierFullError, SaveFailedError: as `begin`.
        """
        need = layout(table)[1]
        size = need[-1].end if need else 0
        spare = next((i for i in self._spare if i.size == size), None)
        if spare is None:  # spares never add to the peak: each is refilled or freed first
            while self._spare:
                self._spare.pop().close()
        held = self._held()
        if spare is None and held + size > self.max_bytes:
            raise MemoryTierFullError(
                f"memory tier full: rank {rank}'s image of {size} bytes on top of "
                f"{held} bytes held would pass memory_max_bytes={self.max_bytes} "
                "(raise the knob, or save to the durable tier)", step=step, rank=rank)
        try:
            if spare is not None:
                self._spare.remove(spare)
                try:
                    spare.reset(step, rank, table, tree, max_frame)
                except BaseException:
                    spare.close()
                    raise
                image = spare
            else:
                image = RankImage(step, rank, table, tree, max_frame)
        except OSError as e:
            raise SaveFailedError(f"memory tier: no memory for rank {rank}'s image of "
                                  f"{size} bytes: {e.strerror or e}", step=step,
                                  rank=rank) from None
        return image

    def end(self, image: RankImage, notify: Notify, stats: dict[str, Any]) -> None:
        """`image`'s rank ended its save: seal it; once its node's ranks are all whole,
        tell them (committed, tier memory) and drop older generations.

        Raises:
            ValueError: the rank sent fewer bytes than its tensors hold.
        """
        if isinstance(image, SkippedImage):
            image.complete()  # the node's skip was logged once (`begin`)
            notify(None, self.root, {**stats, "tier": SKIPPED, "raw_bytes": 0,
                                      "stored_bytes": 0, "codec": "raw"})
            return
        tell: list[tuple[Notify, dict[str, Any]]] = []
        with self._lock:  # whole and waiting together: the node's last rank tells them all
            gen = self._gens.get(image.step)
            if gen is None or gen.images.get(image.rank) is not image:
                why = self._dropped.get(image.step)
                notify(SaveFailedError(
                    "memory generation dropped while the rank saved it: "
                    f"{why.cause if why is not None else 'a newer one became whole'}",
                    step=image.step, rank=image.rank), None, {})
                return
            image.complete()
            gen.waiting[image.rank] = notify
            figures = {**stats, "tier": TIER, "raw_bytes": gen.bytes,
                       "stored_bytes": 0, "codec": "raw"}
            node_whole = False
            for first, count in gen.nodes.items():
                ranks = range(first, first + count)
                if all(r in gen.images and gen.images[r].whole for r in ranks):
                    node_whole |= any(r in gen.waiting for r in ranks)
                    tell += [(gen.waiting.pop(r), figures) for r in ranks if r in gen.waiting]
            self._settle(gen)
            if node_whole and self.on_node_whole is None:  # no partner: never in two places
                self._final(image.step, False)
        for tell_one, figures in tell:
            tell_one(None, self.root, figures)
        if node_whole and self.on_node_whole is not None:
            self.on_node_whole(image.step)

    def _settle(self, gen: Generation) -> None:
        """Once `gen` is whole (every node's ranks, replicas too), the older ones it
        covers go (`_supersede`; with the job-wide commit on, those older than the
        newest committed step, `_prune`)."""
        if gen.whole:
            if self.job.on:
                self._prune()
            else:
                self._supersede(gen)
            log.info("memory generation %d whole: %d ranks, %.1f MiB; %.1f MiB held",
                     gen.step, len(gen.images), gen.bytes / 2**20, self._held() / 2**20)

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

    def abandon(self, image: RankImage, error: SaveFailedError) -> None:
        """`image`'s rank failed or went before ending: its generation cannot become
        whole; the ranks waiting on it hear `error`."""
        with self._lock:
            gen = self._gens.get(image.step)
            if gen is not None and gen.images.get(image.rank) is image:
                self._drop(image.step, error)

    def rank_gone(self, rank: int) -> None:
        """`rank` has no connection left: a generation in flight that waits for it can
        never become whole; its ranks that ended hear so."""
        with self._lock:
            for step in [s for s, g in self._gens.items() if not g.whole and any(
                    f <= rank < f + c for f, c in g.nodes.items())
                    and not (rank in g.images and g.images[rank].whole)]:
                self._drop(step, SaveFailedError(f"rank {rank} of the node disconnected before "
                                                 "ending its memory save", step=step, rank=rank))

    def durable_began(self, rank: int, step: int) -> None:
        """`rank` began a durable save of `step` on this writer (session.py): until it
        ends it, its memory begins of newer steps wait behind it in its stager, so it is
        not absent from them; from `step` and older ones it is (it has moved past them)."""
        with self._lock:
            self._durable.began(rank, step)

    def durable_ended(self, rank: int) -> None:
        """`rank` ended, aborted or dropped a durable save begun on this writer."""
        with self._lock:
            self._durable.ended(rank)

    def fail_absent(self, timeout: float) -> None:
        """Fail each generation begun over `timeout` s ago of which a rank of one of
        this writer's nodes has not begun its save (connected or not: a rank that skips
        a memory save would otherwise be waited for without end), as durable steps fail
        after `absent_rank_timeout`. Its ranks that ended hear a SaveFailedError naming
        the step, the absent ranks, the ranks that began it and what the first absent
        ones began last; the older whole generation stays held.

        A rank still staging a durable save to this writer is not absent (its memory
        begin waits behind that save in its stager, however slow the save); its
        `timeout` counts from the end of that save."""
        now = time.monotonic()
        with self._lock:
            for step, gen in list(self._gens.items()):
                if gen.whole or now - gen.started < timeout:
                    continue
                own = [r for f, c in gen.nodes.items() if f not in gen.replicas
                       for r in range(f, f + c)]
                absent = [r for r in own if r not in gen.images and (
                    self._durable.past(r, step)
                    or (not self._durable.busy(r)
                        and now - self._durable.waited_since(r, gen.started) >= timeout))]
                if absent:
                    lasts = [self._order.last(r) + self._durable.describe(r) for r in absent[:2]]
                    self._drop(step, SaveFailedError(
                        f"rank{'s' if len(absent) > 1 else ''} {_names(absent)} of the node "
                        f"never began memory step {step} within absent_rank_timeout="
                        f"{timeout:g} s (a rank that skips a memory save its node's peers "
                        f"made); began it: rank {_names([r for r in own if r in gen.images])}"
                        f"; {'; '.join(lasts)}",
                        step=step, rank=absent[0]))

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

    def _admit(self, first: int, step: int) -> str | None:
        """Room for node `first`'s images of `step` (`room`: an idle newer generation
        of the node dropped to make it), or why not. Under the lock."""
        while True:
            cause, drop = room(self._gens, first, step, self.job, self._leaving)
            if (cause is not None and self.job.on
                    and room(self._gens, first, step, None, self._leaving)[0] is None
                    and self._fall_back(first, step, cause)):
                continue  # held back by a promise alone, too long: the node-local rule
            if drop is None:
                return cause
            self._drop(drop, SaveFailedError(
                f"memory generation {drop} gave way to step {step} (it was not held for "
                "every node: the partner's part never came, or it can never be committed "
                "across the job)", step=drop))

    def _prune(self) -> None:
        """Drop every generation that a newer whole one covers (`_supersede`); with the
        job-wide commit on, every one older than the newest step committed across the
        job, once that one is held whole here (a word about a step not held -- a rerun,
        a generation this writer never had -- drops nothing)."""
        if self.job.on:
            committed = self.job.committed
            gen = None if committed is None else self._gens.get(committed)
            if gen is not None and gen.whole:
                for older in [s for s in self._gens if s < gen.step]:
                    self._drop(older, SaveFailedError(
                        f"memory generation superseded by step {gen.step}, committed "
                        "across the job", step=older))
            return
        for step in sorted(self._gens, reverse=True):
            gen = self._gens.get(step)
            if gen is not None and gen.whole:
                self._supersede(gen)

    def _supersede(self, gen: Generation) -> None:
        """Drop each generation older than whole `gen` whose every node `gen` holds too.
        An older one holding a node `gen` lacks -- a partner's replica whose newer one
        has not arrived whole (the partner lost mid-replication, or slow) -- stays, with
        this node's own images of that step: it is the newest step at which both nodes
        are held, the one a replacement of the partner resumes from. One of another
        world (a job shrunk or grown: its nodes numbered otherwise, it would take a slot
        of a new node for ever) goes once `gen` holds this node's own ranks. The step
        committed when a new launch took over stays until that launch's own generation
        covers it (memory_commit.py `JobCommit.keeps`)."""
        covered = set(gen.nodes.items())
        own = any(f not in gen.replicas for f in gen.nodes)
        for older in [s for s, g in self._gens.items() if s < gen.step and (
                set(g.nodes.items()) <= covered or (own and g.world_size != gen.world_size))
                and not self.job.keeps(s, gen.step)]:
            self._drop(older, SaveFailedError(
                f"memory generation superseded by step {gen.step}", step=older))

    def _drop(self, step: int, error: SaveFailedError) -> None:
        """Forget generation `step`: its waiting ranks hear `error`; its whole images
        not handed out are kept to be refilled (bytes still counted), the rest freed --
        but while it is being sent (`out`: to the partner, or served to a replacement)
        the sealed images being sent stay held and counted (`_leaving`) until it ends, since
        the sender's descriptors keep their memory alive anyway (memory_held.py
        `released`); `room` counts them as a generation of their node."""
        gen = self._gens.pop(step)
        if self.job.dropped(step):
            self._settling.notify_all()
        self._dropped[step] = error
        while len(self._dropped) > DROPPED_KEPT:
            del self._dropped[min(self._dropped)]
        for notify in gen.waiting.values():
            notify(error, None, {})
        sending: dict[int, RankImage] = {}  # sealed, while it is being sent: kept till sent
        for rank, image in gen.images.items():
            image.dropped_because = error.cause
            if gen.sending.get(rank) and image.sealed and image.fd >= 0:
                sending[rank] = image
            elif image.whole and not image.sealed and image.fd >= 0:
                self._spare.append(image)
            else:
                image.close()
        if sending:  # their memory lives on in the sender's descriptors: counted, and
            gen.images = sending  # its node's next generation waits (`room`)
            self._leaving.append(gen)



def _names(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
