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

Apart: the job-wide commit (memory_commit.py), a rerun or a relaunch in another world
(memory_rerun.py), ranks given up on (memory_absent.py), a partner's replicas taken in
(memory_partner.py), the generations as read and sent (memory_held.py); this module
holds the generations and applies the bound.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from asyncckpt.errors import MemoryTierFullError, SaveFailedError
from asyncckpt.format.layout import layout
from asyncckpt.ipc.messages import NodeRanks, TensorEntry
from asyncckpt.writer.memory_absent import Absence
from asyncckpt.writer.memory_commit import Committing, JobCommit
from asyncckpt.writer.memory_generation import Generation, physical_memory, room
from asyncckpt.writer.memory_held import Held, Opened
from asyncckpt.writer.memory_image import RankImage, SkippedImage
from asyncckpt.writer.memory_order import BeginOrder, DurableSaves
from asyncckpt.writer.memory_partner import PartnerNodes
from asyncckpt.writer.memory_rerun import Reruns

log = logging.getLogger("asyncckpt.writer")

TIER = "memory"
SKIPPED = "skipped"  # `stats.tier` of a memory save not held (the bound, `_admit`)
DROPPED_KEPT = 8  # generations whose reason for being dropped is remembered
# notify(error or None, path or None, stats): reaches one rank's client (session.py)
Notify = Callable[..., None]


class MemoryTier(Committing, PartnerNodes, Reruns, Absence, Held):
    """The generations this writer holds (thread-safe: the sessions call it): how
    they come (ranks' saves, partners' replicas) and go; how they are read, Held; a
    job gone back, Reruns; ranks that never come, Absence; a partner's replicas,
    PartnerNodes."""

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
            self._rerun_if_back(step, rank, world_size)
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

    def abandon(self, image: RankImage, error: SaveFailedError) -> None:
        """`image`'s rank failed or went before ending: its generation cannot become
        whole; the ranks waiting on it hear `error`."""
        with self._lock:
            gen = self._gens.get(image.step)
            if gen is not None and gen.images.get(image.rank) is image:
                self._drop(image.step, error)

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

