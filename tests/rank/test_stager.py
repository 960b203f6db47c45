"""Staging: the bytes that reach the slots are the tensors' row-major bytes, packed; device
copies wait for the producer, keep what they read until it has landed, and a failed save
gives its slots back only once no copy into them runs (with the CPU standing in for the
GPU; tests/rank/test_cuda_staging.py checks the same on a GPU)."""

from __future__ import annotations

import collections
import itertools
import weakref

import pytest
import torch

from asyncckpt.ipc import ring
from asyncckpt.rank.stager import DeviceCopies, byte_pieces, slot_tensor, stage


def row_major_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def test_byte_pieces_of_non_contiguous_tensors_are_bounded_and_ordered():
    base = torch.arange(64 * 300, dtype=torch.float32).reshape(64, 300)
    for t in (base.t(), base[:, ::3], base.t()[5:9]):
        pieces = list(byte_pieces(t, max_bytes=256))
        assert all(p.numel() <= 256 for p in pieces) or t.is_contiguous()
        assert b"".join(p.numpy().tobytes() for p in pieces) == row_major_bytes(t)


def test_rows_larger_than_a_slot_are_split_recursively():
    big_rows = torch.randn(2, 4, 3000)[:, :, ::2]  # rows of 6000 bytes, slots of 1024
    for tensor in (big_rows, big_rows.transpose(0, 1)):
        pieces = list(byte_pieces(tensor, max_bytes=1024))
        assert max(p.numel() for p in pieces) <= 1024
        assert b"".join(p.numpy().tobytes() for p in pieces) == row_major_bytes(tensor)


def test_stage_packs_slots_across_tensor_boundaries():
    r = ring.Ring.create(4096, 4)
    try:
        tensors = [torch.arange(1000, dtype=torch.int32), torch.ones(3, dtype=torch.bool),
                   torch.randn(700, 3).t(), torch.empty(0), torch.tensor(2.5)]
        expected = b"".join(row_major_bytes(t) for t in tensors)
        free, got = [0, 1, 2, 3], []

        def emit(slot: int, length: int) -> None:
            view = r.slot_bytes(slot, length)
            got.append(bytes(view))
            view.release()
            free.append(slot)

        total = stage(tensors, r, acquire=lambda: free.pop(0), emit=emit)
        assert total == len(expected) and b"".join(got) == expected
        # every frame but the last is full
        assert [len(g) for g in got[:-1]] == [4096] * (len(got) - 1)
    finally:
        r.close()


def test_contiguous_tensor_with_odd_strides_on_size_one_dims():
    t = torch.tensor([[-1213]], dtype=torch.int16).as_strided((1, 1), (2, 2))
    assert t.is_contiguous()
    assert b"".join(p.numpy().tobytes() for p in byte_pieces(t, 64)) == (-1213).to_bytes(
        2, "little", signed=True)


def test_contiguous_tensors_are_copied_from_their_own_bytes_exactly():
    """A contiguous host tensor is copied from its data pointer for its nbytes (no uint8
    view made): a slice that starts inside its storage, odd strides on size-1 dims, a
    0-d tensor, an empty one, bools and complex numbers all land as their row-major
    bytes."""
    base = torch.arange(3000, dtype=torch.int32)
    odd = torch.tensor([[-1213]], dtype=torch.int16).as_strided((1, 1), (2, 2))
    tensors = [base[517:2517], odd, torch.tensor(7, dtype=torch.int64), base[5:5],
               torch.ones(2, 3, dtype=torch.bool), torch.tensor([1 + 2j, 3 - 4j])]
    r = ring.Ring.create(4096, 4)
    try:
        free, got = [0, 1, 2, 3], []

        def emit(slot: int, length: int) -> None:
            view = r.slot_bytes(slot, length)
            got.append(bytes(view))
            view.release()
            free.append(slot)

        stage(tensors, r, acquire=lambda: free.pop(0), emit=emit)
        fresh = [torch.tensor(t.tolist(), dtype=t.dtype) for t in tensors]  # standard strides
        assert b"".join(got) == b"".join(row_major_bytes(t) for t in fresh)
    finally:
        r.close()


def test_slots_held_when_staging_stops_are_given_back():
    r = ring.Ring.create(1024, 4)
    try:
        free, emitted, released = [0, 1, 2, 3], [], []

        def tensors():
            yield torch.zeros(700, dtype=torch.int32)  # fills slots 0, 1 and part of 2
            raise RuntimeError("torn")

        try:
            stage(tensors(), r, acquire=lambda: free.pop(0), emit=lambda s, n: emitted.append(s),
                  release=released.append)
        except RuntimeError:
            pass
        else:
            raise AssertionError("the error must propagate")
        # full slots go out in batches (3 of this ring): none of them had gone yet
        assert emitted == [] and released == [0, 1, 2] and free == [3]
    finally:
        r.close()


# -- device copies, with the CPU standing in for the GPU ------------------------------------------

class LateEvent:
    """An event after the first `upto` queued copies; they run only when it is waited for."""

    def __init__(self, device: LateCopies, upto: int) -> None:
        self.device, self.upto = device, upto

    def query(self) -> bool:
        return False  # a busy device: nothing has landed until someone waits

    def synchronize(self) -> None:
        self.device.run(self.upto)


class LateCopies(DeviceCopies):
    """DeviceCopies whose device is the CPU and whose copies run as late as a busy GPU may
    run them: only when an event recorded after them is waited for. A queued copy keeps
    only a weak reference to what it reads, as the device keeps none: a source the stager
    let go of before its copy ran is reported, where a GPU would read freed memory."""

    def __init__(self, ring: ring.Ring, device_tensors: list[torch.Tensor]) -> None:
        super().__init__(ring)
        self.device_ids = {id(t) for t in device_tensors}
        self.log: list[str] = []
        self.queue: list[tuple[torch.Tensor, weakref.ref]] = []
        self.ran = 0
        self.freed: list[int] = []  # queued copies whose source was gone when they ran

    def handles(self, t: torch.Tensor) -> bool:
        return id(t) in self.device_ids

    def run(self, upto: int) -> None:
        for i in range(self.ran, upto):
            dest, source = self.queue[i]
            if source() is None:
                self.freed.append(i)
            else:
                dest.copy_(source())
        self.ran = max(self.ran, upto)

    def unrun_into(self, slot: torch.Tensor) -> list[int]:
        """The queued copies into `slot` that have not run."""
        lo, hi = slot.data_ptr(), slot.data_ptr() + slot.numel()
        return [i for i in range(self.ran, len(self.queue))
                if lo <= self.queue[i][0].data_ptr() < hi]

    def _pin(self) -> None:
        self._tried_pin = True

    def _new_stream(self, device: torch.device) -> object:
        return object()

    def _wait(self, ready: object) -> None:
        self.log.append(f"wait {ready}")

    def _contiguous(self, block: torch.Tensor) -> torch.Tensor:
        self.log.append("contiguous")
        return block.contiguous()

    def _copy_async(self, dest: torch.Tensor, source: torch.Tensor) -> None:
        self.log.append("copy")
        self.queue.append((dest, weakref.ref(source)))

    def _record(self) -> LateEvent:
        return LateEvent(self, len(self.queue))

    def _synchronize(self) -> None:
        self.run(len(self.queue))


def stage_late(tensors: list[torch.Tensor], device_tensors: list[torch.Tensor],
               slot_size: int = 4096,
               slots: int = 4):
    """Stage through LateCopies; returns (emitted bytes, the LateCopies)."""
    r = ring.Ring.create(slot_size, slots)
    device = LateCopies(r, device_tensors)
    free, got = list(range(slots)), []

    def emit(slot: int, length: int) -> None:
        assert not device.unrun_into(slot_tensor(r, slot)), "slot emitted before its copies ran"
        view = r.slot_bytes(slot, length)
        got.append(bytes(view))
        view.release()
        free.append(slot)

    try:
        stage(tensors, r, acquire=lambda: free.pop(0), emit=emit, device=device, ready="ready-1")
        return b"".join(got), device
    finally:
        r.close()


def test_device_copies_keep_what_they_read_until_their_slot_has_landed():
    """Non-contiguous blocks are temporaries: dropped before the copy that reads them ran,
    a GPU copies freed (or reused) memory and the writer checksums torn bytes."""
    g = torch.Generator().manual_seed(0)
    bases = [torch.randn(64, 300, generator=g) for _ in range(4)]
    tensors = [bases[0].t(), bases[1][:, ::3], torch.arange(3000, dtype=torch.int32),
               bases[2].t()[5:90], bases[3][7:50:2, 1::4]]
    data, device = stage_late(tensors, tensors)
    assert device.freed == [] and device.ran == len(device.queue) > 20
    assert data == b"".join(row_major_bytes(t) for t in tensors)
    assert device._held == [] and not device._pending


def test_staging_waits_for_the_producer_before_any_device_work():
    """Once per save, before the first block or copy, even when host tensors come first."""
    base = torch.randn(40, 100)
    tensors = [torch.arange(500, dtype=torch.int64), base.t(), torch.ones(700)]
    data, device = stage_late(tensors, tensors[1:])
    assert device.log[0] == "wait ready-1" and device.log.count("wait ready-1") == 1
    assert {"contiguous", "copy"} <= set(device.log[1:])
    assert data == b"".join(row_major_bytes(t) for t in tensors)


def test_a_failed_save_waits_for_copies_into_its_slots_before_giving_them_back():
    r = ring.Ring.create(1024, 4)
    view = torch.arange(2000, dtype=torch.int32).reshape(40, 50).t()
    device = LateCopies(r, [view])
    free, released, emitted = [0, 1, 2, 3], [], []

    def tensors():
        yield view  # 8000 bytes: 7 full slots and part of an eighth, then the error
        raise RuntimeError("torn")

    def release(slot: int) -> None:
        assert not device.unrun_into(slot_tensor(r, slot)), \
            "slot given back while a copy into it runs"
        released.append(slot)
        free.append(slot)

    def emit(slot: int, length: int) -> None:
        emitted.append(slot)
        free.append(slot)

    try:
        with pytest.raises(RuntimeError, match="torn"):
            stage(tensors(), r, acquire=lambda: free.pop(0), emit=emit, release=release,
                  device=device, ready=None)
        assert len(released) == 3 and len(emitted) == 5  # 2 slots waiting, 1 open
        assert device.freed == [] and device._held == [] and sorted(free) == [0, 1, 2, 3]
    finally:
        r.close()


# -- large host tensors: copied by the stager thread and helper threads together ----------------

@pytest.fixture
def small_parallel(monkeypatch):
    """Parallel copies in 1 KiB jobs, however small the batch, so small rings exercise
    them."""
    from asyncckpt.rank import stager
    monkeypatch.setattr(stager, "JOB_BYTES", 1024)
    monkeypatch.setattr(stager, "INLINE_BYTES", 0)
    return stager


def test_a_tensor_split_across_copy_threads_arrives_bit_exact_and_in_order(small_parallel,
                                                                           monkeypatch):
    import ctypes
    import threading
    import time

    copier = small_parallel.HostCopier(2)
    real, who = ctypes.memmove, []

    def memmove(dest, source, n):  # slow enough that the helpers take jobs too
        who.append(threading.current_thread().name)
        time.sleep(0.0005)
        return real(dest, source, n)

    monkeypatch.setattr(ctypes, "memmove", memmove)
    r = ring.Ring.create(4096, 6)
    try:
        g = torch.Generator().manual_seed(7)
        tensors = [torch.randint(0, 255, (300,), dtype=torch.uint8, generator=g),  # inline
                   torch.randn(5000, generator=g),                  # 20000 bytes, split
                   torch.randn(40, 250, generator=g).t(),           # non-contiguous
                   torch.randn(3001, dtype=torch.float64, generator=g)]  # 24008 bytes, split
        expected = b"".join(row_major_bytes(t) for t in tensors)
        free, got, order = collections.deque(range(6)), [], []

        def emit(slot: int, length: int) -> None:
            view = r.slot_bytes(slot, length)
            got.append(bytes(view))
            view.release()
            order.append(slot)
            free.append(slot)

        total = stage(tensors, r, acquire=free.popleft, emit=emit, copier=copier)
        assert total == len(expected) and b"".join(got) == expected
        assert [len(x) for x in got[:-1]] == [4096] * (len(got) - 1)
        assert any(n.startswith("asyncckpt-copy") for n in who)  # a helper did copy
        assert any(not n.startswith("asyncckpt-copy") for n in who)  # and the stager thread
    finally:
        r.close()


def test_a_busy_helper_never_holds_up_the_copy(small_parallel):
    import threading

    copier = small_parallel.HostCopier(1)
    blocker = threading.Event()
    copier._batches.put(type("Stuck", (), {"work": lambda self: blocker.wait()})())
    r = ring.Ring.create(4096, 4)
    try:
        t = torch.randn(8192)  # 32 KiB: 8 slots through a 4-slot ring, helper busy elsewhere
        free, got = collections.deque(range(4)), []

        def emit(slot: int, length: int) -> None:
            view = r.slot_bytes(slot, length)
            got.append(bytes(view))
            view.release()
            free.append(slot)

        stage([t], r, acquire=free.popleft, emit=emit, copier=copier)
        assert b"".join(got) == row_major_bytes(t)
    finally:
        blocker.set()
        r.close()


def test_slots_of_an_unfinished_parallel_batch_are_given_back(small_parallel):
    r = ring.Ring.create(4096, 6)
    try:
        free, emitted, released = collections.deque(range(6)), [], []
        calls = [0]

        def acquire() -> int:
            calls[0] += 1
            if calls[0] == 4:  # cancelled while the batch holds 3 slots
                raise RuntimeError("cancelled")
            return free.popleft()

        with pytest.raises(RuntimeError, match="cancelled"):
            stage([torch.randn(8192)], r, acquire=acquire, emit=lambda s, n: emitted.append(s),
                  release=released.append, copier=small_parallel.HostCopier(1))
        assert emitted == [] and sorted(released) == [0, 1, 2]
    finally:
        r.close()


def test_staging_into_a_fresh_ring_takes_no_page_faults():
    """The ring's pages are populated when it is created, not by each save's copy."""
    import resource

    from asyncckpt.rank.stager import HostCopier

    size = 64 << 20
    source = torch.ones(size, dtype=torch.uint8)
    for copier in (HostCopier(0), HostCopier(1)):
        r = ring.Ring.create(4 << 20, size // (4 << 20))
        try:
            free = collections.deque(range(r.slots))
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            stage([source], r, acquire=free.popleft, emit=lambda s, n, free=free: free.append(s),
                  copier=copier)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            assert faults < 0.01 * size / 4096, f"{faults} minor faults for {size >> 12} pages"
            assert bytes(r.slot_bytes(r.slots - 1, 16)) == b"\x01" * 16
        finally:
            r.close()


def test_small_tensors_are_copied_in_batches_across_tensors():
    """Tensors of 1-8 MiB hold two thirds of a 1 GiB training state's bytes. Copied with
    the helpers one tensor at a time they paid a wait per tensor for no faster copy; so
    they were copied by the stager thread alone, at one thread's speed. Now the jobs of
    several slots are run together whatever tensors they belong to: one batch per few
    slots (a quarter of the ring here), none per tensor."""
    from asyncckpt.rank import stager

    class Counting(stager.HostCopier):
        def __init__(self) -> None:
            super().__init__(0)
            self.batches: list[int] = []

        def run(self, jobs: list[tuple[int, int, int]]) -> None:
            self.batches.append(sum(n for _, _, n in jobs))
            super().run(jobs)

    MiB = 1 << 20
    medium = [torch.full((n * MiB // 4,), float(n)) for n in (1, 2, 4, 7, 3, 1)]  # 18 MiB
    medium.append(torch.ones(5))  # a tensor of 20 bytes: the last slot's partial fill
    copier = Counting()
    r = ring.Ring.create(4 * MiB, 12)
    try:
        free, got = collections.deque(range(12)), []

        def emit(slot: int, length: int) -> None:
            view = r.slot_bytes(slot, length)
            got.append(bytes(view))
            view.release()
            free.append(slot)

        stage(medium, r, acquire=free.popleft, emit=emit, copier=copier)
        assert b"".join(got) == b"".join(row_major_bytes(t) for t in medium)
        assert copier.batches == [16 * MiB, 2 * MiB + 20]  # four full slots, then the rest
        got.clear()
        small = [torch.full((1000,), float(n)) for n in range(100)]  # 400 KB: one batch
        stage(small, r, acquire=free.popleft, emit=emit, copier=copier)
        assert b"".join(got) == b"".join(row_major_bytes(t) for t in small)
        assert len(copier.batches) == 2  # under INLINE_BYTES: the stager thread alone
    finally:
        r.close()


def test_a_tensor_is_reported_copied_only_once_its_bytes_are_in_the_ring(small_parallel):
    """The version check after a tensor's copy (pending.Sources) runs from `copied`: it
    must never run before the tensor's bytes are all in the ring, whatever batch the
    copy ran in; every tensor is reported by the end."""
    from asyncckpt.rank import stager

    r = ring.Ring.create(1024, 8)
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g)
               for n in (100, 3000, 7, 1024, 2500, 1)]
    ends = list(itertools.accumulate(t.numel() for t in tensors))
    stream = b"".join(row_major_bytes(t) for t in tensors)
    free, order, reported = collections.deque(range(8)), [], [0]

    def written(upto: int) -> bytes:  # the stream's first `upto` bytes, from the ring
        out, pos = b"", 0
        for slot in order:
            n = min(1024, upto - pos)
            if n <= 0:
                break
            view = r.slot_bytes(slot, n)
            out += bytes(view)
            view.release()
            pos += n
        return out

    def acquire() -> int:
        slot = free.popleft()
        order.append(slot)
        return slot

    emitted: list[int] = []

    def emit(slot: int, length: int) -> None:
        emitted.append(length)

    def copied(count: int) -> None:
        assert count > reported[0]
        assert written(ends[count - 1]) == stream[:ends[count - 1]]
        reported[0] = count

    try:
        for copier in (stager.HostCopier(0), stager.HostCopier(1)):
            free.extend(order)
            order.clear()
            emitted.clear()
            reported[0] = 0
            stage(tensors, r, acquire=acquire, emit=emit, copier=copier, copied=copied)
            assert reported[0] == len(tensors) and sum(emitted) == len(stream)
    finally:
        r.close()


def test_a_block_made_for_a_non_contiguous_tensor_lives_until_its_copy_has_run(monkeypatch):
    """A non-contiguous tensor is copied through contiguous blocks made on the way; a
    block whose last bytes wait in the queue for the next batch must stay alive until
    that batch has run (freed, its memory is reused and the ring gets other bytes)."""
    from asyncckpt.rank import stager

    made: list[tuple[int, int, weakref.ref]] = []  # blocks made: (address, end, piece)
    real_pieces = stager.byte_pieces

    def pieces(t, max_bytes):
        for piece in real_pieces(t, max_bytes):
            if not t.is_contiguous():
                made.append((piece.data_ptr(), piece.data_ptr() + piece.numel(),
                             weakref.ref(piece)))
            yield piece

    class Checking(stager.HostCopier):
        def run(self, jobs):
            for _, source, _n in jobs:  # a freed block's memory may hold a newer block
                assert any(ref() is not None for a, end, ref in made if a <= source < end), \
                    "a queued copy reads a freed block"
            super().run(jobs)

    monkeypatch.setattr(stager, "byte_pieces", pieces)
    r = ring.Ring.create(4096, 6)
    try:
        t = torch.randn(40, 250, generator=torch.Generator().manual_seed(1)).t()  # 40000 B
        free, got = collections.deque(range(6)), []

        def emit(slot: int, length: int) -> None:
            view = r.slot_bytes(slot, length)
            got.append(bytes(view))
            view.release()
            free.append(slot)

        stage([t], r, acquire=free.popleft, emit=emit, copier=Checking(0))
        assert b"".join(got) == row_major_bytes(t) and len(made) > 1
    finally:
        r.close()
