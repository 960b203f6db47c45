"""GPU staging: device-to-host throughput and blocked time, asyncckpt vs DCP async_save.

    python -m benchmarks.gpu [--gib 2] [--reps 3]     (make bench-gpu; needs CUDA)

Same run, same CUDA state (bf16 weights + fp32 moments, 64 MiB tensors):
- limits: one D2H `copy_` of the whole state into pinned memory and into pageable
  memory (what the hardware and the driver give);
- asyncckpt (raw codec): `save()` call (blocked), until staged (the D2H into the pinned
  ring, overlappable with compute), until durable;
- DCP `async_save` (thread, default stager): the call (it stages before returning) and
  until durable.
Medians over `--reps`; results also go to benchmarks/results/gpu.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import asyncckpt

RESULTS = Path(__file__).parent / "results"


def cuda_state(gib: float) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    n = max(1, int(gib * 2**30) // (64 << 20))
    state = {}
    for i in range(n):
        dtype = torch.bfloat16 if i % 3 == 0 else torch.float32
        state[f"t{i}"] = torch.randn((64 << 20) // dtype.itemsize, device="cuda", generator=g,
                                     dtype=dtype)
    torch.cuda.synchronize()
    return state


def d2h_seconds(state: dict[str, torch.Tensor], pinned: bool) -> float:
    outs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in state.values()]
    torch.cuda.synchronize()
    started = time.perf_counter()
    for out, t in zip(outs, state.values()):
        out.copy_(t, non_blocking=pinned)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def run_asyncckpt(state: dict, root: Path, reps: int, ring_size: int) -> dict[str, float]:
    rows: dict[str, list[float]] = {"blocked": [], "staged": [], "durable": []}
    with asyncckpt.start_writer(root, codec="raw", log_file=root.parent / "writer.log",
                                incremental=False) as w, \
            asyncckpt.connect(w.address, rank=0, world_size=1, ring_size=ring_size) as client:
        for step in range(reps):
            torch.cuda.synchronize()
            started = time.perf_counter()
            handle = client.save(step, {"state": state}, keep_last=1)
            rows["blocked"].append(time.perf_counter() - started)
            handle.wait_staged(600)
            rows["staged"].append(time.perf_counter() - started)
            handle.wait(600)
            rows["durable"].append(time.perf_counter() - started)
        pinned = client._device.pinned
    out = {k: statistics.median(v) for k, v in rows.items()}
    out["ring_pinned"] = float(pinned)
    return out


def run_dcp(state: dict, out: Path, reps: int) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp
    rows: dict[str, list[float]] = {"blocked": [], "durable": []}
    for step in range(reps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        future = dcp.async_save({"state": state}, checkpoint_id=str(out / f"step-{step}"))
        rows["blocked"].append(time.perf_counter() - started)
        future.result()
        rows["durable"].append(time.perf_counter() - started)
    return {k: statistics.median(v) for k, v in rows.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks.gpu: no CUDA device here")
        return 2
    state = cuda_state(args.gib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    result = {"device": torch.cuda.get_device_name(), "bytes": nbytes,
              "d2h_pinned_s": min(d2h_seconds(state, True) for _ in range(args.reps)),
              "d2h_pageable_s": min(d2h_seconds(state, False) for _ in range(args.reps))}
    with tempfile.TemporaryDirectory() as tmp:
        result["asyncckpt_ring_state"] = run_asyncckpt(state, Path(tmp) / "a", args.reps,
                                                        nbytes + (64 << 20))
        result["asyncckpt_ring_256MiB"] = run_asyncckpt(state, Path(tmp) / "b", args.reps,
                                                        256 << 20)
        result["dcp_async_save"] = run_dcp(state, Path(tmp) / "dcp", args.reps)
    gb = nbytes / 1e9
    print(f"{result['device']}: {gb:.2f} GB state; D2H pinned {gb / result['d2h_pinned_s']:.1f} "
          f"GB/s, pageable {gb / result['d2h_pageable_s']:.1f} GB/s")
    for name in ("asyncckpt_ring_state", "asyncckpt_ring_256MiB", "dcp_async_save"):
        r = result[name]
        staged = (f", staged {r['staged']:.3f} s ({gb / r['staged']:.1f} GB/s)"
                  if "staged" in r else "")
        print(f"{name}: blocked {r['blocked']:.4f} s{staged}, durable {r['durable']:.3f} s")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gpu.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
