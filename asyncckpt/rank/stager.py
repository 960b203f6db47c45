"""Staging: copying a rank's tensor bytes into ring slots, in stream order.

The rank's stream is every tensor's bytes back to back; slots are filled to the brim
across tensor boundaries (small tensors share a frame, large ones span many), so any
tensor of any size passes through any ring size with one copy, and the writer sees
frames of one size. Contiguous tensors are copied straight from their storage;
non-contiguous ones go through a bounded (at most one slot) contiguous block, never a
whole-tensor copy. From host memory the copy is `memmove` (GIL released); `Tensor.copy_`
fans out to OpenMP threads that stall when the writer holds the other cores (with
every core loaded, copy_ fell to a fraction of memmove's speed: docs/design/staging.md).

Host bytes are copied by the stager thread and helper threads together: the copies
into a few slots (`PARALLEL_SLOTS`) are queued as jobs of at most 1 MiB, whatever
tensors they come from, and run as one batch that whichever thread is free takes from
next (`HostCopier`, copier.py); those slots are handed over once every job of the batch is done.
A batch under `INLINE_BYTES` (a small state's) is copied by the stager thread alone.
Taking jobs rather than being assigned halves is what keeps this safe on a busy
machine: a helper that is not scheduled takes nothing, and the stager thread copies
alone as before, waiting at most for the one job a helper has begun. The check for
in-place changes after a tensor's copy runs once its bytes are all in the ring
(`copied`), which may be a batch after it was looked at; a block made for a
non-contiguous tensor is kept until the batch that reads it has run. Batches span
tensors because a wait per tensor did not pay: on a 2-core VM, helpers on the 1-8 MiB
tensors that hold two thirds of a 1 GiB training state's bytes, run tensor by tensor,
took 1.4x the CPU (162 against 116 ms for 1 GiB) for no faster copy; run a few slots
at a time they copy that state in 72 ms against 86 (one thread: 88 ms; load 0.4). The
ring's pages are populated when it is created (ring.py), so no save pays page faults
for them. While the rank stages, the writer leaves its ring alone (its `stage_first`),
so every other core may help; on a loaded machine the helpers get no core and the
stager thread copies alone (docs/design/staging.md).

From a CUDA tensor the copy is the device-to-host DMA itself, straight into the ring:
the ring's pages are registered with CUDA (pinned) on first use, copies are issued
non-blocking on a staging stream, and a slot is handed to the writer only once an event
recorded after its copies has completed. A few slots are in flight at once, so the DMA
of one overlaps the handing over of the previous; slots still go to the writer in
stream order.

Stream discipline, because the writer checksums whatever lands in the ring and `verify`
then passes on it: every device operation of a save runs on the one staging stream,
and that stream first waits for the event recorded on the producer's stream at `save()`
(at the save's first CUDA tensor, whatever host tensors come before it). The contiguous
block of a non-contiguous tensor is made on the staging stream too, so the copy that
reads it is ordered after the kernel that writes it; made on the stager thread's
current stream, as it once was, it raced both the producer (that stream had not waited
for it) and the copy (which had not waited for the kernel). Every tensor a queued copy
reads (such blocks, and the slices of the state's own tensors) is referenced from the
slot's entry until the event after its copy has completed. Holding references is
chosen over `Tensor.record_stream`: the lifetime is explicit and bounded (at most the
waiting slots plus the open one, one slot of blocks each), it does not depend on when
the caching allocator next looks at its recorded events, and it also keeps the state's
tensors alive if the caller drops them right after `save()`.
"""

from __future__ import annotations

import collections
import ctypes
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from asyncckpt.ipc.ring import Ring
from asyncckpt.rank.copier import HostCopier, host_copier

log = logging.getLogger("asyncckpt.rank")

PARALLEL_SLOTS = 4   # host slots filled before their copies run and they are handed over
JOB_BYTES = 1 << 20  # the most one host copy job moves
INLINE_BYTES = 2 << 20  # a batch this small is copied by the stager thread alone (a small
#                         state's only batch: waking a helper costs more than it saves)


def slot_tensor(ring: Ring, slot: int) -> torch.Tensor:
    """Slot `slot` of `ring` as a uint8 tensor: a view into the shared memory (the ring
    module itself stays free of torch, as the writer maps rings too)."""
    return torch.frombuffer(ring.mapping, dtype=torch.uint8, count=ring.slot_size,
                            offset=slot * ring.slot_size)

def byte_pieces(t: torch.Tensor, max_bytes: int,
                contiguous: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.contiguous
                ) -> Iterator[torch.Tensor]:
    """Contiguous uint8 tensors whose concatenation is `t`'s bytes in row-major order:
    `t` itself if it is contiguous, else `contiguous` of blocks of at most `max_bytes`.
    A view with the negative or conjugate bit (its bytes are not its values) is resolved
    into a copy first."""
    if t.numel() == 0:
        return
    if t.is_neg() or t.is_conj():
        t = t.resolve_conj().resolve_neg()
    if t.is_contiguous():
        yield _flat_bytes(t)
        return
    for block in _blocks(t, max_bytes):
        yield _flat_bytes(contiguous(block))


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

    One per ring, used by one stager thread. `close()` unpins the ring's pages; call it
    before the ring is unmapped. `_new_stream`, `_wait`, `_contiguous`, `_copy_async`,
    `_record`, `_synchronize` and `_pin` are the only code that calls CUDA (a test
    replaces them to let the CPU stand in for a GPU).
    """

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self.pinned = False
        self._tried_pin = False
        self._stream: Any = None
        self._device: torch.device | None = None
        self._held: list[torch.Tensor] = []  # what the copies into the open slot read
        # (slot, length, event after its copies, the tensors those copies read)
        self._pending: collections.deque[tuple[int, int, Any, list[torch.Tensor]]] = \
            collections.deque()
        self._max_pending = min(2, ring.slots - 1)  # the writer must always own a slot

    def handles(self, t: torch.Tensor) -> bool:
        """Whether `t` is staged by device copies (else it must be in host memory)."""
        return t.device.type == "cuda"

    def begin(self, device: torch.device, ready: Any) -> None:
        """Before any device work of a save: the staging stream waits for `ready` (the
        save's `ready_event`, None when there is nothing to wait for).

        Raises:
            ValueError: the staging stream is on another device (one device per ring).
        """
        if not self._tried_pin:
            self._pin()
        if self._stream is None:
            self._stream, self._device = self._new_stream(device), device
        self._check_device(device)
        if ready is not None:
            self._wait(ready)

    def pieces(self, t: torch.Tensor, max_bytes: int) -> Iterator[torch.Tensor]:
        """`byte_pieces(t, max_bytes)`, its contiguous blocks made on the staging stream
        (call `begin` first).

        Raises:
            ValueError: `t` is on another device than the staging stream.
        """
        self._check_device(t.device)
        return byte_pieces(t, max_bytes, self._contiguous)

    def _check_device(self, device: torch.device) -> None:
        if device != self._device:
            raise ValueError(f"CUDA tensors on {device} and {self._device}: a rank's state "
                             "must be on one device")

    def copy(self, slot: int, fill: int, source: torch.Tensor) -> None:
        """Queue the copy of uint8 device tensor `source` into `slot` at byte `fill`;
        `source` is kept until the slot's copies have landed."""
        self._copy_async(slot_tensor(self.ring, slot)[fill:fill + source.numel()], source)
        self._held.append(source)

    def hand_over(self, slot: int, length: int, emit: Callable[[int, int], None]) -> None:
        """Emit `slot` once the copies queued into it have landed, keeping slots in
        order; at most a few wait at once."""
        if self._held:
            self._pending.append((slot, length, self._record(), self._held))
            self._held = []
        else:
            self.drain(emit)
            emit(slot, length)
        while self._pending and (len(self._pending) > self._max_pending
                                 or self._pending[0][2].query()):
            done_slot, done_length, event, _ = self._pending.popleft()
            event.synchronize()
            emit(done_slot, done_length)

    def discard(self) -> list[int]:
        """Wait for every queued copy (into waiting slots and the open one) to land and
        return the waiting slots unsent."""
        slots = []
        while self._pending:
            slot, _, event, _ = self._pending.popleft()
            event.synchronize()
            slots.append(slot)
        if self._held:
            self._synchronize()
            self._held = []
        return slots

    def drain(self, emit: Callable[[int, int], None]) -> None:
        """Emit every waiting slot, in order, once its copies have landed."""
        while self._pending:
            slot, length, event, _ = self._pending.popleft()
            event.synchronize()
            emit(slot, length)

    def _new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def _wait(self, ready: Any) -> None:
        self._stream.wait_event(ready)

    def _contiguous(self, block: torch.Tensor) -> torch.Tensor:
        with torch.cuda.stream(self._stream):  # allocated and written on the staging stream
            return block.contiguous()

    def _copy_async(self, dest: torch.Tensor, source: torch.Tensor) -> None:
        with torch.cuda.stream(self._stream):
            dest.copy_(source, non_blocking=True)

    def _record(self) -> Any:
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def _synchronize(self) -> None:
        self._stream.synchronize()

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
          device: DeviceCopies | None = None, ready: Any = None,
          copier: HostCopier | None = None,
          copied: Callable[[int], None] = lambda count: None) -> int:
    """Copy every tensor's bytes into ring slots and hand each full slot to `emit`.

    Args:
        acquire: blocks until a slot is free and returns it (raises to cancel).
        emit: called with (slot, length) once a slot is filled (and its device copies
            landed); the slot then belongs to the writer until it frees it.
        release: given back the slots this save held when it stopped on an error, once
            no copy into them is still running.
        device: the ring's DeviceCopies, needed for CUDA tensors.
        ready: `ready_event()` of the save, taken when it was requested.
        copier: copies host bytes with helper threads (default: `host_copier()`; rings
            of fewer than 2 slots copy on the calling thread alone).
        copied: called with n once the first n tensors' bytes are all in the ring (a
            device tensor's: its copies queued), before the slots holding them are
            handed over; n grows from call to call. It may raise to stop staging.
    Returns:
        The number of bytes staged.
    Raises:
        ValueError: a CUDA tensor without `device`, or CUDA tensors on two devices.
    """
    batch_slots = min(PARALLEL_SLOTS, ring.slots - 1)  # + the open slot: never all of them
    if copier is None and batch_slots > 0:
        copier = host_copier()
    slots = _SlotFiller(ring, acquire, emit, device, copier, max(1, batch_slots), copied)
    try:
        for tensor in tensors:
            if device is not None and device.handles(tensor):
                slots.run_host()  # host slots before it go first, in stream order
                for piece in slots.device_pieces(tensor, ready):
                    slots.copy_from_device(piece)
            elif tensor.device.type == "cpu":
                if tensor.is_contiguous() and not (tensor.is_conj() or tensor.is_neg()):
                    # its own bytes, no uint8 view made (~1.6 us a tensor, 1 ms a GiB)
                    slots.queue_host(tensor, tensor.data_ptr(), tensor.nbytes)
                else:
                    for piece in byte_pieces(tensor, ring.slot_size):
                        slots.queue_host(piece, piece.data_ptr(), piece.numel())
            else:
                raise ValueError(f"a tensor on {tensor.device} needs the ring's DeviceCopies")
            slots.tensor_done()
        slots.finish()
    except BaseException:
        for unsent in slots.unsent():
            release(unsent)
        raise
    return slots.total


class _SlotFiller:
    """The slots of one `stage()` call: the open one and how full it is, the full ones
    whose host copies have not run yet, the host copies queued, and the bytes and
    tensors staged so far.

    Host bytes are queued as jobs (at most `JOB_BYTES` each, never across a slot) and
    run together once `batch_slots` slots are full, by `copier` and its helpers, across
    tensor boundaries; then `copied` hears how many tensors are whole in the ring, and
    the full slots are handed over. Device bytes are queued DMA (DeviceCopies).
    """

    def __init__(self, ring: Ring, acquire: Callable[[], int], emit: Callable[[int, int], None],
                 device: DeviceCopies | None, copier: HostCopier | None,
                 batch_slots: int, copied: Callable[[int], None]) -> None:
        self.ring, self.slot_size = ring, ring.slot_size
        self.acquire, self.emit = acquire, emit
        self.device, self.copier, self.batch_slots = device, copier, batch_slots
        self.copied = copied
        self.slot, self.fill, self.total = -1, 0, 0
        self.filled: list[int] = []  # full slots whose host copies have not all run yet
        self.jobs: list[tuple[int, int, int]] = []  # host copies queued: (dest, source, n)
        self.held: list[torch.Tensor] = []  # what the queued jobs read (blocks made here)
        self.tensors = 0   # tensors whose bytes are all queued
        self.reported = 0  # tensors told to `copied`
        self._begun = False

    def device_pieces(self, tensor: torch.Tensor, ready: Any) -> Iterator[torch.Tensor]:
        """`tensor`'s pieces from `device`; the save's first device tensor, host tensors
        or not before it, begins the device work."""
        assert self.device is not None
        if not self._begun:
            self.device.begin(tensor.device, ready)
            self._begun = True
        return self.device.pieces(tensor, self.slot_size)

    def _room(self, left: int) -> int:
        """How many of the next `left` bytes fit in the open slot (acquired if none is)."""
        if self.slot < 0:
            self.slot, self.fill = self.acquire(), 0
        return min(left, self.slot_size - self.fill)

    def _advance(self, n: int) -> bool:
        """Count `n` bytes copied into the open slot; whether it is now full."""
        self.fill += n
        self.total += n
        return self.fill == self.slot_size

    def _hand_over_open(self) -> None:
        _hand_over(self.device, self.slot, self.fill, self.emit)
        self.slot = -1

    def copy_from_device(self, piece: torch.Tensor) -> None:
        assert self.device is not None
        pos, size = 0, piece.numel()
        while pos < size:
            n = self._room(size - pos)
            self.device.copy(self.slot, self.fill, piece[pos:pos + n])
            pos += n
            if self._advance(n):
                self._hand_over_open()

    def queue_host(self, piece: torch.Tensor, source: int, size: int) -> None:
        """Queue the copy of the `size` bytes at `source`, `piece`'s (a contiguous host
        tensor), into the slots; run the queue whenever `batch_slots` slots are full."""
        pos = 0
        address = self.ring.address
        while pos < size:
            n = self._room(size - pos)
            dest = address + self.slot * self.slot_size + self.fill
            if n <= JOB_BYTES:
                self.jobs.append((dest, source + pos, n))
            else:
                self.jobs += [(dest + k, source + pos + k, min(JOB_BYTES, n - k))
                              for k in range(0, n, JOB_BYTES)]
            pos += n
            if self._advance(n):
                self.filled.append(self.slot)
                self.slot = -1
                if len(self.filled) >= self.batch_slots:
                    self.run_host()
        if self.jobs:  # its last jobs wait for a later run: keep what they read
            self.held.append(piece)

    def run_host(self) -> None:
        """Run the queued host copies (with the helpers), tell `copied`, and hand over
        the slots they filled, in order."""
        if self.jobs:
            jobs, self.jobs = self.jobs, []
            if self.copier is None or sum(n for _, _, n in jobs) < INLINE_BYTES:
                for dest, source, n in jobs:
                    ctypes.memmove(dest, source, n)  # releases the GIL
            else:
                self.copier.run(jobs)
            self.held = []
        self._report()
        while self.filled:  # popped once handed over: else released
            _hand_over(self.device, self.filled[0], self.slot_size, self.emit)
            self.filled.pop(0)

    def tensor_done(self) -> None:
        """The current tensor's bytes are all queued (or copied)."""
        self.tensors += 1
        if not self.jobs:
            self._report()

    def _report(self) -> None:
        if self.tensors > self.reported and not self.jobs:
            self.reported = self.tensors
            self.copied(self.tensors)

    def finish(self) -> None:
        """Run what is queued, hand over the last, partly filled slot and every slot
        still waiting for its device copies."""
        self.run_host()
        if self.slot >= 0:
            self._hand_over_open()
        if self.device is not None:
            self.device.drain(self.emit)

    def unsent(self) -> list[int]:
        """After an error: the slots this call holds, once no copy into them runs (a
        queued host copy that has not run never will)."""
        waiting = self.device.discard() if self.device is not None else []
        return waiting + self.filled + ([self.slot] if self.slot >= 0 else [])


def _hand_over(device: DeviceCopies | None, slot: int, length: int,
               emit: Callable[[int, int], None]) -> None:
    if device is None:
        emit(slot, length)
    else:
        device.hand_over(slot, length, emit)
