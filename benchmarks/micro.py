"""Micro-measurements behind design choices quoted in the notes.

    python -m benchmarks.micro

- staging copy: 1 GiB host tensor into ring slots, 4 MiB at a time, with `Tensor.copy_`
  (OpenMP threads) and with `ctypes.memmove` (what the stager does), while a busy thread
  per core stands in for the writer;
- ring pages: the 1 GiB synthetic state copied into a ring of its size (ring = state),
  tensor by tensor, with the ring as shipped (MADV_HUGEPAGE) and as a plain memfd mapping
  of 4 KiB pages; the kernel grants the 2 MiB pages only where shmem_enabled is `advise`
  or `always`;
- first touch: 1 GiB read from the page cache (a file read once before) into memory
  touched before, into fresh memory (`torch.empty`, as a load's new tensors), and into
  fresh memory populated first in one madvise (MADV_POPULATE_WRITE): what a verified load
  into new tensors pays beyond the disk, next to a load `into=` existing ones;
- writer idle private memory (RssAnon) with the writer as shipped (no torch import) and
  for comparison a plain interpreter that imports torch.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import torch

import asyncckpt
from asyncckpt.ipc import ring
from asyncckpt.rank.stager import slot_tensor
from asyncckpt.runtime.procstat import read_status

SLOT = 4 << 20


def staging(gib: int = 1, busy: bool = True) -> dict[str, float]:
    r = ring.Ring.create(SLOT, 64)
    src = torch.randn((gib << 30) // 4).view(torch.uint8)
    stop = threading.Event()
    burners = [threading.Thread(target=lambda: [torch.randn(256, 256) @ torch.randn(256, 256)
                                                for _ in iter(stop.is_set, True)], daemon=True)
               for _ in range(1 if busy else 0)]
    for b in burners:
        b.start()
    out = {}
    try:
        for mode in ("copy_", "memmove", "copy_", "memmove"):
            started = time.perf_counter()
            for i in range(src.numel() // SLOT):
                slot = i % r.slots
                if mode == "copy_":
                    slot_tensor(r, slot).copy_(src[i * SLOT:(i + 1) * SLOT])
                else:
                    ctypes.memmove(r.address + slot * SLOT, src.data_ptr() + i * SLOT, SLOT)
            rate = src.numel() / (time.perf_counter() - started) / 1e9
            out[mode] = max(out.get(mode, 0.0), round(rate, 2))
    finally:
        stop.set()
        r.close()
    return out


def ring_pages(gib: float = 1, reps: int = 7) -> dict[str, object]:
    """The benchmark's synthetic state (hundreds of tensors) copied back to back into a
    ring of its size, as the stager does with ring = state."""
    from . import workloads
    state = workloads.build_state(workloads.synthetic(int(gib * (1 << 30))))
    tensors = [t for _, t in workloads.tensor_items(state)]
    slots = -(-sum(t.nbytes for t in tensors) // SLOT)
    shipped = ring.Ring.create(SLOT, slots)
    fd = os.memfd_create("plain-ring")
    os.ftruncate(fd, slots * SLOT)
    plain = mmap.mmap(fd, slots * SLOT)
    os.close(fd)
    plain.madvise(ring.MADV_POPULATE_WRITE)  # as Ring.create
    targets = {"shipped": shipped.address,
               "4 KiB pages": ctypes.addressof(ctypes.c_char.from_buffer(plain))}
    seconds: dict[str, list[float]] = {k: [] for k in targets}
    for _ in range(reps):
        for name, address in targets.items():
            started, offset = time.perf_counter(), 0
            for t in tensors:
                ctypes.memmove(address + offset, t.data_ptr(), t.nbytes)
                offset += t.nbytes
            seconds[name].append(time.perf_counter() - started)
    with open("/proc/self/smaps_rollup") as f:
        pmd = next(int(line.split()[1]) for line in f if line.startswith("ShmemPmdMapped"))
    with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
        setting = f.read().strip()
    shipped.close()
    return {"median_s": {k: round(statistics.median(v), 4) for k, v in seconds.items()},
            "shmem_enabled": setting, "huge_pages_granted_MiB": pmd >> 10}


def first_touch(gib: float = 1, reps: int = 5) -> dict[str, object]:
    """Seconds and CPU seconds (medians) to read `gib` GiB of a cached file, 4 MiB per
    preadv, into memory touched before, into fresh memory (`torch.empty`) and into fresh
    anonymous memory populated first (one madvise), interleaved."""
    size = int(gib * (1 << 30)) // SLOT * SLOT
    touched = memoryview(torch.ones(size, dtype=torch.uint8).numpy())

    def fresh() -> memoryview:
        return memoryview(torch.empty(size, dtype=torch.uint8).numpy())

    def populated() -> memoryview:
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(ring.MADV_POPULATE_WRITE)
        return memoryview(mapping)

    with tempfile.NamedTemporaryFile() as f:
        block = os.urandom(SLOT)
        for _ in range(size // SLOT):
            f.write(block)
        f.flush()

        def read_into(target: Callable[[], memoryview]) -> tuple[float, float]:
            wall, cpu = time.perf_counter(), time.process_time()
            view = target()  # the populate is timed with the reads
            for offset in range(0, size, SLOT):
                os.preadv(f.fileno(), [view[offset:offset + SLOT]], offset)
            return time.perf_counter() - wall, time.process_time() - cpu

        read_into(lambda: touched)  # the file into the page cache
        targets = {"touched": lambda: touched, "fresh": fresh, "fresh, populated": populated}
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in targets}
        for _ in range(reps):
            for name, target in targets.items():
                runs[name].append(read_into(target))
    return {name: {"s": round(statistics.median(w for w, _ in r), 3),
                   "cpu_s": round(statistics.median(c for _, c in r), 3)}
            for name, r in runs.items()}


def writer_idle_rss() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        writer = asyncckpt.start_writer(f"{tmp}/ckpt")
        try:
            time.sleep(0.5)
            ours = read_status(writer.pid)["RssAnon"]
        finally:
            writer.stop()
    code = "import torch, sys; print(open('/proc/self/status').read())"
    status = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    with_torch = next(int(line.split()[1]) * 1024
                      for line in status.splitlines() if line.startswith("RssAnon"))
    return {"writer_MiB": round(ours / 2**20, 1),
            "python_with_torch_MiB": round(with_torch / 2**20, 1)}


if __name__ == "__main__":
    print("staging GB/s (best of 2, one busy core):", staging())
    print("ring pages, 1 GiB copied in (median of 7):", ring_pages())
    print("first touch, 1 GiB read from the page cache (median of 5):", first_touch())
    print("idle private memory:", writer_idle_rss())
