"""What the transport moves, and the store a replica server keeps it in.

A replica is one node's memory generation: facts (a JSON document the memory tier
writes and reads; the transport only bounds its size) and one byte stream per rank. The
transport needs to know just enough to bound and check the bytes -- whose they are (the
node), which generation (the step), and each stream's extent -- so that is the `Offer`,
checked field by field before a byte of the streams is read or a buffer allocated.

A server holds what partners send in a `ReplicaStore` that its writer supplies (the
memory tier, writer/memory_replica.py); `MemoryStore` is a plain one, for tests and as
the reference of the contract.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncckpt.errors import ReplicaError

Address = tuple[str, int]
MAX_STREAMS = 1 << 16  # streams (ranks) of one replica: a node holds far fewer ranks
MAX_OFFSET = 1 << 48  # bytes of one stream: beyond any host's memory


@dataclass(frozen=True)
class Stream:
    """Bytes `start`..`size` of one rank's image (the bytes before `start`, a header the
    receiver rebuilds from the facts, are not sent)."""

    rank: int
    start: int
    size: int

    @property
    def length(self) -> int:
        return self.size - self.start


@dataclass(frozen=True)
class Offer:
    """A replica's identity, facts and extent: what a receiver checks before anything
    is allocated for it."""

    node: int
    step: int
    doc: dict[str, Any]
    streams: tuple[Stream, ...]

    @property
    def total_bytes(self) -> int:
        return sum(s.length for s in self.streams)

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "step": self.step, "doc": self.doc,
                "streams": [[s.rank, s.start, s.size] for s in self.streams]}


def offer_from_json(obj: Any, max_bytes: int) -> Offer:
    """An `Offer` from its JSON, checked: integers where integers go, streams inside
    their bounds, and every stream together within `max_bytes`.

    Raises:
        ReplicaError: a field is missing, mistyped or out of bounds; the replica is
            larger than `max_bytes` (refused before anything is allocated for it).
    """
    if not isinstance(obj, dict):
        raise ReplicaError("a replica offer is not a JSON object")
    node, step, doc, streams = (obj.get(k) for k in ("node", "step", "doc", "streams"))
    if not _count(node) or not _count(step):
        raise ReplicaError(f"a replica offer of node {node!r:.40}, step {step!r:.40}: not "
                           "integers >= 0")
    assert isinstance(node, int) and isinstance(step, int)
    if not isinstance(doc, dict):
        raise ReplicaError("a replica offer's facts are not a JSON object", step=step)
    if not isinstance(streams, list) or len(streams) > MAX_STREAMS:
        raise ReplicaError(f"a replica offer's streams are not a list of at most {MAX_STREAMS}",
                           step=step)
    out: list[Stream] = []
    for entry in streams:
        if (not isinstance(entry, list) or len(entry) != 3 or not all(map(_count, entry))
                or not entry[1] <= entry[2] <= MAX_OFFSET):
            raise ReplicaError(f"a replica stream {entry!r:.60} is not [rank, start, size] "
                               f"with 0 <= start <= size <= 2**48", step=step)
        out.append(Stream(*entry))
    if len({s.rank for s in out}) != len(out):
        raise ReplicaError("a replica offer names a rank twice", step=step)
    offer = Offer(node, step, doc, tuple(out))
    if offer.total_bytes > max_bytes:
        raise ReplicaError(f"replica of node {node} is {offer.total_bytes} bytes, larger than "
                           f"the bound replica_max_bytes={max_bytes}: refused", step=step)
    return offer


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


class ReplicaSink(Protocol):
    """Where a replica's bytes go as they arrive (the memory tier's `ReplicaIn`).

    Bytes handed to `data` are provisional: they count only once `finish` returns. The
    transport calls `abort` on any failure (a checksum, a MAC, a stall, a peer gone)."""

    def data(self, rank: int, offset: int, chunk: memoryview) -> None:
        """The next bytes of `rank`'s stream, at `offset`, in order (copy them: the
        buffer is reused). Raise a CheckpointError to refuse the replica."""

    def finish(self) -> bool:
        """Every byte arrived and passed the transport's checks. Returns whether the
        replica was taken (False: taken, then dropped as superseded). Raise a
        CheckpointError to refuse it."""

    def abort(self) -> None:
        """Free what was received; idempotent."""


@dataclass
class Replica:
    """A replica to send: its offer and one source per stream, in the offer's order.

    A source is a file descriptor (read-only is enough; the transport maps it and never
    closes it) or a buffer holding the stream's image up to its `size`. `release` is
    called once the transport is done with the sources (close descriptors there)."""

    offer: Offer
    sources: Sequence[int | bytes | bytearray | memoryview | mmap.mmap]
    release: Callable[[], None] = field(default=lambda: None)


class ReplicaStore(Protocol):
    """What a replica server holds (its writer supplies it; thread-safe: connections are
    served by threads of their own)."""

    def put_generation(self, peer: str, offer: Offer) -> ReplicaSink:
        """A partner (`peer`, its address) offers a replica, already checked against the
        transport's bounds: a sink for its bytes, or a CheckpointError to refuse it."""

    def get_generation(self, node: int, step: int | None) -> Replica | None:
        """Node `node`'s replica of `step` (None: the newest held), or None."""

    def list_generations(self) -> list[dict[str, Any]]:
        """What is held, as JSON summaries (the server sends them as they are)."""


class MemoryStore:
    """A `ReplicaStore` in plain buffers: each node's replicas by step, the newest
    `keep` of each node kept."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._held: dict[tuple[int, int], tuple[Offer, list[bytearray]]] = {}
        self.aborted = 0  # sinks aborted (a refused or broken transfer)

    def put_generation(self, peer: str, offer: Offer) -> _MemorySink:
        return _MemorySink(self, offer)

    def get_generation(self, node: int, step: int | None) -> Replica | None:
        with self._lock:
            steps = [s for n, s in self._held if n == node]
            if step is None and steps:
                step = max(steps)
            held = self._held.get((node, step)) if step is not None else None
        return None if held is None else Replica(held[0], list(held[1]))

    def list_generations(self) -> list[dict[str, Any]]:
        with self._lock:
            return [{"node": n, "step": s, "bytes": o.total_bytes}
                    for (n, s), (o, _) in sorted(self._held.items())]

    def _take(self, offer: Offer, buffers: list[bytearray]) -> bool:
        with self._lock:
            self._held[(offer.node, offer.step)] = (offer, buffers)
            mine = sorted(s for n, s in self._held if n == offer.node)
            for old in mine[:-self.keep]:
                del self._held[(offer.node, old)]
            return (offer.node, offer.step) in self._held


class _MemorySink:
    def __init__(self, store: MemoryStore, offer: Offer) -> None:
        self._store, self._offer = store, offer
        self._buffers = [bytearray(s.size) for s in offer.streams]
        self._filled = {s.rank: s.start for s in offer.streams}
        self._index = {s.rank: i for i, s in enumerate(offer.streams)}
        self._done = False

    def data(self, rank: int, offset: int, chunk: memoryview) -> None:
        i = self._index.get(rank)
        if i is None or offset != self._filled[rank] or \
                offset + len(chunk) > self._offer.streams[i].size:
            raise ReplicaError(f"bytes {offset}.. of rank {rank} out of order",
                               step=self._offer.step)
        self._buffers[i][offset:offset + len(chunk)] = chunk
        self._filled[rank] = offset + len(chunk)

    def finish(self) -> bool:
        if any(self._filled[s.rank] != s.size for s in self._offer.streams):
            raise ReplicaError("a stream ended short", step=self._offer.step)
        self._done = True
        return self._store._take(self._offer, self._buffers)

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._buffers = []
            with self._store._lock:
                self._store.aborted += 1


def source_view(source: int | bytes | bytearray | memoryview | mmap.mmap,
                size: int) -> tuple[memoryview, Callable[[], None]]:
    """A read-only view of a replica source's first `size` bytes, and how to let go of it.

    Raises:
        ReplicaError: the source holds fewer than `size` bytes.
    """
    if isinstance(source, int):
        have = os.fstat(source).st_size
        if have < size:
            raise ReplicaError(f"a replica source holds {have} bytes, its stream {size}")
        if size == 0:
            return memoryview(b""), lambda: None
        mapped = mmap.mmap(source, size, prot=mmap.PROT_READ)
        view = memoryview(mapped)
        part = view[:size].toreadonly()

        def release() -> None:
            part.release()
            view.release()
            mapped.close()
        return part, release
    whole = memoryview(source).cast("B")
    if len(whole) < size:
        have = len(whole)
        whole.release()
        raise ReplicaError(f"a replica source holds {have} bytes, its stream {size}")
    piece = whole[:size].toreadonly()

    def let_go() -> None:
        piece.release()
        whole.release()
    return piece, let_go
