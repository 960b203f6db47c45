"""The writer's data path for one rank's save: hash, encode, append.

Each chunk that arrives in a ring slot is one frame: xxh3 of the raw bytes, encoded by
the codec straight from shared memory, appended to the rank's data file, and its
checksums recorded. Nothing larger than one encoded frame is ever held in writer
memory, so the writer's footprint is independent of tensor and model size. xxh3 and
zstd release the GIL, so one thread per rank runs in parallel with the others.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import xxhash

from . import faults
from .codec import Codec, make_codec
from .format import TensorSpec, data_file_name
from .manifest import Frame, RankPart


class RankFileWriter:
    """Appends the frames of one rank's stream to its data file in a tmp directory."""

    def __init__(self, directory: Path, rank: int, codec: str, level: int,
                 header: bytes, tensors: list[TensorSpec], flush_bytes: int = 0) -> None:
        self.rank = rank
        self.path = directory / data_file_name(rank, codec)
        self.expected_size = tensors[-1].end if tensors else len(header)
        self._codec: Codec = make_codec(codec, level)
        self._tensors = tensors
        self._frames: list[Frame] = []
        self._raw_size = 0
        self._stored_size = 0
        self._flush_bytes = flush_bytes
        self._flushed = 0
        self.encode_seconds = 0.0
        self.write_seconds = 0.0
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self.append(memoryview(header))

    @property
    def raw_size(self) -> int:
        return self._raw_size

    def append(self, raw: memoryview) -> None:
        """Encode `raw` as the next frame and write it.

        Raises:
            OSError: the write failed (the caller fails the save).
            ValueError: more bytes than the stream's layout allows.
        """
        if self._raw_size + len(raw) > self.expected_size:
            raise ValueError(f"rank {self.rank} sent {self._raw_size + len(raw)} bytes, "
                             f"its tensors hold {self.expected_size}")
        if not len(raw):
            return
        start = time.perf_counter()
        raw_hash = xxhash.xxh3_64_intdigest(raw)
        stored = self._codec.encode(raw)
        stored_hash = raw_hash if stored is raw else xxhash.xxh3_64_intdigest(stored)
        middle = time.perf_counter()
        view = memoryview(stored)
        while view:
            faults.io("write", self.path)
            view = view[os.write(self._fd, view):]
        faults.point("frame_written")
        self.encode_seconds += middle - start
        self.write_seconds += time.perf_counter() - middle
        self._frames.append(Frame(self._raw_size, len(raw), self._stored_size, len(stored),
                                  self._codec.name, raw_hash, stored_hash))
        self._raw_size += len(raw)
        self._stored_size += len(stored)
        if self._flush_bytes and self._stored_size - self._flushed >= self._flush_bytes:
            self._flush()

    def _flush(self) -> None:
        """Make what is written durable now and drop it from the page cache: the disk
        works while frames still arrive, the final fsync has little left to do, and dirty
        pages (which count against the job's memory limit) stay bounded."""
        start = time.perf_counter()
        faults.io("fsync", self.path)
        os.fdatasync(self._fd)
        os.posix_fadvise(self._fd, self._flushed, self._stored_size - self._flushed,
                         os.POSIX_FADV_DONTNEED)
        self._flushed = self._stored_size
        self.write_seconds += time.perf_counter() - start

    def finish(self, tree: object) -> RankPart:
        """fsync and close the file; return this rank's manifest part.

        Raises:
            OSError: fsync failed.
            ValueError: fewer bytes arrived than the layout needs.
        """
        if self._raw_size != self.expected_size:
            raise ValueError(f"rank {self.rank} ended after {self._raw_size} of "
                             f"{self.expected_size} bytes")
        start = time.perf_counter()
        faults.io("fsync", self.path)
        os.fsync(self._fd)
        faults.point("data_fsynced")
        self.write_seconds += time.perf_counter() - start
        self.close()
        return RankPart(self.rank, self.path.name, self._codec.name, self._raw_size,
                        self._stored_size, self._tensors, self._frames, tree)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
