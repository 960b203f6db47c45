"""Staging: copying a rank's tensor bytes into ring slots, in stream order.

The rank's stream is every tensor's bytes back to back; slots are filled to the brim
across tensor boundaries (small tensors share a frame, large ones span many), so any
tensor of any size passes through any ring size with one copy, and the writer sees
frames of one size. Contiguous tensors are copied straight from their storage;
non-contiguous ones go through a bounded (at most one slot) contiguous block, never a
whole-tensor copy. From host memory the copy is one `memmove` per piece (GIL
released, single-threaded); `Tensor.copy_` fans out to OpenMP threads that stall when the
writer holds the other core (`python -m benchmarks.micro`: 5.9 vs 4.9 GB/s with one busy
core; with both cores loaded copy_ fell to 0.5 GB/s).

From a CUDA tensor the copy is the device-to-host DMA itself, straight into the ring:
the ring's pages are registered with CUDA (pinned) on first use, copies are issued
non-blocking on a staging stream that first waits for the work queued before `save()`,
and a slot is handed to the writer only once an event recorded after its copies has
completed. A few slots are in flight at once, so the DMA of one overlaps the handing
over of the previous; slots still go to the writer in stream order.
"""

from __future__ import annotations

import collections
import ctypes
import logging
from typing import Any, Callable, Iterable, Iterator

import torch

from .ring import Ring

log = logging.getLogger("asyncckpt.client")


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


class DeviceCopies:
    """Asynchronous device-to-host copies into a ring, and the slots waiting for them.

    One per ring. `close()` unpins the ring's pages; call it before the ring is unmapped.
    """

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self.pinned = False
        self._tried_pin = False
        self._stream: Any = None
        self._pending: collections.deque[tuple[int, int, Any]] = collections.deque()
        self._max_pending = min(2, ring.slots - 1)  # the writer must always own a slot

    def copy(self, slot: int, fill: int, source: torch.Tensor, ready: Any) -> None:
        """Queue the copy of uint8 CUDA tensor `source` into `slot` at byte `fill`."""
        if not self._tried_pin:
            self._pin()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=source.device)
        if ready is not None:
            self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            self.ring.slot_tensor(slot)[fill:fill + source.numel()].copy_(source, non_blocking=True)

    def hand_over(self, slot: int, length: int, emit: Callable[[int, int], None],
                  copied: bool) -> None:
        """Emit `slot` once the copies queued into it (if `copied`) have landed, keeping
        slots in order; at most a few wait at once."""
        if copied:
            event = torch.cuda.Event()
            event.record(self._stream)
            self._pending.append((slot, length, event))
        else:
            self.drain(emit)
            emit(slot, length)
        while self._pending and (len(self._pending) > self._max_pending or self._pending[0][2].query()):
            done_slot, done_length, event = self._pending.popleft()
            event.synchronize()
            emit(done_slot, done_length)

    def discard(self) -> list[int]:
        """Wait for the copies into waiting slots to land and return those slots unsent."""
        slots = []
        while self._pending:
            slot, _, event = self._pending.popleft()
            event.synchronize()
            slots.append(slot)
        return slots

    def drain(self, emit: Callable[[int, int], None]) -> None:
        """Emit every waiting slot, in order, once its copies have landed."""
        while self._pending:
            slot, length, event = self._pending.popleft()
            event.synchronize()
            emit(slot, length)

    def _pin(self) -> None:
        self._tried_pin = True
        size = self.ring.slot_size * self.ring.slots
        try:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self.ring.address, size, 0))
            self.pinned = True
        except Exception as e:  # still correct, only slower: copies into pageable memory
            log.warning("cannot pin the ring for asynchronous device copies (%s); "
                        "staging CUDA tensors synchronously", e)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.ring.address)
            self.pinned = False


def ready_event(tensors: Iterable[torch.Tensor]) -> Any:
    """An event after the work queued so far on the current stream of the CUDA tensors'
    device (None if there are none): staging copies start after it."""
    device = next((t.device for t in tensors if t.device.type == "cuda"), None)
    if device is None:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def stage(tensors: Iterable[torch.Tensor], ring: Ring, acquire: Callable[[], int],
          emit: Callable[[int, int], None], release: Callable[[int], None] = lambda slot: None,
          device: DeviceCopies | None = None, ready: Any = None) -> int:
    """Copy every tensor's bytes into ring slots and hand each full slot to `emit`.

    Args:
        acquire: blocks until a slot is free and returns it (raises to cancel).
        emit: called with (slot, length) once a slot is filled (and its device copies
            landed); the slot then belongs to the writer until it frees it.
        device: the ring's DeviceCopies, needed for CUDA tensors.
        ready: `ready_event()` of the save, taken when it was requested.
    Returns:
        The number of bytes staged.
    """
    slot, fill, total, copied = -1, 0, 0, False
    try:
        for tensor in tensors:
            for piece in byte_pieces(tensor, ring.slot_size):
                pos, size = 0, piece.numel()
                on_cpu = piece.device.type == "cpu"
                if not on_cpu and device is None:
                    raise ValueError("a CUDA tensor needs the ring's DeviceCopies")
                while pos < size:
                    if slot < 0:
                        slot, fill, copied = acquire(), 0, False
                    n = min(size - pos, ring.slot_size - fill)
                    if on_cpu:  # one plain memcpy, GIL released; torch's copy_ would fan out to
                        # OpenMP threads that stall whenever the writer holds the other cores
                        ctypes.memmove(ring.address + slot * ring.slot_size + fill,
                                       piece.data_ptr() + pos, n)
                    else:
                        assert device is not None
                        device.copy(slot, fill, piece[pos:pos + n], ready)
                        ready, copied = None, True  # the stream waits once
                    fill, pos, total = fill + n, pos + n, total + n
                    if fill == ring.slot_size:
                        _hand_over(device, slot, fill, emit, copied)
                        slot = -1
        if slot >= 0:
            _hand_over(device, slot, fill, emit, copied)
            slot = -1
        if device is not None:
            device.drain(emit)
    except BaseException:
        for unsent in (device.discard() if device is not None else []) + ([slot] if slot >= 0 else []):
            release(unsent)
        raise
    return total


def _hand_over(device: DeviceCopies | None, slot: int, length: int,
               emit: Callable[[int, int], None], copied: bool) -> None:
    if device is None:
        emit(slot, length)
    else:
        device.hand_over(slot, length, emit, copied)
