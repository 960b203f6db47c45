"""The writer's data path for one rank's save: hash and encode in parallel, append in order.

Each chunk that arrives in a ring slot is one frame. Frames are encoded on the writer's
shared `FramePool` (xxh3, numpy and zstd release the GIL, so threads use every core)
from the writer's private copy of the slot, and may finish out of order; one appender
thread per file writes them strictly in stream order (no reordering buffer beyond the frames in
flight). Writing on the pool's threads instead was measured worse: a thread blocked in
write or fdatasync (0.6 s of a 1 GiB save here) is an encoder lost, and on 2 cores
byte-grouped saves then took 1.25x as long as raw ones. The frame's buffer goes back to
the caller (`done`) as soon as the frame no longer needs it: after encoding when the
stored bytes are a copy (zstd, bytegroup), after the write when they are the buffer
itself (raw). Writer memory is the pool's frames in flight times one raw and one
encoded frame, whatever the tensor and model sizes.

With incremental saves, a chunk is also cut at the start and end of every tensor of at
least `CUT_BYTES`, so that a large tensor that did not change fills frames of its own
(which then match a committed frame and are stored as references, dedup.py) instead of
sharing a frame with the tensor next to it that did change: a LoRA adapter's few KiB
between two frozen weights would otherwise make both frames new. Smaller tensors stay
packed (no flood of tiny frames); the cost is about two extra frames per large tensor.
A frame that matches is not encoded at all, only hashed.

A rank with `skip_unchanged` sends no bytes for tensors it knows unchanged since a
committed step; the session hands this writer those tensors' frames in that step
(`unchanged`, keyed by the tensor's offset in this stream) and `submit` splices them in
as references where the stream reaches them, so the rank's chunks carry only the other
tensors' bytes.

Writeback runs behind the appends in windows of `flush_bytes` (writeback.py: each
window's writeback is started as soon as it is written, the one before it waited for and
dropped from the page cache): the disk works while frames still arrive, the final fsync
has little left to do, and the file's cached pages, which count against the job's memory
limit, stay within about three windows whatever the codec.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path
from typing import Callable, Union

import xxhash

from asyncckpt.codec.registry import PLANE_MAX_RATIO, PLANE_PROBE_BYTES
from asyncckpt.format.encoding import Encoded, FrameEncoder
from asyncckpt.format.layout import CUT_BYTES, TensorSpec, data_file_name
from asyncckpt.format.manifest import Frame, RankPart, Ref
from asyncckpt.runtime import faults
from asyncckpt.runtime.pool import FramePool
from asyncckpt.writer.autocodec import CodecChooser
from asyncckpt.writer.dedup import MIN_BYTES, Target
from asyncckpt.writer.writeback import Writeback

Done = Callable[[], None]
Lookup = Callable[[int, int], Union[Target, None]]  # (xxh3_128, raw length) -> target
# one piece of a chunk: encoded (with its xxh3_128, or None) or a reference
_Piece = tuple[int, Union[Encoded, Target], Union[int, None]]
# a tensor's frames in a committed step, as (raw length, target, xxh3_128)
Unchanged = list[tuple[int, Target, int]]


class RankFileWriter:
    """Appends the frames of one rank's stream to its data file in a tmp directory.

    `submit` may be called from one thread (the rank's session) while pool threads
    encode and write; `finish` and `wait_idle` block until every submitted frame is
    written or dropped. The header is cut into frames of at most `max_frame` bytes, the
    bound every reader applies.
    """

    def __init__(self, directory: Path, rank: int, codec: str, level: int,
                 header: bytes, tensors: list[TensorSpec], flush_bytes: int, *,
                 pool: FramePool, max_frame: int,
                 on_error: Callable[[BaseException], None] | None = None,
                 probe_bytes: int = PLANE_PROBE_BYTES, plane_max_ratio: float = PLANE_MAX_RATIO,
                 chooser: CodecChooser | None = None, incremental: bool = False,
                 lookup: Lookup | None = None,
                 unchanged: dict[int, Unchanged] | None = None,
                 writeback: str = "range") -> None:
        """With `incremental`, frames are cut at large tensors' boundaries and carry
        their xxh3_128; `lookup` (if given) finds committed frames to reference;
        `unchanged` maps the stream offset of each tensor the rank will not send to
        its frames in a committed step. `flush_bytes` and `writeback` are the window
        and mode of writeback.py."""
        self.rank = rank
        self.codec = codec
        self.path = directory / data_file_name(rank, codec)
        self.expected_size = tensors[-1].end if tensors else len(header)
        self._encoder = FrameEncoder(codec, level, tensors, probe_bytes, plane_max_ratio,
                                     chooser)
        self._tensors = tensors
        self._incremental = incremental
        self._lookup = lookup
        self._data_begin = tensors[0].begin if tensors else self.expected_size
        self._cuts = sorted({x for t in tensors if t.end - t.begin >= CUT_BYTES
                             for x in (t.begin, t.end)}) if incremental else []
        self.new_bytes = 0          # raw bytes of frames written to the file
        self.referenced_bytes = 0   # raw bytes of frames stored as references
        self._pool = pool
        self._on_error = on_error
        self._lock = threading.Condition()
        self._submitted = 0        # frames
        self._raw_submitted = 0    # bytes
        self._pending = 0          # submitted, not yet written or dropped
        self._next = 0             # index of the next frame to append
        # index -> (pieces, raw length, done, encode seconds, holds a pool credit)
        self._ready: dict[int, tuple[list[_Piece] | None, int, Done | None, float, bool]] = {}
        self._unchanged = {offset: [(n, t, w) for n, t, w in frames]
                           for offset, frames in (unchanged or {}).items()}
        self._closing = False
        self.error: BaseException | None = None
        self._frames: list[Frame] = []
        self._raw_size = 0
        self._stored_size = 0
        self.encode_seconds = 0.0
        self.write_seconds = 0.0
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self._writeback = Writeback(self._fd, flush_bytes, writeback, self.path)
        self._appender = threading.Thread(target=self._append_loop, daemon=True,
                                          name=f"asyncckpt-append-{rank}")
        self._appender.start()
        for start in range(0, len(header), max_frame):
            self.submit(memoryview(header)[start:start + max_frame])

    @property
    def raw_size(self) -> int:
        return self._raw_size

    @property
    def stored_size(self) -> int:
        return self._stored_size

    def submit(self, raw: memoryview, done: Done | None = None) -> None:
        """Queue `raw` as the next bytes of the stream (one frame, or several around the
        unchanged tensors it skips over); `done()` is called (from any thread) once `raw`
        is no longer needed. Blocks while the pool has no free frame credit.

        Raises:
            ValueError: more bytes than the stream's layout allows (nothing is queued;
                `done` is not called).
        """
        pieces = self._split(len(raw))
        if len(pieces) > 1 and done is not None:
            done = _after(len(pieces), done)
        for start, length in pieces or [(0, 0)]:
            self._splice_unchanged()
            self._submit_frame(raw[start:start + length], done)
        self._splice_unchanged()

    def _split(self, length: int) -> list[tuple[int, int]]:
        """Where `length` sent bytes go: (start in the chunk, length) per run of the
        stream between unchanged tensors.

        Raises:
            ValueError: they overrun the layout.
        """
        pieces, start, position = [], 0, self._raw_submitted
        upcoming = sorted(o for o in self._unchanged if o >= position)
        while True:
            while upcoming and upcoming[0] == position:
                position += sum(n for n, _, _ in self._unchanged[upcoming.pop(0)])
            if start == length:
                break
            take = min(length - start, (upcoming[0] if upcoming else 1 << 62) - position)
            pieces.append((start, take))
            start += take
            position += take
        if position > self.expected_size:
            raise ValueError(f"rank {self.rank} sent bytes up to {position}, its tensors "
                             f"hold {self.expected_size}")
        return pieces

    def _splice_unchanged(self) -> None:
        """Queue the references of the unchanged tensor the stream has reached, if any."""
        while (frames := self._unchanged.pop(self._raw_submitted, None)) is not None:
            length = sum(n for n, _, _ in frames)
            with self._lock:
                index = self._submitted
                self._submitted += 1
                self._raw_submitted += length
                self._pending += 1
                self._ready[index] = (list(frames), length, None, 0.0, False)
                if index == self._next:
                    self._lock.notify_all()

    def _submit_frame(self, raw: memoryview, done: Done | None) -> None:
        with self._lock:
            if self._raw_submitted + len(raw) > self.expected_size:
                raise ValueError(f"rank {self.rank} sent {self._raw_submitted + len(raw)} bytes, "
                                 f"its tensors hold {self.expected_size}")
            if not len(raw):
                if done:
                    done()
                return
            index, offset = self._submitted, self._raw_submitted
            self._submitted += 1
            self._raw_submitted += len(raw)
            self._pending += 1

        self._pool.submit(lambda context: self._encode(index, offset, raw, done, context))

    def _encode(self, index: int, offset: int, raw: memoryview, done: Done | None,
                context: dict) -> None:
        encoded, seconds, raw_length = None, 0.0, len(raw)
        if self.error is None and not self._closing:
            start = time.perf_counter()
            try:
                encoded = self._pieces(offset, raw, context)
            except Exception as e:  # a codec bug must fail the save, not hang it
                self._set_error(e)
            seconds = time.perf_counter() - start
        if done is not None and (encoded is None or not any(
                isinstance(e, Encoded) and e.aliases_raw for _, e, _ in encoded)):
            done()  # the slot is free for the rank while this frame waits its turn
            done = None
        with self._lock:
            self._ready[index] = (encoded, raw_length, done, seconds, True)
            if index == self._next:
                self._lock.notify_all()

    def _pieces(self, offset: int, raw: memoryview, context: dict) -> list[_Piece]:
        """Cut the chunk at large tensors' boundaries (incremental only), then per piece
        a committed frame to reference, or the piece encoded."""
        end = offset + len(raw)
        cuts = self._cuts[bisect.bisect_right(self._cuts, offset):bisect.bisect_left(self._cuts, end)]
        out: list[_Piece] = []
        for lo, hi in zip([offset, *cuts], [*cuts, end]):
            piece = raw[lo - offset:hi - offset]
            wide = xxhash.xxh3_128_intdigest(piece) if self._incremental else None
            target = None
            if (wide is not None and self._lookup is not None and len(piece) >= MIN_BYTES
                    and lo >= self._data_begin):  # never the header (dedup.py)
                target = self._lookup(wide, len(piece))
            out.append((len(piece), target if target is not None
                        else self._encoder.encode(lo, piece, context), wide))
        return out

    def _append_loop(self) -> None:
        """The appender thread: write frames in order until closed and drained."""
        while True:
            with self._lock:
                while self._next not in self._ready and not (self._closing and not self._pending):
                    self._lock.wait()
                item = self._ready.pop(self._next, None)
                if item is None:  # closed, nothing left in flight
                    self._close_fd()
                    return
                self._next += 1
            encoded, raw_length, done, seconds, pooled = item
            try:
                if encoded is not None and self.error is None and not self._closing:
                    for length, piece, wide in encoded:
                        if isinstance(piece, Encoded):
                            self._write(piece, length, wide)
                        else:
                            self._reference(piece, length, wide)
            except Exception as e:
                self._set_error(e)
            finally:
                if done is not None:
                    done()
                if pooled:
                    self._pool.release()
                with self._lock:
                    self.encode_seconds += seconds
                    self._pending -= 1
                    if self._pending == 0:
                        self._lock.notify_all()

    def _reference(self, target: Target, raw_length: int, wide: int | None) -> None:
        self._frames.append(Frame(self._raw_size, raw_length, self._stored_size, 0,
                                  target.codec, target.xxh3_raw, target.xxh3_stored,
                                  target.layout, wide,
                                  Ref(target.step, target.file, target.offset, target.length)))
        self._raw_size += raw_length
        self.referenced_bytes += raw_length

    def _write(self, encoded: Encoded, raw_length: int, wide: int | None = None) -> None:
        start = time.perf_counter()
        pieces = [memoryview(p).cast("B") for p in encoded.pieces if len(p)]
        while pieces:
            faults.io("write", self.path)
            n = os.writev(self._fd, pieces[:_IOV_MAX])
            while pieces and n >= len(pieces[0]):
                n -= len(pieces[0])
                pieces.pop(0)
            if n:
                pieces[0] = pieces[0][n:]
        faults.point("frame_written")
        self._frames.append(Frame(self._raw_size, raw_length, self._stored_size,
                                  encoded.stored_length, encoded.codec, encoded.xxh3_raw,
                                  encoded.xxh3_stored, encoded.layout, wide))
        self._raw_size += raw_length
        self.new_bytes += raw_length
        self._stored_size += encoded.stored_length
        self._writeback.written(self._stored_size)
        self.write_seconds += time.perf_counter() - start

    def _set_error(self, error: BaseException) -> None:
        with self._lock:
            first = self.error is None
            if first:
                self.error = error
        if first and self._on_error is not None:
            self._on_error(error)

    @property
    def busy(self) -> bool:
        """Frames submitted and not yet written or dropped."""
        return self._pending > 0

    def wait_idle(self) -> None:
        """Block until every submitted frame is written or dropped."""
        with self._lock:
            while self._pending:
                self._lock.wait()

    def finish(self, tree: object) -> RankPart:
        """Wait for the frames in flight, fsync and close the file; return this rank's
        manifest part.

        Raises:
            OSError: a write or fsync failed.
            ValueError: fewer bytes arrived than the layout needs.
            Exception: whatever failed an encode.
        """
        self.wait_idle()
        if self.error is not None:
            self.close(wait=True)
            raise self.error
        if self._raw_size != self.expected_size:
            raise ValueError(f"rank {self.rank} ended after {self._raw_size} of "
                             f"{self.expected_size} bytes")
        start = time.perf_counter()
        faults.io("fsync", self.path)
        os.fsync(self._fd)
        faults.point("data_fsynced")
        self._writeback.done()
        self.write_seconds += time.perf_counter() - start
        self.close(wait=True)
        return RankPart(self.rank, self.path.name, self.codec, self._raw_size,
                        self._stored_size, self._tensors, self._frames, tree)

    def frame_counts(self) -> dict[str, int]:
        """How many frames each codec stored (a bytegroup file also has raw frames)."""
        counts: dict[str, int] = {}
        for f in self._frames:
            counts[f.codec] = counts.get(f.codec, 0) + 1
        return counts

    def close(self, wait: bool = False) -> None:
        """Drop the frames still in flight; the appender closes the file once none is
        being written. With `wait`, return only after that (never from a callback)."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        if wait and threading.current_thread() is not self._appender:
            self._appender.join()

    def _close_fd(self) -> None:  # with the lock held, by the appender
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


_IOV_MAX = 1024


def _after(count: int, done: Done) -> Done:
    """`done`, called on the `count`-th call only (a chunk queued as several frames)."""
    left = [count]
    lock = threading.Lock()

    def countdown() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            done()
    return countdown
