"""Staging: copying a rank's tensor bytes into ring slots, in stream order.

The rank's stream is every tensor's bytes back to back; slots are filled to the brim
across tensor boundaries (small tensors share a frame, large ones span many), so any
tensor of any size passes through any ring size with one copy, and the writer sees
frames of one size. Contiguous tensors are copied straight from their storage;
non-contiguous ones go through a bounded (at most one slot) contiguous block, never a
whole-tensor copy. From host memory the copy is one `memmove` per piece (GIL
released, single-threaded); `Tensor.copy_` fans out to OpenMP threads that stall when the
writer holds the other core (`python -m benchmarks.micro`: 5.9 vs 4.9 GB/s with one busy
core; with both cores loaded copy_ fell to 0.5 GB/s). From a CUDA tensor the copy is
`Tensor.copy_`, the device-to-host transfer itself.
"""

from __future__ import annotations

import ctypes
from typing import Callable, Iterable, Iterator

import torch

from .ring import Ring


def byte_pieces(t: torch.Tensor, max_bytes: int) -> Iterator[torch.Tensor]:
    """Contiguous uint8 tensors whose concatenation is `t`'s bytes in row-major order."""
    if t.numel() == 0:
        return
    if t.is_contiguous():
        yield _flat_bytes(t)
        return
    for block in _blocks(t, max_bytes):
        yield _flat_bytes(block.contiguous())


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    # not reshape(-1): a contiguous tensor with size-1 dims may keep a stride != 1 there
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def _blocks(t: torch.Tensor, max_bytes: int) -> Iterator[torch.Tensor]:
    """Views of `t`, in row-major order, each at most `max_bytes` (or one element)."""
    if t.dim() == 0 or t.numel() * t.element_size() <= max_bytes:
        yield t
        return
    row_bytes = t[0].numel() * t.element_size()
    if row_bytes <= max_bytes:
        rows = max(1, max_bytes // row_bytes)
        for i in range(0, t.shape[0], rows):
            yield t[i:i + rows]
    else:
        for i in range(t.shape[0]):
            yield from _blocks(t[i], max_bytes)


def stage(tensors: Iterable[torch.Tensor], ring: Ring, acquire: Callable[[], int],
          emit: Callable[[int, int], None]) -> int:
    """Copy every tensor's bytes into ring slots and hand each full slot to `emit`.

    Args:
        acquire: blocks until a slot is free and returns it (raises to cancel).
        emit: called with (slot, length) once a slot is filled; the slot then belongs to
            the writer until it frees it.
    Returns:
        The number of bytes staged.
    """
    slot, fill, total = -1, 0, 0
    for tensor in tensors:
        for piece in byte_pieces(tensor, ring.slot_size):
            pos, size = 0, piece.numel()
            on_cpu = piece.device.type == "cpu"
            while pos < size:
                if slot < 0:
                    slot, fill = acquire(), 0
                n = min(size - pos, ring.slot_size - fill)
                if on_cpu:  # one plain memcpy, GIL released; torch's copy_ would fan out to
                    # OpenMP threads that stall whenever the writer holds the other cores
                    ctypes.memmove(ring.address + slot * ring.slot_size + fill,
                                   piece.data_ptr() + pos, n)
                else:  # device-to-host
                    ring.slot_tensor(slot)[fill:fill + n].copy_(piece[pos:pos + n])
                fill, pos, total = fill + n, pos + n, total + n
                if fill == ring.slot_size:
                    emit(slot, fill)
                    slot = -1
    if slot >= 0:
        emit(slot, fill)
    return total
