"""Reading checkpoints back: every byte checked before it is returned.

This is the low level: verified access to one rank's data file, given a manifest that
`checkpoint.Checkpoint` has already read and checked (the one place that does). The
manifest is the only thing trusted, and only after its own checksum and field checks
pass. Data files are opened by the names the manifest's rules allow, never by a
path it could aim elsewhere, must have exactly the stored size it declares, and each
frame is verified twice: the stored bytes against their xxh3 before decoding (so a
decoder never sees corrupt input), the decoded bytes against theirs after. Frames that
lie inside one tensor decode straight into the tensor's memory; frames shared by small
tensors decode once into a one-frame scratch buffer.

A reference frame (incremental saves) is read from the data file of an older step of
the same root, named by (step, file name) in the manifest and opened here as
ROOT/step-N/NAME or ROOT/step-N.retired/NAME (NAME may be in a node directory of a step
saved in parts): the step directory is opened without following a symlink and the file
relative to it, and a node directory that is a symlink is refused, so no reference leads
outside the root. Its bytes are verified against *this* manifest's checksums, like its own.

Speed: past the disk, a load pays three CPU costs per byte -- the kernel's copy out of
the page cache (the price of reading into the caller's memory rather than returning a
mapping of the file that could change after it was verified), the first touch of fresh
tensor memory, and xxh3 -- spread over the frame threads while the kernel's own
read-ahead keeps the disk busy. First touch is the dear one on a virtual machine:
reading from the page cache into fresh memory took several times as long as into memory
touched before, populating it first in one madvise hardly helped, and the cost is about
the disk's own time for those bytes (docs/design/loading.md), so loads into new tensors
trail `safetensors.load_file` (which maps the cached pages instead of copying them)
where the disk is fast, and `load(into=...)` into existing tensors, as a job resuming
into its model has, does not pay it. Asking for a sliding window ahead of the frames
(posix_fadvise WILLNEED) measured no better than that read-ahead here, so a load asks
only for its first window, while Python still plans which bytes go where. Fresh tensors
are plain `torch.empty`: advising 2 MiB pages (MADV_HUGEPAGE) made first touch much
cheaper in half the runs and dearer in the other half on this virtual machine (fresh
huge pages stall on the host), and may compact memory on a fragmented one, so a
restart's load does not gamble on it. From an object store the round trip per request is
the dear part: frames back to back are read by one ranged GET, several in flight, each
frame verified as its bytes arrive (read/fanout.py).
"""

from __future__ import annotations

import ctypes
import errno
from collections.abc import Callable
from typing import TYPE_CHECKING

import xxhash

from asyncckpt.codec.registry import make_codec, xxh3_of
from asyncckpt.config import ReadLimits
from asyncckpt.errors import CheckpointError, CorruptCheckpointError
from asyncckpt.format.layout import layout, retired_dir_name, step_dir_name
from asyncckpt.format.manifest import Manifest
from asyncckpt.format.records import Frame, RankPart, Ref
from asyncckpt.read.fanout import Job, Unit, frame_at, load_pool, plan, run_parallel, units
from asyncckpt.runtime.pool import FramePool
from asyncckpt.storage.base import CheckpointDir, ReadFile, Storage
from asyncckpt.storage.handles import RangeReader
from asyncckpt.storage.location import is_link, storage_for
from asyncckpt.storage.paths import Location

if TYPE_CHECKING:
    import torch


class RankReader:
    """Verified access to one rank's data file. Not thread-safe (its methods use one
    set of codecs and buffers), but `read_ranges` fans out to `threads` threads.
    Files are opened through `storage` (default: the root holding `directory`),
    its own data file through `files` if given (the directory as its manifest was read
    from it: see checkpoint.py)."""

    def __init__(self, directory: Location, manifest: Manifest, rank: int,
                 threads: int | None = None, pool: FramePool | None = None,
                 storage: Storage | None = None, files: CheckpointDir | None = None) -> None:
        storage = storage or storage_for(directory.parent)
        self.part: RankPart = manifest.ranks[rank]
        self.step = manifest.step
        self.rank = rank
        self.path = directory / self.part.file
        self._scratch: dict = {}  # codecs (a file may mix them) and buffers, one thread
        self.threads = ReadLimits.from_env().read_threads if threads is None else threads
        # frame threads: `pool` if shared (their scratch then serves every reader of the
        # set, so memory does not grow with the ranks read), else started on first use
        self._pool = pool
        self._own_pool = pool is None
        self._header: bytes | None = None
        self._file: ReadFile | None = None
        try:
            self._file = (files.open(self.part.file) if files is not None
                          else storage.open_file(directory, self.part.file))
        except OSError as e:
            raise self._corrupt(f"cannot open data file: {e.strerror}") from None
        if not self._file.regular or self._file.size != self.part.stored_size:
            size = self._file.size
            self.close()
            raise self._corrupt(f"data file has {size} bytes, manifest says "
                                f"{self.part.stored_size}")
        self._ref_files: dict[tuple[int, str], ReadFile] = {}
        try:
            for (step, name), end in referenced_files(self.part).items():
                opened = open_referenced(storage, step, name, self._corrupt)
                self._ref_files[(step, name)] = opened
                if opened.size < end:
                    raise self._corrupt(f"referenced {name} of step {step} has {opened.size} "
                                        f"bytes, frames reference up to byte {end}")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._pool is not None and self._own_pool:
            self._pool.close()
        self._pool = None
        if self._file is not None:
            self._file.close()
            self._file = None
        for opened in getattr(self, "_ref_files", {}).values():
            opened.close()
        self._ref_files = {}

    def __enter__(self) -> RankReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_frame_into(self, index: int, out: memoryview | list[memoryview],
                        tensor: str | None = None, scratch: dict | None = None,
                        stream: RangeReader | None = None) -> None:
        """Read, verify and decode frame `index` into `out`: one view, or consecutive
        views that together hold exactly its raw bytes (the tensors it spans).

        `scratch` holds the calling thread's codecs and buffers (default: this
        reader's own, for one thread at a time). `stream`: a range of the file whose
        next bytes are this frame's stored bytes (a coalesced request), else the frame
        is read at its own offset.

        Raises:
            CorruptCheckpointError: short read, checksum mismatch, or undecodable frame
                (or its object deleted while it was read).
            CheckpointError: the read itself failed (the store's error, after its
                retries), naming the frame; nothing unverified was returned.
        """
        frame = self.part.frames[index]
        outs = out if isinstance(out, list) else [out]
        if frame.codec == "raw" and len(outs) <= _MAX_IOV:
            self._preadv(frame, index, outs, tensor, stream)  # straight into place, no copy
            self._check(frame, index, "raw", xxh3_of(outs), tensor)
            return
        scratch = self._scratch if scratch is None else scratch
        stored = scratch_buffer(scratch, "stored", frame.encoded_length)
        self._preadv(frame, index, [stored], tensor, stream)
        self._check(frame, index, "stored", xxhash.xxh3_64_intdigest(stored), tensor)
        codec = scratch.get(("codec", frame.codec))
        if codec is None:
            codec = scratch[("codec", frame.codec)] = make_codec(frame.codec)
        try:
            codec.decode_into(stored, outs, frame.layout)
        except CorruptCheckpointError as e:
            raise self._corrupt(f"frame {index}: {e.cause}", tensor, frame) from None
        self._check(frame, index, "raw", xxh3_of(outs), tensor)

    def check_frames(self, on_frame: Callable[[Frame], None] | None = None,
                     seen: set | None = None) -> None:
        """Read and verify every frame (into scratch), calling `on_frame` after each, in
        order; frames back to back through one request where the file asks for it.

        `seen` (shared across checkpoints by `verify ROOT`): stored byte ranges already
        verified under the same codec and checksums; those are skipped, and the ones
        verified here are added.
        """
        frames = self.part.frames
        todo: list[Job] = [(i, [f.raw_length], None) for i, f in enumerate(frames)
                           if seen is None or self.range_key(f) not in seen]
        told = 0

        def verified(index: int) -> None:  # and every frame before it verified or skipped
            nonlocal told
            if seen is not None:
                seen.add(self.range_key(frames[index]))
            while told <= index:
                if on_frame:
                    on_frame(frames[told])
                told += 1
        for unit in units(todo, frames, self._where, _MAX_IOV):
            self._run_unit(unit, self._scratch, after=verified)
        if frames:
            verified(len(frames) - 1)

    def range_key(self, frame: Frame) -> tuple:
        """Identifies the bytes a frame stands for: where they are and what they must
        check as."""
        return (*self.stored_at(frame), frame.raw_length, frame.codec, frame.layout,
                frame.xxh3_stored, frame.xxh3_raw)

    def read_stored(self, index: int, scratch: dict | None = None) -> memoryview:
        """Frame `index`'s stored bytes (its own or referenced), verified: the stored
        checksum, and the raw one after decoding. Valid until the next call with the
        same scratch.

        Raises:
            CorruptCheckpointError: as `read_frame_into`.
        """
        frame = self.part.frames[index]
        scratch = self._scratch if scratch is None else scratch
        self.read_frame_into(index, scratch_buffer(scratch, "gap", frame.raw_length), None, scratch)
        if frame.codec == "raw":
            return scratch_buffer(scratch, "gap", frame.raw_length)
        return scratch_buffer(scratch, "stored", frame.encoded_length)

    def read_ranges(self, ranges: list[tuple[int, int, memoryview, str | None]]) -> None:
        """Fill each (begin, end, out, tensor name) with raw stream bytes begin..end.

        Ranges must be sorted and disjoint. Every frame touched is read and verified
        once, scattered straight into the outputs it spans; bytes of a frame that no
        range wants land in a reused scratch buffer. With `threads` > 1 frames are read,
        verified and decoded on that many threads (preadv, xxh3, zstd and numpy release
        the GIL), each into its own part of the outputs. Frames back to back in a file
        that asks for it (an object store: `ReadFile.request_bytes`) are read through
        one request per unit (read/fanout.py), each verified as soon as it is in.
        """
        frames = self.part.frames
        work = units(plan(frames, ranges), frames, self._where, _MAX_IOV, self.threads)
        if self.threads <= 1 or len(work) <= 1:
            for unit in work:
                self._run_unit(unit, self._scratch)
            return
        if self._pool is None:
            self._pool = load_pool(self.threads)
        run_parallel(self._pool, work, self._run_unit)

    def _run_unit(self, unit: Unit, scratch: dict, stopped: Callable[[], bool] = lambda: False,
                  after: Callable[[int], None] | None = None) -> None:
        """Read, verify and decode the frames of `unit`: one frame at its own offset, or
        several through one range of the file (stopping early once `stopped()`);
        `after(index)` once each frame is verified."""
        if len(unit) == 1:
            self._run(unit[0], scratch)
            if after:
                after(unit[0][0])
            return
        frames = self.part.frames
        file, offset = self._where(frames[unit[0][0]])
        length = sum(frames[index].encoded_length for index, _, _ in unit)
        with file.open_range(offset, length) as stream:
            for job in unit:
                if stopped():
                    return
                self._run(job, scratch, stream)
                if after:
                    after(job[0])

    def _run(self, job: Job, scratch: dict, stream: RangeReader | None = None) -> None:
        index, pieces, name = job
        gap = scratch_buffer(scratch, "gap", self.part.frames[index].raw_length)
        outs, pos = [], 0
        for piece in pieces:
            if isinstance(piece, int):
                outs.append(gap[pos:pos + piece])
                pos += piece
            else:
                outs.append(piece)
        self.read_frame_into(index, outs, name, scratch, stream)

    def read_range(self, begin: int, end: int, out: memoryview, tensor: str | None = None) -> None:
        """Fill `out` with raw stream bytes `begin`..`end`, verifying every frame touched."""
        self.read_ranges([(begin, end, out, tensor)])

    def expected_header(self) -> bytes:
        """The safetensors header the manifest's tensor table implies (computed once)."""
        if self._header is None:
            header, _ = layout((t.name, t.dtype, t.shape) for t in self.part.tensors)
            end = self.part.tensors[0].begin if self.part.tensors else self.part.raw_size
            if end != len(header):
                raise self._corrupt(f"tensors start at byte {end}, "
                                    f"the header ends at {len(header)}")
            self._header = header
        return self._header

    def check_header(self, header: bytes | bytearray | None = None) -> None:
        """Check the stream's safetensors header (read and verified here unless given)
        is exactly the one the manifest implies, so dtypes, shapes and offsets agree.

        Raises:
            CorruptCheckpointError: it differs.
        """
        expected = self.expected_header()
        if header is None:
            header = bytearray(len(expected))
            self.read_range(0, len(expected), memoryview(header))
        if header != expected:
            raise self._corrupt("safetensors header differs from the manifest's tensor table")

    def _buffer(self, kind: str, size: int) -> memoryview:
        """A reused scratch buffer of at least `size` bytes (one per kind)."""
        return scratch_buffer(self._scratch, kind, size)

    def prefetch(self, begin: int, end: int) -> None:
        """Ask the kernel to start reading the stored bytes of the frames that hold raw
        stream bytes `begin`..`end` (posix_fadvise WILLNEED, own file or referenced).

        Advice only: it returns once the reads are queued, so the disk works while the
        caller plans what to read; nothing is verified here (the reads that follow are).
        """
        frames = self.part.frames
        if not frames or end <= begin:
            return
        spans: list[list] = []  # [file, first byte, end], contiguous frames merged
        for frame in frames[frame_at(frames, begin):]:
            if frame.raw_offset >= end:
                break
            file, offset = self._where(frame)
            if spans and spans[-1][0] is file and spans[-1][2] == offset:
                spans[-1][2] = offset + frame.encoded_length
            else:
                spans.append([file, offset, offset + frame.encoded_length])
        for file, lo, hi in spans:
            try:
                file.will_need(lo, hi - lo)
            except OSError:
                return

    def _where(self, frame: Frame) -> tuple[ReadFile, int]:
        """(file, offset) of a frame's stored bytes: this step's file or the referenced one."""
        if frame.ref is not None:
            return self._ref_files[(frame.ref.step, frame.ref.file)], frame.ref.offset
        assert self._file is not None
        return self._file, frame.stored_offset

    def _preadv(self, frame: Frame, index: int, outs: list[memoryview], tensor: str | None,
                stream: RangeReader | None = None) -> None:
        file, offset = self._where(frame)
        outs = [o for o in outs if len(o)]
        try:
            while outs:
                n = stream.read_into(outs) if stream is not None else file.read_into(offset, outs)
                if n == 0:
                    raise self._corrupt(f"frame {index}: file ends early", tensor, frame)
                offset += n
                while outs and n >= len(outs[0]):
                    n -= len(outs[0])
                    outs.pop(0)
                if n:
                    outs[0] = outs[0][n:]
        except CheckpointError:
            raise
        except OSError as e:
            raise self._read_failed(e, index, tensor, frame) from None

    def _read_failed(self, e: OSError, index: int, tensor: str | None,
                     frame: Frame) -> CheckpointError:
        """The error for a read of frame `index` that failed: its object gone (a step
        replaced or deleted under the load: corrupt, which a load retries once the step
        was swapped), or the store's own failure."""
        span = (f"frame {index} (raw bytes {frame.raw_offset}.."
                f"{frame.raw_offset + frame.raw_length})")
        if e.errno == errno.ENOENT:
            return self._corrupt(f"{span}: deleted while it was read ({e.strerror or e})",
                                 tensor, frame)
        where = f" (tensor {tensor!r})" if tensor else ""
        return CheckpointError(f"{span}: reading it failed: {e.strerror or e}{where}",
                               step=self.step, rank=self.rank, file=self.part.file,
                               stored_at=self.stored_at(frame))

    def _check(self, frame: Frame, index: int, which: str, actual: int, tensor: str | None) -> None:
        expected = frame.xxh3_raw if which == "raw" else frame.xxh3_stored
        if actual != expected:
            raise self._corrupt(
                f"frame {index} (raw bytes {frame.raw_offset}.."
                f"{frame.raw_offset + frame.raw_length}"
                f"): xxh3 of {which} bytes mismatch (manifest {expected:016x}, file "
                f"{actual:016x})", tensor, frame)

    def _corrupt(self, cause: str, tensor: str | None = None,
                 frame: Frame | None = None) -> CorruptCheckpointError:
        """The error for this rank's data; with `frame`, it says where the frame's stored
        bytes lie when another step's file holds them, and keeps that place as
        `detail["stored_at"]` (a `Ref`: whoever shares those bytes shares the damage)."""
        where = f" (tensor {tensor!r})" if tensor else ""
        if frame is not None and frame.ref is not None:
            where += (f"; its bytes are stored in {frame.ref.file} of step {frame.ref.step} at "
                      f"{frame.ref.offset}..{frame.ref.offset + frame.ref.length} (referenced)")
        detail = {} if frame is None else {"stored_at": self.stored_at(frame)}
        return CorruptCheckpointError(cause + where, step=self.step, rank=self.rank,
                                      file=self.part.file, **detail)

    def stored_at(self, frame: Frame) -> Ref:
        """Where `frame`'s stored bytes are: this step's file, or the referenced one."""
        return frame.ref or Ref(self.step, self.part.file, frame.stored_offset,
                                frame.stored_length)


class Readers:
    """The RankReaders of one checkpoint, each opened (and its header checked) on first
    use and all closed together: `readers(rank)`. They share one pool of frame threads."""

    def __init__(self, directory: Location, manifest: Manifest, threads: int,
                 storage: Storage | None = None, files: CheckpointDir | None = None) -> None:
        self._directory, self._manifest = directory, manifest
        self._storage, self._files = storage, files
        self._open: dict[int, RankReader] = {}
        self._threads = threads
        self._pool = load_pool(self._threads) if self._threads > 1 else None

    def __call__(self, rank: int, prefetch: int = 0) -> RankReader:
        """Rank `rank`'s reader; when this opens it, the first `prefetch` raw bytes of
        its stream are asked for (`RankReader.prefetch`) before its header is read."""
        if rank not in self._open:
            reader = RankReader(self._directory, self._manifest, rank, self._threads,
                                self._pool, self._storage, self._files)
            self._open[rank] = reader
            reader.prefetch(0, prefetch)
            reader.check_header()
        return self._open[rank]

    def close(self) -> None:
        for reader in self._open.values():
            reader.close()
        self._open.clear()
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> Readers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_MAX_IOV = 512  # frames spanning more tensors than this are read via scratch
# what a whole-rank load asks the kernel for before it plans, so the disk works meanwhile
READ_AHEAD = 64 << 20


def referenced_files(part: RankPart) -> dict[tuple[int, str], int]:
    """(step, file name) -> the end of the last byte range rank `part` references there."""
    ends: dict[tuple[int, str], int] = {}
    for f in part.frames:
        if f.ref is not None:
            key = (f.ref.step, f.ref.file)
            ends[key] = max(ends.get(key, 0), f.ref.offset + f.ref.length)
    return ends


def open_referenced(storage: Storage, step: int, name: str,
                    corrupt: Callable[[str], CorruptCheckpointError]) -> ReadFile:
    """Open data file `name` of step `step` of the root for reading, under the one rule
    of what a step directory is (storage/posix.py: no symlinks, a regular file).

    Raises:
        CorruptCheckpointError: (made by `corrupt`) it is in neither place.
    """
    if "/" in name:  # in a node directory, which must be one, not a link out
        node = name.split("/", 1)[0]
        for directory in (step_dir_name(step), retired_dir_name(step)):
            if is_link(storage.root / directory / node):
                raise corrupt(f"references {name} of step {step}, whose {node} in {directory} "
                              "is a symlink, not a directory of the step")
    opened = storage.open_step_file(step, name)
    if opened is None:
        raise corrupt(f"references {name} of step {step}, which is not in {storage.root} ("
                      "deleted, "
                      "linked from elsewhere, or this checkpoint was moved without the steps "
                      "it references: `asyncckpt copy` writes a self-contained one)")
    return opened


def scratch_buffer(scratch: dict, kind: str, size: int) -> memoryview:
    """A reused buffer of at least `size` bytes from `scratch` (one per kind)."""
    buf = scratch.get(kind)
    if buf is None or len(buf) < size:
        buf = scratch[kind] = bytearray(size)
    return memoryview(buf)[:size]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no numpy needed).

    The view does not keep `t` alive: use it only while `t` is referenced.
    """
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
