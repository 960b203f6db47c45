"""Fetching another writer's images of a generation, for a restore (`memory_fetch`).

At three nodes or more a rank's image of the step its job restores may be held by
another node's writer only (its own writer skipped that save, or dropped it once its
replica of a newer one was whole; a shrunk job's rank reads a lost node's images). The
restore (read/memory_restore.py) then asks the rank's own writer to fetch that node's
images of the step from the writer that holds them, naming that writer's replica
server; the bytes come over the replica transport, as a replacement's recovery does
(asyncckpt/net/: the job's secret proven by both sides, every message MAC'd, every
chunk's step, stream, offset and xxh3 checked on arrival), into images checked by the
memory tier's own rules (memory_replica.py `ReplicaIn`: the facts and entries by the
reader's rules, the node the one asked for, every frame against the xxh3 its saver
took). Then they are handed to the rank as `memory_open` hands images: read-only
descriptors of sealed memfds, which the rank's load verifies again, frame by frame.

What is fetched is held apart from the generations (memory_held.py): never listed,
replicated, flushed or counted by the bound of two generations per node; counted against
`memory_max_bytes` (a fetch past it is refused, MemoryTierFullError); let go at the
next save of a rank of this writer (the restore is over), or when a fetch of another
step comes. A node fetched once is handed again to the node's other ranks without a
second transfer. One fetch at a time per writer.
"""

from __future__ import annotations

import logging
import threading

from asyncckpt.errors import SaveFailedError
from asyncckpt.net.replica import Offer
from asyncckpt.net.transport import Transport
from asyncckpt.writer.memory_held import Opened
from asyncckpt.writer.memory_replica import ReplicaIn, ReplicaRefusedError
from asyncckpt.writer.memory_tier import MemoryTier

log = logging.getLogger("asyncckpt.writer")


class Fetcher:
    """A writer's fetches of other writers' images, over its replica transport."""

    def __init__(self, tier: MemoryTier, transport: Transport, max_frame_bytes: int) -> None:
        self._tier, self._transport, self._max_frame = tier, transport, max_frame_bytes
        self._lock = threading.Lock()

    def fetch(self, step: int, node: int, source: str) -> Opened:
        """Node `node`'s (its first rank's) whole images of generation `step`: those
        held here already, else fetched from the writer whose replica server is at
        `source` ("host:port"); with a read-only descriptor each (the caller closes
        them).

        Raises:
            ReplicaAuthError: `source` did not prove the job's secret.
            ReplicaError: it holds no such images, it stalled or went away, or a chunk
                failed its checks.
            ReplicaRefusedError: what came breaks a rule (another node, an entry the
                reader refuses, a frame that does not match its xxh3).
            MemoryTierFullError: the images would pass `memory_max_bytes`.
            SaveFailedError: they were let go before they could be handed (a save began).
        """
        host, _, port = source.rpartition(":")
        with self._lock:
            held = self._tier.open_node(step, node)
            if held is not None:
                return held

            def sink(offer: Offer) -> ReplicaIn:
                into = ReplicaIn(self._tier, offer.doc, self._max_frame,
                                 expect_step=step, fetched=True)
                if into.node[0] != node or [(s.rank, s.start, s.size)
                                            for s in offer.streams] != into.streams():
                    into.abort()
                    raise ReplicaRefusedError(
                        f"asked {source} for node {node}'s images, got node "
                        f"{list(into.node)} (or streams that are not its entries'): refused",
                        step=step, rank=node)
                return into
            offer = self._transport.get((host, int(port)), node, step, sink)
            held = self._tier.open_node(step, node)
        if held is None:
            raise SaveFailedError(f"node {node}'s images fetched from {source} were let go "
                                  "before they could be handed (a save began)", step=step,
                                  rank=node)
        log.info("memory generation %d: node %d's images fetched from %s for a restore "
                 "(%d bytes)", step, node, source, offer.total_bytes)
        return held
