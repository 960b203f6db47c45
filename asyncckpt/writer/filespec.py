"""What one rank's data file is made from, as a few small values.

A rank file writer (pipeline.py) needs the writer's shared settings, the file's place,
the stream it will hold and the committed frames it may reference instead of storing
bytes again; each is one frozen value here, made by the session from its begin, so
that the writer's constructor takes four things instead of a dozen loose ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asyncckpt.config import WriterKnobs
from asyncckpt.format.layout import TensorSpec, data_file_name
from asyncckpt.runtime.pool import FramePool
from asyncckpt.storage.base import Storage
from asyncckpt.writer.appenders import APPENDERS, Appenders
from asyncckpt.writer.dedup import Target

if TYPE_CHECKING:
    from asyncckpt.storage.paths import Location

Lookup = Callable[[int, int], Target | None]  # (xxh3_128, raw length) -> target
# a tensor's frames in a committed step, as (raw length, target, xxh3_128)
Unchanged = list[tuple[int, Target, int]]


@dataclass(frozen=True)
class FileSettings:
    """What every rank file of one writer shares: where files go, the frame threads, and
    the knobs of encoding and writeback (WriterKnobs documents each).

    Attributes:
        storage: the root's storage; data files are made there.
        pool: the writer's frame threads.
        level: the zstd level.
        flush_bytes: the writeback window (storage/writeback.py; 0: none before the fsync).
        writeback: the writeback mode ("range" or "fdatasync").
        incremental: cut frames at large tensors' boundaries and give them an xxh3_128.
        appenders: the threads that append the files (the process's, reused across saves).
    """

    storage: Storage
    pool: FramePool
    level: int
    flush_bytes: int
    writeback: str = WriterKnobs.writeback
    incremental: bool = False
    appenders: Appenders = APPENDERS

    @classmethod
    def from_knobs(cls, knobs: WriterKnobs, storage: Storage, pool: FramePool
                   ) -> FileSettings:
        return cls(storage, pool, knobs.zstd_level, knobs.flush_bytes, knobs.writeback,
                   knobs.incremental)


@dataclass(frozen=True)
class FileTarget:
    """Whose data file it is and where it goes.

    Attributes:
        directory: the step's tmp area.
        rank: the rank whose stream it holds.
        codec: the file's codec (its name says it: `data_file_name`).
        folder: a coordinated step's node folder inside `directory` ("" for none).
    """

    directory: Location
    rank: int
    codec: str
    folder: str = ""

    @property
    def name(self) -> str:
        """The file's name inside `directory` (with its folder)."""
        name = data_file_name(self.rank, self.codec)
        return f"{self.folder}/{name}" if self.folder else name


@dataclass(frozen=True)
class Stream:
    """What the file will hold: the rank's safetensors header and tensor table, cut
    into frames of at most `max_frame` bytes (the ring's slot size, the bound every
    reader applies)."""

    header: bytes
    tensors: list[TensorSpec]
    max_frame: int


@dataclass(frozen=True)
class Reuse:
    """Committed frames the file may reference instead of storing bytes again.

    Attributes:
        lookup: finds a committed frame by content (incremental saves).
        unchanged: the stream offset of each tensor the rank will not send -> its
            frames in a committed step (skip_unchanged).
    """

    lookup: Lookup | None = None
    unchanged: dict[int, Unchanged] = field(default_factory=dict)


NO_REUSE = Reuse()
