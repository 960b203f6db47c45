"""Replicas: a generation of this node sent to a partner writer, and a partner's held here.

The transport between writers (asyncckpt/net/) moves bytes; what they mean, and whether
they are taken, is decided here, on the receiving writer, before anything counts:

- `offer(tier, step)` is what a writer sends: the generation's facts (step, world,
  timeline, this node's ranks) and each rank's manifest entry -- its tensor table, object
  tree and every frame's xxh3 -- then each rank's bytes after its header, by offset.
- `ReplicaIn` takes a partner's offer: the facts and entries are checked with the
  reader's rules (a step, a world, a node inside it, contiguous raw frames, no
  references) and the images are reserved within `memory_max_bytes` before a byte is
  accepted; bytes must arrive in order and within each rank's size; at the end every
  frame the sender declared is checked against the bytes held. A wrong step, a flipped
  byte, a short or long rank, a replica past the bound: the whole replica is refused and
  freed, and nothing of it was ever listed or restored.

A replica is held as more images of the same generation (memory_tier.py), so a writer
that holds its partner's node can serve both nodes' ranks to a restore (a replacement
node's ranks, or a shrunk world resharding), and flush the generation when the two
nodes make the world. The header is not sent: the receiver writes it from the tensor
table, and it is checked like every other frame.
"""

from __future__ import annotations

import os
from typing import Any

from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.layout import MAX_WORLD
from asyncckpt.format.records import RankPart, rank_from_json
from asyncckpt.ipc.messages import NodeRanks
from asyncckpt.ipc.options import is_step
from asyncckpt.writer.memory_image import RankImage
from asyncckpt.writer.memory_tier import MemoryTier


class ReplicaRefusedError(CorruptCheckpointError):
    """A partner's replica broke a rule; it was freed and never counted."""


def offer(tier: MemoryTier, step: int) -> tuple[dict[str, Any], list[tuple[int, int, int]]]:
    """What this writer sends its partner of generation `step`: the facts (JSON), and per
    rank (rank, a read-only descriptor of its image, the offset its bytes to send start
    at). The caller sends `os.pread`s of each descriptor from that offset to its end,
    then closes the descriptors.

    Raises:
        KeyError: this node's images of `step` are not held whole.
    """
    gen, parts, fds = tier.outgoing(step)
    first = min(p.rank for p in parts)
    doc = {"step": gen.step, "world_size": gen.world_size, "timeline": gen.timeline,
           "node": [first, len(parts)], "parts": [p.to_json() for p in parts]}
    return doc, [(p.rank, fd, p.tensors[0].begin if p.tensors else p.raw_size)
                 for p, fd in zip(parts, fds)]


class ReplicaIn:
    """A partner's generation arriving. Feed it `data` in order, then `finish`; on any
    error (raised by them) it is already freed; `abort` frees it from outside."""

    def __init__(self, tier: MemoryTier, doc: Any, max_frame_bytes: int,
                 expect_step: int | None = None, fetched: bool = False) -> None:
        """Check the offer's facts and entries, and reserve its images.

        Args:
            doc: the offer's facts (`offer`), as received.
            expect_step: the step the transport's own framing announced, if any.
            fetched: images fetched for a restore (memory_fetch.py): held apart from the
                generations (memory_held.py `receive_fetched`), not as a replica.
        Raises:
            ReplicaRefusedError: a fact or entry breaks a rule, or the step is not the
                one announced.
            MemoryTierFullError, SaveFailedError: no room, or it disagrees with what is
                held (memory_tier.py).
        """
        self._tier, self._done, self._fetched = tier, False, fetched
        step, world, node, parts = _checked(doc, max_frame_bytes)
        if expect_step is not None and step != expect_step:
            raise ReplicaRefusedError(f"replica of step {step}, announced as {expect_step}",
                                      step=expect_step)
        self.step, self.node, self._declared = step, node, {p.rank: p for p in parts}
        receive = tier.receive_fetched if fetched else tier.receive
        self._images: dict[int, RankImage] = {
            i.rank: i for i in receive(step, world, doc.get("timeline"), node, parts,
                                       max_frame_bytes)}

    def streams(self) -> list[tuple[int, int, int]]:
        """(rank, first byte expected, size) of each rank's image, in rank order."""
        return [(r, i.filled, i.size) for r, i in sorted(self._images.items())]

    def data(self, rank: int, offset: int, chunk: bytes | bytearray | memoryview) -> None:
        """The next bytes of `rank`'s image, at `offset`.

        Raises:
            ReplicaRefusedError: a rank not in the replica, bytes out of order or past
                the rank's size (the replica is freed).
        """
        image = self._images.get(rank)
        if image is None or offset != image.filled or image.filled + len(chunk) > image.size:
            self._refuse(f"bytes {offset}..{offset + len(chunk)} of rank {rank} out of order "
                         "or past its size", rank)
        assert image is not None
        view = memoryview(chunk)

        def fill(out: memoryview) -> None:
            out[:] = view
        try:
            image.append(fill, len(chunk))
        except ValueError as e:
            self._refuse(str(e), rank)

    def finish(self) -> bool:
        """Every rank whole and every declared frame matching its xxh3: the replica
        counts from now on. False when its generation was dropped meanwhile (a newer one
        became whole here).

        Raises:
            ReplicaRefusedError: a rank short, or a frame whose bytes do not match (the
                replica is freed).
        """
        for rank, image in self._images.items():
            if image.filled != image.size:
                self._refuse(f"rank {rank} ended after {image.filled} of {image.size} bytes",
                             rank)
            for frame in self._declared[rank].frames:
                try:
                    same = image.digest(frame.raw_offset, frame.raw_length) == frame.xxh3_raw
                except ValueError as e:
                    self._refuse(str(e), rank)
                if not same:
                    self._refuse(f"frame at {frame.raw_offset} does not match its xxh3", rank)
        self._done = True
        images = list(self._images.values())
        if self._fetched:
            return self._tier.fetched_whole(self.step, images)
        return self._tier.received(self.step, images)

    def abort(self) -> None:
        """Free what was received (the transport failed); idempotent."""
        if not self._done:
            self._done = True
            discard = self._tier.discard_fetched if self._fetched else self._tier.discard
            discard(self.step, self.node, list(self._images.values()))

    def _refuse(self, cause: str, rank: int) -> None:
        self.abort()
        raise ReplicaRefusedError(f"replica refused: {cause}", step=self.step, rank=rank)


def _checked(doc: Any, max_frame_bytes: int) -> tuple[int, int, NodeRanks, list[RankPart]]:
    """The offer's step, world, node and entries, checked with the reader's rules."""
    def bad(cause: str) -> ReplicaRefusedError:
        return ReplicaRefusedError(f"replica refused: {cause}")
    if not isinstance(doc, dict):
        raise bad("its facts are not an object")
    step, world, node, parts = (doc.get(k) for k in ("step", "world_size", "node", "parts"))
    if not is_step(step) or type(world) is not int or not 1 <= world <= MAX_WORLD:
        raise bad(f"step {step!r:.40} / world {world!r:.40}")
    assert isinstance(step, int)
    if (not isinstance(node, list) or len(node) != 2 or not all(type(x) is int for x in node)
            or not (0 <= node[0] and 1 <= node[1] and node[0] + node[1] <= world)):
        raise bad(f"node {node!r:.60} is not [first, count] inside world {world}")
    if not isinstance(parts, list) or len(parts) != node[1]:
        raise bad(f"{len(parts) if isinstance(parts, list) else parts!r:.40} entries for a "
                  f"node of {node[1]} ranks")
    checked = []
    for index, part in enumerate(parts):
        rank = node[0] + index
        try:
            entry = rank_from_json(part, rank, max_frame_bytes, step, False)
        except (CorruptCheckpointError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise bad(f"rank {rank}'s entry: {e}") from None
        if entry.codec != "raw" or any(f.codec != "raw" for f in entry.frames):
            raise bad(f"rank {rank}'s entry is not raw")
        checked.append(entry)
    return step, world, NodeRanks(node[0], node[1]), checked


def send_all(doc_fds: tuple[dict[str, Any], list[tuple[int, int, int]]], chunk: int,
             sink: Any) -> None:
    """Feed an `offer` to `sink` (a `ReplicaIn`, or a transport with the same `data` /
    `finish`) in chunks of `chunk` bytes, and close its descriptors. For tests and the
    in-process seam."""
    _, ranks = doc_fds
    try:
        for rank, fd, start in ranks:
            size = os.fstat(fd).st_size
            for offset in range(start, size, chunk):
                sink.data(rank, offset, os.pread(fd, min(chunk, size - offset), offset))
        sink.finish()
    finally:
        for _, fd, _ in ranks:
            os.close(fd)
