"""Writing an export's safetensors shards: the next bytes are read while the last are
written, in bounded memory, without flooding the page cache.

An export is disk-bound when done right: each byte is read (and verified) once and
written once. Done one tensor after the other, the disk idles while a tensor is
verified and converted, and the reads wait while it is written (measured on a 2 GiB
model: 4.2 s reading then 4.0 s writing, no overlap). So a reader thread reads,
verifies and converts the next bytes while the calling thread writes the previous
ones; both spend their time in the kernel or in C (preadv, decompression, hashing,
`write`) with the GIL released.

Neither side ever holds a whole tensor. A shard's bytes are each tensor's bytes in
row-major order, so an exported tensor is cut into slabs: boxes of it that are
contiguous in that order (rows of it, or parts of a row of a larger one), of
`SLAB_BYTES` at most, filled in the exported dtype by the same box reads that reshard
a load (a sharded tensor's slab gathers its rows from every rank's box; a converted
one passes its stored values through temporaries of `CONVERT_TEMP`), written, and
dropped. Small tensors share one read, a batch of up to `SLAB_BYTES` of them. The
read-ahead holds two batches at most, one being written while the next is read, so
an export's memory is twice the smaller of a slab and the largest tensor, plus the
temporaries and the frame threads' scratch: flat in tensor and model size alike (it
was two whole tensors plus temporaries, 2.4-3.5 x the largest). A view of a stored
tensor (a leaf that is part of another's memory) is the exception: it is read whole,
with its base, and alone.

Each shard is written as `.name.tmp-<hex>`, fsynced, and renamed into place, so a shard
name in the output is always a whole shard (what lets several processes or hosts share
one export: whoever sees every share done writes the index, see export.py). Its
pages are written back and dropped window by window (storage/writeback.py), as the
writer does with data files, so a 280 GB export does not fill the page cache.
"""

from __future__ import annotations

import math
import os
import queue
import secrets
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncckpt.format.layout import element_size, layout
from asyncckpt.read.checkpoint import Checkpoint, Leaf
from asyncckpt.read.reader import tensor_bytes
from asyncckpt.runtime import faults
from asyncckpt.storage.durable import fsync_path
from asyncckpt.storage.writeback import Writeback
from asyncckpt.torchutil.dtypes import DTYPES

WRITE_CHUNK = 16 << 20  # bytes per write call: the writeback window sees each one
CONVERT_TEMP = 16 << 20  # stored bytes a read's temporaries (conversion, gathering) hold
SLAB_BYTES = 16 << 20  # exported bytes one read fills at most: the read-ahead holds two

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape) of a box of a tensor


@dataclass
class Item:
    """One exported tensor: its name in the output, the dtype written, its leaf."""
    export_name: str
    dtype: str
    leaf: Leaf

    @property
    def shape(self) -> tuple[int, ...]:
        return self.leaf.shape

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return element_size(self.dtype) * n


Piece = tuple[Item, torch.Tensor, bool, list[torch.Tensor]]  # see `_read_ahead`
Written = tuple[Item, torch.Tensor, bool]  # (item, its next bytes, its last)


class _Buffers:
    """The read-ahead's memory: `count` buffers of `size` bytes, each made when first
    taken and reused after (a new tensor per read lets glibc's adaptive mmap threshold
    keep the freed ones in its heap, which then grows with the export)."""

    def __init__(self, size: int, count: int = 2) -> None:
        self.size = size
        self._unmade = count
        self._free: list[torch.Tensor] = []
        self._cond = threading.Condition()
        self._closed = False

    def take(self) -> torch.Tensor | None:
        """A free buffer, once one is; None once closed."""
        with self._cond:
            while not self._closed and not self._free and not self._unmade:
                self._cond.wait()
            if self._closed:
                return None
            if self._free:
                return self._free.pop()
            self._unmade -= 1
        return torch.empty(self.size, dtype=torch.uint8)

    def give(self, buffer: torch.Tensor) -> None:
        with self._cond:
            self._free.append(buffer)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def batch_for(items: list[Item]) -> int:
    """Exported bytes one read fills at most: a slab (`SLAB_BYTES`), or less when every
    tensor is smaller (so that a small model's export holds no more than two of them);
    one element at least."""
    largest = max((i.nbytes for i in items), default=0)
    return max(min(SLAB_BYTES, largest), *(element_size(i.dtype) for i in items), 1)


def slabs(shape: tuple[int, ...], itemsize: int, limit: int) -> list[Box]:
    """Boxes tiling `shape` in row-major order, each contiguous in it and of `limit`
    bytes at most (one element at least), of even sizes: blocks of rows, or of one
    row's elements, fixing the leading indices, where a row is larger than `limit`."""
    if not shape or 0 in shape:
        return [((0,) * len(shape), shape)]
    dim = next((d for d in range(len(shape)) if itemsize * math.prod(shape[d + 1:]) <= limit),
               len(shape) - 1)
    most = max(1, limit // (itemsize * math.prod(shape[dim + 1:])))
    parts = -(-shape[dim] // most)  # cut as evenly as can be: no sliver after a full slab
    cuts = [k * shape[dim] // parts for k in range(parts + 1)]
    tail = (0,) * (len(shape) - dim - 1)
    boxes = []
    for outer in _indices(shape[:dim]):
        for start, end in zip(cuts, cuts[1:]):
            boxes.append(((*outer, start, *tail), ((1,) * dim + (end - start,) + shape[dim + 1:])))
    return boxes


def _indices(shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Every index of `shape`, in row-major order (one, empty, for no dimensions)."""
    if not shape:
        yield ()
        return
    for first in range(shape[0]):
        for rest in _indices(shape[1:]):
            yield (first, *rest)


def write_shards(ckpt: Checkpoint, shards: list[tuple[str, list[Item]]], out: Path,
                 window: int, progress: Callable[[int], None] | None = None) -> None:
    """Write each (file name, items) of `shards` into directory `out`, reads ahead of
    writes; `progress(bytes)` after each tensor.

    Memory: two buffers of `batch_for(items)` bytes, `CONVERT_TEMP` of temporaries and
    the frame threads' scratch; a view of a stored tensor is read whole, with its base,
    while nothing else is held.

    Raises:
        CorruptCheckpointError: a tensor fails verification (the shard being written
            is removed; shards already renamed stay, each whole).
        OSError: a write failed (the same).
    """
    items = [item for _, shard in shards for item in shard]
    buffers = _Buffers(batch_for(items))
    ready: queue.Queue[Piece | BaseException | None] = queue.Queue()
    reader = threading.Thread(target=_read_ahead, args=(ckpt, items, buffers, ready),
                              name="asyncckpt-export-read", daemon=True)
    reader.start()
    try:
        got = iter(ready.get, None)
        for name, shard in shards:
            _write_one(out, name, shard, _pieces(got, len(shard), buffers), window, progress)
    finally:
        buffers.close()
        reader.join()


def _pieces(got: Iterator, count: int, buffers: _Buffers) -> Iterator[Written]:
    """The next `count` items' pieces, in order, each buffer given back once the last
    piece it holds is written."""
    while count:
        entry = next(got)
        if isinstance(entry, BaseException):
            raise entry
        item, piece, last, done = entry
        try:
            yield item, piece, last
        finally:
            del piece, entry
            for buffer in done:
                buffers.give(buffer)
        count -= last


def _read_ahead(ckpt: Checkpoint, items: list[Item], buffers: _Buffers,
                ready: queue.Queue) -> None:
    """Put every item's pieces on `ready` in order: (item, piece, whether the item's
    last, the buffers free once it is written). Pieces are slabs carved from one buffer
    until it is full, then read together (one pass over the frames they share)."""
    pending: list[Piece] = []
    plan = ckpt.plan(CONVERT_TEMP)
    buffer: torch.Tensor | None = None
    used = 0

    def flush() -> None:
        nonlocal buffer
        plan.flush()
        if pending and buffer is not None:
            item, piece, last, _ = pending[-1]
            pending[-1] = (item, piece, last, [buffer])
        for entry in pending:
            ready.put(entry)
        pending.clear()
        buffer = None
    try:
        for item in items:
            if item.leaf.view is not None:
                flush()
                both = [buffers.take(), buffers.take()]  # alone: nothing else is held
                if None in both:
                    return
                ready.put((item, _read_view(ckpt, item), True, both))
                continue
            dtype, size = DTYPES[item.dtype], element_size(item.dtype)
            boxes = slabs(item.shape, size, buffers.size)
            for k, (offsets, shape) in enumerate(boxes):
                nbytes = math.prod(shape) * size
                start = -(-used // _ALIGN) * _ALIGN
                if buffer is not None and start + nbytes > buffers.size:
                    flush()  # before waiting for the other buffer
                if nbytes and buffer is None:
                    buffer, start = buffers.take(), 0
                    if buffer is None:
                        return
                if nbytes and buffer is not None:
                    piece = buffer[start:start + nbytes].view(dtype).view(shape)
                    plan.add(item.leaf.tensor, offsets, piece)
                    used = start + nbytes
                else:
                    piece = torch.empty(shape, dtype=dtype)
                pending.append((item, piece, k == len(boxes) - 1, []))
        flush()
    except BaseException as e:  # noqa: BLE001 - handed to the writing thread, raised there
        ready.put(e)


_ALIGN = 64  # byte alignment of each piece in its buffer (any dtype may view it)


def _read_view(ckpt: Checkpoint, item: Item) -> torch.Tensor:
    """A view item whole: its base read, the view taken and converted (contiguous)."""
    assert item.leaf.view is not None
    base = ckpt.read_full(item.leaf.tensor)
    return item.leaf.view.of_tensor(base).to(DTYPES[item.dtype]).contiguous()


def _write_one(out: Path, name: str, shard: list[Item],
               pieces: Iterator[Written], window: int,
               progress: Callable[[int], None] | None) -> None:
    header, _ = layout((i.export_name, i.dtype, i.shape) for i in shard)
    tmp = out / f".{name}.tmp-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        writeback = Writeback(fd, window, path=tmp)
        end = _write_all(fd, memoryview(header), tmp, writeback, 0)
        for item, piece, last in pieces:
            if piece.numel():
                end = _write_all(fd, tensor_bytes(piece), tmp, writeback, end)
            del piece  # before the next is taken: the budget is what is held
            if last and progress:
                progress(item.nbytes)
        faults.io("fsync", tmp)
        os.fsync(fd)
        writeback.done()
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.rename(tmp, out / name)
    fsync_path(out)


def _write_all(fd: int, data: memoryview, path: Path, writeback: Writeback, end: int) -> int:
    for start in range(0, len(data), WRITE_CHUNK):
        view = data[start:start + WRITE_CHUNK]
        while view:
            faults.io("write", path)
            n = os.write(fd, view)
            view, end = view[n:], end + n
        writeback.written(end)
    return end
