"""Micro-measurements behind design choices quoted in the notes.

    python -m benchmarks.micro

- staging copy: 1 GiB host tensor into ring slots, 4 MiB at a time, with `Tensor.copy_`
  (OpenMP threads) and with `ctypes.memmove` (what the stager does), while a busy thread
  per core stands in for the writer;
- writer idle private memory (RssAnon) with the writer as shipped (no torch import) and
  for comparison a plain interpreter that imports torch.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import tempfile
import threading
import time

import torch

import asyncckpt
from asyncckpt import ring
from asyncckpt.procstat import read_status

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
                    r.slot_tensor(slot).copy_(src[i * SLOT:(i + 1) * SLOT])
                else:
                    ctypes.memmove(r.address + slot * SLOT, src.data_ptr() + i * SLOT, SLOT)
            rate = src.numel() / (time.perf_counter() - started) / 1e9
            out[mode] = max(out.get(mode, 0.0), round(rate, 2))
    finally:
        stop.set()
        r.close()
    return out


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
    with_torch = next(int(l.split()[1]) * 1024 for l in status.splitlines() if l.startswith("RssAnon"))
    return {"writer_MiB": round(ours / 2**20, 1), "python_with_torch_MiB": round(with_torch / 2**20, 1)}


if __name__ == "__main__":
    print("staging GB/s (best of 2, one busy core):", staging())
    print("idle private memory:", writer_idle_rss())
