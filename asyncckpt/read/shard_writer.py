"""Writing an export's safetensors shards: the next tensors are read while the last are
written, in bounded memory, without flooding the page cache.

An export is disk-bound when done right: each byte is read (and verified) once and
written once. Done one tensor after the other, the disk idles while a tensor is
verified and converted, and the reads wait while it is written (measured on a 2 GiB
model: 4.2 s reading then 4.0 s writing, no overlap). So a reader thread reads,
verifies and converts the next tensors while the calling thread writes the previous
ones; both spend their time in the kernel or in C (preadv, decompression, hashing,
`write`) with the GIL released. What the reader may hold ahead is bounded in bytes,
twice the largest tensor, never in tensors: memory stays flat in model size. A
tensor exported in another dtype is assembled straight in that dtype, its stored
values passing through temporaries of 16 MiB, so a bf16 export of an fp32 checkpoint
holds bf16 tensors only.

Each shard is written as `.name.tmp-<hex>`, fsynced, and renamed into place, so a shard
name in the output is always a whole shard (what lets several processes or hosts share
one export: whoever sees every share done writes the index, see export.py). Its
pages are written back and dropped window by window (storage/writeback.py), as the
writer does with data files, so a 280 GB export does not fill the page cache.
"""

from __future__ import annotations

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
CONVERT_TEMP = 16 << 20  # stored bytes a converting read holds at once, at most


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

    @property
    def converted(self) -> bool:
        return self.dtype != self.leaf.tensor.dtype

    @property
    def held(self) -> int:
        """Bytes held from its read until it is written: the exported tensor (a whole
        tensor converted as it is assembled, see `_read_ahead`); for a view of a
        converted tensor, its base in the stored dtype and the converted view beside it."""
        if self.converted and self.leaf.view is None:
            return self.nbytes
        source = element_size(self.leaf.tensor.dtype)
        for d in self.leaf.tensor.shape:
            source *= d
        return source + (self.nbytes if self.converted else 0)


class _Budget:
    """Bytes the read-ahead may hold. One request larger than the whole budget is let
    through when nothing else is held, so that no tensor can stall the export."""

    def __init__(self, capacity: int) -> None:
        self._capacity, self._used = capacity, 0
        self._cond = threading.Condition()
        self._closed = False

    def acquire(self, n: int) -> bool:
        """Wait until `n` bytes fit; False once closed."""
        with self._cond:
            while not self._closed and self._used and self._used + n > self._capacity:
                self._cond.wait()
            if self._closed:
                return False
            self._used += n
            return True

    def release(self, n: int) -> None:
        with self._cond:
            self._used -= n
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def budget_for(items: list[Item]) -> int:
    """Twice the largest tensor held: one being written while the next is read."""
    return 2 * max((i.held for i in items), default=0)


def write_shards(ckpt: Checkpoint, shards: list[tuple[str, list[Item]]], out: Path,
                 window: int, progress: Callable[[int], None] | None = None) -> None:
    """Write each (file name, items) of `shards` into directory `out`, reads ahead of
    writes; `progress(bytes)` after each tensor.

    Raises:
        CorruptCheckpointError: a tensor fails verification (the shard being written
            is removed; shards already renamed stay, each whole).
        OSError: a write failed (the same).
    """
    items = [item for _, shard in shards for item in shard]
    budget = _Budget(budget_for(items))
    ready: queue.Queue[tuple[Item, torch.Tensor, int] | BaseException | None] = queue.Queue()
    reader = threading.Thread(target=_read_ahead, args=(ckpt, items, budget, ready),
                              name="asyncckpt-export-read", daemon=True)
    reader.start()
    try:
        got = iter(ready.get, None)
        for name, shard in shards:
            _write_one(out, name, shard, _tensors(got, len(shard), budget), window, progress)
    finally:
        budget.close()
        reader.join()


def _tensors(got: Iterator, count: int, budget: _Budget) -> Iterator[tuple[Item, torch.Tensor]]:
    for _ in range(count):
        entry = next(got)
        if isinstance(entry, BaseException):
            raise entry
        item, tensor, held = entry
        try:
            yield item, tensor
        finally:
            del tensor
            budget.release(held)


def _read_ahead(ckpt: Checkpoint, items: list[Item], budget: _Budget, ready: queue.Queue) -> None:
    try:
        for item in items:
            if not budget.acquire(item.held):
                return
            if item.converted and item.leaf.view is None:
                # assembled straight in the exported dtype: the stored values pass
                # through bounded temporaries, never a whole copy of the tensor
                ready.put((item, ckpt.read_full(item.leaf.tensor, DTYPES[item.dtype],
                                                CONVERT_TEMP), item.held))
                continue
            tensor = ckpt.read_full(item.leaf.tensor)
            if item.leaf.view is not None:
                tensor = item.leaf.view.of_tensor(tensor)
            converted = tensor.to(DTYPES[item.dtype]).contiguous()
            kept = item.held
            if item.converted:  # the stored tensor goes now
                del tensor
                budget.release(item.held - item.nbytes)
                kept = item.nbytes
            ready.put((item, converted, kept))
    except BaseException as e:  # noqa: BLE001 - handed to the writing thread, raised there
        ready.put(e)


def _write_one(out: Path, name: str, shard: list[Item],
               tensors: Iterator[tuple[Item, torch.Tensor]], window: int,
               progress: Callable[[int], None] | None) -> None:
    header, _ = layout((i.export_name, i.dtype, i.shape) for i in shard)
    tmp = out / f".{name}.tmp-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        writeback = Writeback(fd, window, path=tmp)
        end = _write_all(fd, memoryview(header), tmp, writeback, 0)
        for item, tensor in tensors:
            if tensor.numel():
                end = _write_all(fd, tensor_bytes(tensor), tmp, writeback, end)
            if progress:
                progress(item.nbytes)
            del tensor  # before the next is taken: the budget is what is held
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
