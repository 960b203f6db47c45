"""The memory tier as the replica transport's store: what a partner may put and get.

The transport (asyncckpt/net/) authenticates the partner, bounds and paces the bytes
and checks each chunk; this adapter decides what they mean, through the tier's own
rules (memory_replica.py): a partner's put is a `ReplicaIn` (every entry and frame
checked, reserved within `memory_max_bytes`), and a get -- a replacement node pulling
its ranks' bytes, or a partner asking for this node's -- is served from the images held
here, own or replica, as read-only sealed descriptors.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from asyncckpt.net.replica import Offer, Replica, Stream
from asyncckpt.writer.memory_replica import ReplicaIn, ReplicaRefusedError
from asyncckpt.writer.memory_tier import MemoryTier

log = logging.getLogger("asyncckpt.writer")


class TierStore:
    """A `ReplicaStore` over a writer's memory tier."""

    def __init__(self, tier: MemoryTier, max_frame_bytes: int) -> None:
        self.tier, self.max_frame_bytes = tier, max_frame_bytes

    def put_generation(self, peer: str, offer: Offer) -> ReplicaIn:
        """A partner's replica: checked and reserved here (raises CheckpointError to
        refuse it: the transport tells the partner why)."""
        sink = ReplicaIn(self.tier, offer.doc, self.max_frame_bytes, expect_step=offer.step)
        if [(s.rank, s.start, s.size) for s in offer.streams] != sink.streams():
            sink.abort()
            raise ReplicaRefusedError(f"replica from {peer}: its streams are not its "
                                      "entries' ranks and sizes", step=offer.step)
        log.info("memory tier: taking node %d's generation %d from %s (%d bytes)",
                 offer.node, offer.step, peer, offer.total_bytes)
        return sink

    def get_generation(self, node: int, step: int | None) -> Replica | None:
        """Node `node`'s (its first rank's) images of `step` (None: newest) held here."""
        try:
            gen, parts, fds = self.tier.outgoing(step, node, hold=True)
        except KeyError:
            return None
        return _replica(self.tier, node, gen, parts, fds)

    def list_generations(self) -> list[dict[str, Any]]:
        return self.tier.generations()


def replica_doc(gen: Any, parts: list[Any]) -> dict[str, Any]:
    """The facts of a generation's node `parts` as `ReplicaIn` reads them."""
    first = min(p.rank for p in parts)
    return {"step": gen.step, "world_size": gen.world_size, "timeline": gen.timeline,
            "node": [first, len(parts)], "parts": [p.to_json() for p in parts]}


def partner_replica(tier: MemoryTier, step: int) -> Replica:
    """This writer's own node's generation `step`, to put to its partner.

    Raises:
        KeyError: not held whole.
    """
    gen, parts, fds = tier.outgoing(step, hold=True)
    return _replica(tier, min(p.rank for p in parts), gen, parts, fds)


def _replica(tier: MemoryTier, node: int, gen: Any, parts: list[Any],
             fds: list[int]) -> Replica:
    """Node `node`'s `parts` of `gen` as a replica to send: one stream per rank (its raw
    data after the header), the descriptors `fds` closed when it is released -- and
    `gen` no longer held as being sent (memory_tier.py counts on it: a generation being
    sent is never dropped to make room, its memory would outlive the count)."""
    offer = Offer(node, gen.step, replica_doc(gen, parts), tuple(
        Stream(p.rank, p.tensors[0].begin if p.tensors else p.raw_size, p.raw_size)
        for p in parts))

    def release() -> None:
        try:
            for fd in fds:
                os.close(fd)
        finally:
            tier.released(gen, [p.rank for p in parts])
    return Replica(offer, list(fds), release)
