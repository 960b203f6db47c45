"""The writer's data path for one rank's save: hash and encode in parallel, append in order.

Each chunk that arrives in a ring slot is one frame. Frames are encoded on the writer's
shared `FramePool` (xxh3, numpy and zstd release the GIL, so threads use every core)
from the writer's private copy of the slot, and may finish out of order; one appender
thread per file writes them strictly in stream order (no reordering buffer beyond the
frames in flight; its thread is kept for a later save's file, appenders.py). Writing on
the pool's threads instead was measured worse: a thread blocked in write or fdatasync is
an encoder lost, and on 2 cores byte-grouped saves then took
longer than raw ones (docs/design/writeback.md). The frame's buffer goes back to
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

Writeback runs behind the appends in windows of `flush_bytes` (storage/writeback.py: each
window's writeback is started as soon as it is written, the one before it waited for and
dropped from the page cache): the disk works while frames still arrive, the final fsync
has little left to do, and the file's cached pages, which count against the job's memory
limit, stay within about three windows whatever the codec.

The three jobs are kept apart: `_Order` hands frames to the appender in stream order,
`Cuts` says where a chunk is cut into frames, and `Splicer` says where the unchanged
tensors' references go; `RankFileWriter` ties them to the pool and the data file.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import xxhash

from asyncckpt.format.encoding import Encoded, FrameEncoder
from asyncckpt.format.layout import CUT_BYTES, TensorSpec
from asyncckpt.format.records import Frame, RankPart, Ref
from asyncckpt.writer.autocodec import CodecChooser
from asyncckpt.writer.dedup import MIN_BYTES, Target
from asyncckpt.writer.filespec import (
    NO_REUSE,
    FileSettings,
    FileTarget,
    Reuse,
    Stream,
    Unchanged,
)

Done = Callable[[], None]


class Piece(NamedTuple):
    """One frame of the file: its raw length, its stored bytes encoded here or a committed
    frame to reference, and its xxh3_128 (incremental saves, else None)."""

    raw_length: int
    stored: Encoded | Target
    xxh3_128: int | None


class _Ready(NamedTuple):
    """A submitted chunk, waiting for its turn to be appended."""

    pieces: list[Piece] | None  # None: dropped (an error, or closing)
    raw_length: int
    done: Done | None           # still to call once written (the pieces alias it)
    seconds: float                    # spent encoding
    pooled: bool                      # holds a pool credit


class _Order:
    """Chunks numbered as submitted, finished in any order, handed to the one appender
    strictly in number order. `cond` guards the writer's counters too."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.pending = 0   # numbered, not yet written or dropped
        self.closing = False
        self._issued = 0
        self._next = 0     # the number the appender takes next
        self._ready: dict[int, _Ready] = {}

    def issue(self) -> int:
        """A number for the next chunk (counted pending until `finished`)."""
        with self.cond:
            index = self._issued
            self._issued += 1
            self.pending += 1
            return index

    def put(self, index: int, item: _Ready) -> None:
        with self.cond:
            self._ready[index] = item
            if index == self._next:
                self.cond.notify_all()

    def take(self) -> _Ready | None:
        """The next chunk in order, waiting for it; None once closing with none pending."""
        with self.cond:
            while self._next not in self._ready and not (self.closing and not self.pending):
                self.cond.wait()
            item = self._ready.pop(self._next, None)
            if item is not None:
                self._next += 1
            return item

    def finished(self) -> None:
        with self.cond:
            self.pending -= 1
            if self.pending == 0:
                self.cond.notify_all()

    def wait_idle(self) -> None:
        with self.cond:
            while self.pending:
                self.cond.wait()

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()


class Cuts:
    """Where frames are cut inside a chunk: nowhere, or (incremental) at the start and
    end of every tensor of at least `CUT_BYTES`."""

    def __init__(self, tensors: list[TensorSpec], incremental: bool) -> None:
        self._at = sorted({x for t in tensors if t.end - t.begin >= CUT_BYTES
                           for x in (t.begin, t.end)}) if incremental else []

    def within(self, begin: int, end: int) -> list[tuple[int, int]]:
        """Stream bytes `begin`..`end` as (begin, end) per frame."""
        cuts = self._at[bisect.bisect_right(self._at, begin):bisect.bisect_left(self._at, end)]
        return list(zip([begin, *cuts], [*cuts, end]))


class Splicer:
    """The unchanged tensors a rank does not send: where their frames go in the stream.

    Args:
        unchanged: the stream offset of each such tensor -> its frames in a committed step.
    """

    def __init__(self, unchanged: dict[int, Unchanged]) -> None:
        self._at = {offset: [(n, t, w) for n, t, w in frames]
                    for offset, frames in unchanged.items()}

    def runs(self, position: int, length: int) -> tuple[list[tuple[int, int]], int]:
        """Where `length` bytes sent at stream `position` go: (start in the chunk, length)
        per run of the stream between unchanged tensors, and the stream position after
        them and the unchanged tensors they reach (for the caller's bound check)."""
        runs, start = [], 0
        upcoming = sorted(o for o in self._at if o >= position)
        while True:
            while upcoming and upcoming[0] == position:
                position += sum(n for n, _, _ in self._at[upcoming.pop(0)])
            if start == length:
                break
            take = min(length - start, (upcoming[0] if upcoming else 1 << 62) - position)
            runs.append((start, take))
            start += take
            position += take
        return runs, position

    def take(self, position: int) -> list[Piece] | None:
        """The frames of the unchanged tensor at stream `position`, once, as references."""
        frames = self._at.pop(position, None)
        return None if frames is None else [Piece(n, t, w) for n, t, w in frames]


class RankFileWriter:
    """Appends the frames of one rank's stream to its data file in a tmp directory.

    `submit` may be called from one thread (the rank's session) while pool threads
    encode and write; `finish` and `wait_idle` block until every submitted frame is
    written or dropped. The header is cut into frames of at most `stream.max_frame`
    bytes, the bound every reader applies.
    """

    def __init__(self, settings: FileSettings, target: FileTarget, stream: Stream, *,
                 reuse: Reuse = NO_REUSE, chooser: CodecChooser | None = None,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        """Args:
            settings: the writer's (FileSettings).
            target: the file's rank, codec and place (FileTarget).
            stream: its header, tensor table and largest frame (Stream).
            reuse: committed frames to reference (incremental, skip_unchanged).
            chooser: codec "auto"'s chooser.
            on_error: called once, from any thread, with the first error.
        Raises:
            OSError: the file cannot be made.
        """
        rank, codec, tensors, header = target.rank, target.codec, stream.tensors, stream.header
        self.rank = rank
        self.codec = codec
        self.name = target.name
        self.path = target.directory / self.name
        self.expected_size = tensors[-1].end if tensors else len(header)
        self._encoder = FrameEncoder(codec, settings.level, tensors, chooser=chooser)
        self._tensors = tensors
        self._incremental = settings.incremental
        self._lookup = reuse.lookup
        self._data_begin = tensors[0].begin if tensors else self.expected_size
        self._cuts = Cuts(tensors, settings.incremental)
        self._splicer = Splicer(reuse.unchanged)
        self.new_bytes = 0          # raw bytes of frames written to the file
        self.referenced_bytes = 0   # raw bytes of frames stored as references
        self._pool = settings.pool
        self._on_error = on_error
        self._order = _Order()
        self._raw_submitted = 0    # bytes
        self.error: BaseException | None = None
        self._frames: list[Frame] = []
        self._raw_size = 0
        self._stored_size = 0
        self.encode_seconds = 0.0
        self.write_seconds = 0.0
        self._file = settings.storage.create_data_file(
            target.directory, self.name, settings.flush_bytes, settings.writeback)
        self._appender: threading.Thread | None = None  # the thread appending, once it runs
        self._file_closed = threading.Event()
        settings.appenders.run(self._append_loop)
        for start in range(0, len(header), stream.max_frame):
            self.submit(memoryview(header)[start:start + stream.max_frame])

    @property
    def raw_size(self) -> int:
        return self._raw_size

    @property
    def stored_size(self) -> int:
        return self._stored_size

    # -- submitting (the session's thread) ---------------------------------------------

    def submit(self, raw: memoryview, done: Done | None = None) -> None:
        """Queue `raw` as the next bytes of the stream (one frame, or several around the
        unchanged tensors it skips over); `done()` is called (from any thread) once `raw`
        is no longer needed. Blocks while the pool has no free frame credit.

        Raises:
            ValueError: more bytes than the stream's layout allows (nothing is queued;
                `done` is not called).
        """
        runs, end = self._splicer.runs(self._raw_submitted, len(raw))
        if end > self.expected_size:
            raise ValueError(f"rank {self.rank} sent bytes up to {end}, its tensors "
                             f"hold {self.expected_size}")
        if len(runs) > 1 and done is not None:
            done = _after(len(runs), done)
        for start, length in runs or [(0, 0)]:
            self._splice_unchanged()
            self._submit_frame(raw[start:start + length], done)
        self._splice_unchanged()

    def _splice_unchanged(self) -> None:
        """Queue the references of the unchanged tensor the stream has reached, if any."""
        while (pieces := self._splicer.take(self._raw_submitted)) is not None:
            length = sum(p.raw_length for p in pieces)
            with self._order.cond:
                index = self._order.issue()
                self._raw_submitted += length
                self._order.put(index, _Ready(pieces, length, None, 0.0, False))

    def _submit_frame(self, raw: memoryview, done: Done | None) -> None:
        with self._order.cond:
            if self._raw_submitted + len(raw) > self.expected_size:
                raise ValueError(f"rank {self.rank} sent {self._raw_submitted + len(raw)} bytes, "
                                 f"its tensors hold {self.expected_size}")
            if not len(raw):
                if done:
                    done()
                return
            index, offset = self._order.issue(), self._raw_submitted
            self._raw_submitted += len(raw)

        self._pool.submit(lambda context: self._encode(index, offset, raw, done, context))

    # -- encoding (pool threads) -------------------------------------------------------

    def _encode(self, index: int, offset: int, raw: memoryview, done: Done | None,
                context: dict) -> None:
        pieces, seconds, raw_length = None, 0.0, len(raw)
        if self.error is None and not self._order.closing:
            start = time.perf_counter()
            try:
                pieces = self._pieces(offset, raw, context)
            except Exception as e:  # a codec bug must fail the save, not hang it
                self._set_error(e)
            seconds = time.perf_counter() - start
        if done is not None and (pieces is None or not any(
                isinstance(p.stored, Encoded) and p.stored.aliases_raw for p in pieces)):
            done()  # the slot is free for the rank while this frame waits its turn
            done = None
        self._order.put(index, _Ready(pieces, raw_length, done, seconds, True))

    def _pieces(self, offset: int, raw: memoryview, context: dict) -> list[Piece]:
        """Per frame of the chunk (`Cuts`): a committed frame to reference, or the frame
        encoded."""
        out: list[Piece] = []
        for lo, hi in self._cuts.within(offset, offset + len(raw)):
            piece = raw[lo - offset:hi - offset]
            xxh3_128 = xxhash.xxh3_128_intdigest(piece) if self._incremental else None
            target = None
            if (xxh3_128 is not None and self._lookup is not None and len(piece) >= MIN_BYTES
                    and lo >= self._data_begin):  # never the header (dedup.py)
                target = self._lookup(xxh3_128, len(piece))
            out.append(Piece(len(piece), target if target is not None
                             else self._encoder.encode(lo, piece, context), xxh3_128))
        return out

    # -- appending (the appender thread) -----------------------------------------------

    def _append_loop(self) -> None:
        """The appender (a thread of `settings.appenders`): write frames in order until
        closed and drained, then close the file."""
        self._appender = threading.current_thread()
        try:
            self._append_all()
        finally:
            try:
                self._file.close()
            finally:
                self._file_closed.set()

    def _append_all(self) -> None:
        while (item := self._order.take()) is not None:
            try:
                if item.pieces is not None and self.error is None and not self._order.closing:
                    for piece in item.pieces:
                        if isinstance(piece.stored, Encoded):
                            self._write(piece.stored, piece.raw_length, piece.xxh3_128)
                        else:
                            self._reference(piece.stored, piece.raw_length, piece.xxh3_128)
            except Exception as e:
                self._set_error(e)
            finally:
                if item.done is not None:
                    item.done()
                if item.pooled:
                    self._pool.release()
                with self._order.cond:
                    self.encode_seconds += item.seconds
                    self._order.finished()

    def _reference(self, target: Target, raw_length: int, xxh3_128: int | None) -> None:
        self._frames.append(Frame(self._raw_size, raw_length, self._stored_size, 0,
                                  target.codec, target.xxh3_raw, target.xxh3_stored,
                                  target.layout, xxh3_128,
                                  Ref(target.step, target.file, target.offset, target.length)))
        self._raw_size += raw_length
        self.referenced_bytes += raw_length

    def _write(self, encoded: Encoded, raw_length: int, xxh3_128: int | None = None) -> None:
        start = time.perf_counter()
        self._file.append([memoryview(piece) for piece in encoded.pieces])
        self._frames.append(Frame(self._raw_size, raw_length, self._stored_size,
                                  encoded.stored_length, encoded.codec, encoded.xxh3_raw,
                                  encoded.xxh3_stored, encoded.layout, xxh3_128))
        self._raw_size += raw_length
        self.new_bytes += raw_length
        self._stored_size += encoded.stored_length
        self.write_seconds += time.perf_counter() - start

    def _set_error(self, error: BaseException) -> None:
        with self._order.cond:
            first = self.error is None
            if first:
                self.error = error
        if first and self._on_error is not None:
            self._on_error(error)

    # -- ending ------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Frames submitted and not yet written or dropped."""
        return self._order.pending > 0

    def wait_idle(self) -> None:
        """Block until every submitted frame is written or dropped."""
        self._order.wait_idle()

    def finish(self, tree: object) -> RankPart:
        """Wait for the frames in flight, make the file durable and close it; return this
        rank's manifest part.

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
        self._file.sync()
        self.write_seconds += time.perf_counter() - start
        self.close(wait=True)
        return RankPart(self.rank, self.name, self.codec, self._raw_size,
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
        self._order.close()
        if wait and threading.current_thread() is not self._appender:
            self._file_closed.wait()


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
