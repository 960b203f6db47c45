"""Step time with no checkpointing, a memory save every step and a durable save every
step, on the demo model (examples/demo.py's MLP with AdamW), and the writer's memory.

    python -m benchmarks.memory_tier [--steps 60] [--batch 32] [--hidden 768]

One rank, one writer process, the Checkpointer with its optimizer fence (staging
overlaps the next forward/backward); the variants run interleaved in blocks of 10 steps
so that a busy machine weighs on all of them alike. Per variant: the median step time
(forward, backward, optimizer step, and the save call) and its overhead over no
checkpointing. Memory: the node's shard (the state's tensor bytes) against the writer's
shared memory (RssShmem: the memory tier's images) and private memory (RssAnon) after the
memory saves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import asyncckpt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

BLOCK = 10  # steps of one variant before the next


IMAGE_PREFIX = "/memfd:asyncckpt-mem-"  # the memory tier's images (writer/memory_image.py)
SAMPLE_S = 0.005  # how often `PeakImages` looks at the writer's descriptors


def image_bytes(pid: int) -> int:
    """The memory the memory tier's images of process `pid` hold now: the pages of every
    memfd it has open (mapped or not: a sealed image is unmapped, so RssShmem misses
    it), by the kernel's count (st_blocks)."""
    seen = {}  # each memfd once: a sender's read-only descriptor is the tier's memfd
    fds = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fds):
        try:
            if os.readlink(fds / fd).startswith(IMAGE_PREFIX):
                st = os.stat(fds / fd)
                seen[st.st_ino] = st.st_blocks * 512
        except OSError:  # closed meanwhile
            continue
    return sum(seen.values())


class PeakImages:
    """The peak of `image_bytes` of some processes, sampled every SAMPLE_S by a thread
    from `start()` to `stop()` (a peak shorter than a sample can be missed: the tier's
    own count, `MemoryTier.peak_bytes`, is exact). `series` keeps every sample, (time,
    bytes) per process, for `seconds_above`."""

    def __init__(self, pids: list[int]) -> None:
        self.pids, self.peak = pids, dict.fromkeys(pids, 0)
        self.series: dict[int, list[tuple[float, int]]] = {pid: [] for pid in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            for pid in self.pids:
                try:
                    held = image_bytes(pid)
                except OSError:
                    continue
                self.peak[pid] = max(self.peak[pid], held)
                self.series[pid].append((time.monotonic(), held))

    def seconds_above(self, pid: int, limit: int) -> tuple[float, float]:
        """(Seconds process `pid` held more than `limit` bytes of images, seconds
        sampled): each sample stands for the time up to the next one."""
        samples = self.series[pid]
        above = sum(t1 - t0 for (t0, held), (t1, _) in zip(samples, samples[1:])
                    if held > limit)
        return above, (samples[-1][0] - samples[0][0]) if len(samples) > 1 else 0.0

    def start(self) -> PeakImages:
        self._thread.start()
        return self

    def stop(self) -> dict[int, int]:
        self._stop.set()
        self._thread.join()
        return self.peak


def status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssShmem", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=768)
    args = parser.parse_args()
    torch.manual_seed(0)
    h = args.hidden
    model = torch.nn.Sequential(torch.nn.Linear(256, h), torch.nn.GELU(), torch.nn.Linear(h, h),
                                torch.nn.GELU(), torch.nn.Linear(h, h), torch.nn.GELU(),
                                torch.nn.Linear(h, 16))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, 256)
    times: dict[str, list[float]] = {"none": [], "memory": [], "durable": []}
    blocked: dict[str, list[float]] = {"memory": [], "durable": []}
    with tempfile.TemporaryDirectory() as d:
        writer = asyncckpt.start_writer(Path(d) / "ckpt", export=False, keep_last=2)
        try:
            plans = {"none": None,
                     "memory": asyncckpt.CheckpointerOptions(memory_interval=1,
                                                             save_interval=10**9),
                     "durable": asyncckpt.CheckpointerOptions(save_interval=1, keep_last=2)}
            ckpts = {k: asyncckpt.Checkpointer(Path(d) / "ckpt", model=model, optimizer=optim,
                                               options=o, address=writer.address, fence=False)
                     for k, o in plans.items() if o is not None}
            for c in ckpts.values():
                c.install_fence()
            step = 0
            for _ in range(max(1, args.steps // BLOCK)):
                for name in times:
                    for _ in range(BLOCK):
                        step += 1
                        started = time.perf_counter()
                        model(x).square().mean().backward()
                        optim.step()
                        optim.zero_grad()
                        handle = ckpts[name].save(step) if name in ckpts else None
                        times[name].append(time.perf_counter() - started)
                        if handle is not None:
                            blocked[name].append(handle.stats.blocked_seconds)
                    if name in ckpts:
                        ckpts[name].wait_until_finished()
            shard = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
                v.numel() * v.element_size() for s in optim.state.values()
                for v in s.values() if isinstance(v, torch.Tensor))
            mem = status(writer.pid)
            rings = sum(c.client.knobs.ring_size or 0 for c in ckpts.values())
            for c in ckpts.values():
                c.close()
        finally:
            writer.stop()
    base = statistics.median(times["none"])
    result = {"shard_bytes": shard, "writer": mem, "rings_bytes": rings,
              "memory_tier_bytes": mem["RssShmem"] - rings,
              "memory_tier_x_shard": round((mem["RssShmem"] - rings) / shard, 2),
              "save_call_blocked_ms": {k: 1e3 * statistics.median(v) for k, v in blocked.items()},
              "steps_per_variant": len(times["none"]),
              "median_step_s": {k: statistics.median(v) for k, v in times.items()},
              "overhead_pct": {k: 100 * (statistics.median(v) - base) / base
                               for k, v in times.items()}}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
