"""What every session of one writer process shares, made once by the server.

A session (session.py) depends on these pieces, not on the server that owns them, so
that a session can be built and tested without a listening writer, and the server's
start-up and shutdown stay out of the protocol's code.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncckpt.config import WriterKnobs
    from asyncckpt.runtime.pool import FramePool
    from asyncckpt.runtime.procstat import PeakSampler
    from asyncckpt.storage.paths import Location
    from asyncckpt.writer.autocodec import CodecChooser
    from asyncckpt.writer.dedup import DedupIndex
    from asyncckpt.writer.memory_tier import MemoryTier
    from asyncckpt.writer.steps import Steps

__all__ = ["Buffers", "WriterContext"]

_MAX_KEPT_BUFFER = 16 << 20  # larger frame buffers are freed after use, not kept


class Buffers:
    """Reused private buffers for the frames in flight (fresh ones would pay first-touch
    page faults on every frame); at most `keep` are kept for reuse."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def get(self, size: int) -> bytearray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) >= size:
                    return self._free.pop(i)
        return bytearray(size)

    def put(self, buf: bytearray) -> None:
        with self._lock:
            if len(self._free) < self._keep and len(buf) <= _MAX_KEPT_BUFFER:
                self._free.append(buf)


@dataclass(frozen=True)
class WriterContext:
    """What every session of one writer shares: made once by the server, so that a
    session depends on these pieces and not on the server that owns them."""

    knobs: WriterKnobs
    root: Location
    root_id: str
    steps: Steps
    pool: FramePool
    buffers: Buffers
    chooser: CodecChooser
    index: DedupIndex | None
    rss: PeakSampler
    memory: MemoryTier | None = None
