"""Writer private memory while a large state streams through a small ring.

    python -m benchmarks.writer_memory --state-gib 4 --ring-mib 256

The claim under test: the writer's private memory (RssAnon,
which excludes the shared ring) stays bounded by a constant plus the chunks in flight,
whatever the size of the state. The writer is sampled every 10 ms from outside.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

import asyncckpt
from asyncckpt.runtime.procstat import PeakSampler, read_status

MiB = 1 << 20


def make_state(gib: float) -> dict:
    """Training-like state: bf16 weights N(0, 0.02) and fp32 Adam moments, 64 MiB tensors."""
    state: dict = {"model": {}, "optim": {}}
    remaining, i = int(gib * 1024 * MiB), 0
    while remaining > 0:
        numel = min(remaining, 64 * MiB) // 4
        state["model"][f"layer{i}.w"] = torch.empty(numel, dtype=torch.bfloat16).normal_(0, 0.02)
        state["optim"][i] = {"exp_avg": torch.empty(numel // 2).normal_(0, 1e-3)}
        remaining -= numel * 2 + (numel // 2) * 4
        i += 1
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-gib", type=float, default=4.0)
    parser.add_argument("--ring-mib", type=int, default=256)
    parser.add_argument("--codec", default="zstd", choices=["zstd", "raw"])
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()

    state = make_state(args.state_gib)
    nbytes = sum(t.numel() * t.element_size() for d in state.values() for v in d.values()
                 for t in (v.values() if isinstance(v, dict) else [v]))
    root = Path(args.dir or tempfile.mkdtemp(prefix="asyncckpt-mem-")) / "ckpt"
    writer = asyncckpt.start_writer(root, codec=args.codec, incremental=False)
    try:
        idle = read_status(writer.pid)
        sampler = PeakSampler(writer.pid, interval=0.01)
        with asyncckpt.connect(writer.address, rank=0, world_size=1,
                               ring_size=args.ring_mib * MiB) as client:
            started = time.perf_counter()
            handle = client.save(1, state)
            handle.wait()
            seconds = time.perf_counter() - started
        peak = sampler.stop()
        final = read_status(writer.pid)
    finally:
        writer.stop()
        if args.dir is None:
            shutil.rmtree(root.parent, ignore_errors=True)
    result = {
        "state_bytes": nbytes, "ring_bytes": args.ring_mib * MiB, "codec": args.codec,
        "seconds_to_durable": round(seconds, 2), "GBps": round(nbytes / seconds / 1e9, 3),
        "stored_bytes": handle.stats.stored_bytes,
        "writer_rss_anon_idle_MiB": round(idle["RssAnon"] / MiB, 1),
        "writer_rss_anon_peak_MiB": round(peak / MiB, 1),
        "writer_vm_hwm_MiB": round(final["VmHWM"] / MiB, 1),
        "writer_rss_shmem_MiB": round(final.get("RssShmem", 0) / MiB, 1),
        "target_MiB": 256, "met": peak < 256 * MiB,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
