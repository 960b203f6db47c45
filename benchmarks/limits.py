"""The machine's own limits, measured in the same run as the methods.

A checkpointer cannot release the training loop faster than it can copy the state
(memcpy into memory that is already touched, as a reused staging buffer or ring is),
and cannot make bytes durable faster than a plain sequential write of the same number
of bytes followed by one fsync, to the same directory. Measuring both next to the
methods, rather than quoting a datasheet, makes every ratio in the report a ratio
between numbers taken minutes apart on the same machine, disk and page-cache state.
A cold sequential read of the file just written bounds the loads the same way.

The limits process measures them on one contiguous buffer. The targets that matter
most are closer still: the method's own worker times, interleaved with its saves and
loads (A, B, A, B, so a busy neighbour slows both sides alike), a one-thread copy of
the very tensors it stages (`copy_tensors`, what the ring copy must match), a
sequential write + fsync of those tensors' bytes (`write_tensors`) and a cold
sequential read of a file of them (`read_file`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncckpt.storage.durable import fsync_path

from . import measure

MiB = 1 << 20
COPY_BLOCK = 64 * MiB
WRITE_BLOCK = 8 * MiB


def memcpy_seconds(nbytes: int, threads: int | None, reps: int) -> list[float]:
    """Seconds to copy `nbytes` between two touched buffers (64 MiB `copy_` calls)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
        out = []
        for _ in range(reps + 1):  # the first pass warms the allocator and caches
            start = time.perf_counter()
            for offset in range(0, nbytes, COPY_BLOCK):
                dst[offset:offset + COPY_BLOCK].copy_(src[offset:offset + COPY_BLOCK])
            out.append(time.perf_counter() - start)
        return out[1:]
    finally:
        torch.set_num_threads(before)


def packed_destination(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """A touched buffer with room for `tensors` back to back, as a reused ring is."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    dst = np.empty(nbytes, dtype=np.uint8)
    dst.fill(0)
    return dst


def _raw(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous tensor as a uint8 array (numpy has no bfloat16)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def copy_tensors(tensors: Sequence[torch.Tensor], dst: np.ndarray) -> float:
    """Seconds to copy every tensor into `dst`, back to back, with one-thread
    numpy.copyto per tensor: the reference for staging them into a ring."""
    start = time.perf_counter()
    pos = 0
    for t in tensors:
        src = _raw(t)
        np.copyto(dst[pos:pos + src.size], src)
        pos += src.size
    return time.perf_counter() - start


def write_tensors(path: Path, tensors: Sequence[torch.Tensor]) -> float:
    """Seconds to write the tensors' bytes sequentially to a new file at `path` (at most
    8 MiB per write call) and fsync it and its directory. The file is then dropped from
    the page cache (untimed) and left for the caller to delete."""
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            view = memoryview(_raw(t))
            while len(view):
                view = view[os.write(fd, view[:WRITE_BLOCK]):]
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(path.parent)
    seconds = time.perf_counter() - start
    measure.drop_cache(path)
    return seconds


def read_file(path: Path, buffer: memoryview) -> float:
    """Seconds to read `path` sequentially into `buffer` (reused, one block at a time)."""
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        while n := os.preadv(fd, [buffer], offset):
            offset += n
    finally:
        os.close(fd)
    return time.perf_counter() - start


def write_fsync_seconds(directory: Path, nbytes: int, reps: int) -> tuple[list[float], list[float]]:
    """(write + fsync seconds, cold sequential read seconds) of `nbytes` in `directory`."""
    block = bytearray(os.urandom(WRITE_BLOCK))
    view = memoryview(block)
    writes, reads = [], []
    for rep in range(reps):
        path = directory / f"limit-{rep}.bin"
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = nbytes
            while left:
                chunk = view[:min(left, WRITE_BLOCK)]
                while chunk:
                    chunk = chunk[os.write(fd, chunk):]
                left -= min(left, WRITE_BLOCK)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_path(directory)
        writes.append(time.perf_counter() - start)
        measure.drop_cache(path)
        reads.append(read_file(path, view))
        path.unlink()
    return writes, reads


def run(directory: Path, nbytes: int, reps: int) -> dict[str, Any]:
    """Every limit for a state of `nbytes`; seconds per repetition."""
    directory.mkdir(parents=True, exist_ok=True)
    writes, reads = write_fsync_seconds(directory, nbytes, reps)
    return {
        "bytes": nbytes,
        "threads": torch.get_num_threads(),
        "memcpy": memcpy_seconds(nbytes, None, reps),
        "memcpy_1thread": memcpy_seconds(nbytes, 1, reps),
        "write_fsync": writes,
        "read_cold": reads,
    }
