"""The writer's drain rate for back-to-back saves, and what each stage of it costs.

    python -m benchmarks.drain --gib 1 --reps 5 [--codec auto] [--knob name=value ...]

A save asked for while the previous one is still in flight waits for it (a
Checkpointer's on_busy="block", what every integration uses), so saves back to back
(no training step between) block the loop for about one save's time to durable, with
nothing else running. This measures that chain on the state bench-frameworks saves at
its mid size (bias-free Linear(2048) layers after AdamW steps: fp32 weights and both
moments) with the writer's own knobs:

- `durable` per save, saves back to back (each waits for the one before, as
  on_busy="block" does), with the writer's codec choice, its encode and write/fsync
  thread time and what it stored (new bytes and references: with the default
  incremental saves, back-to-back saves of an unchanged state are references);
- `changed`: the same, but one AdamW step between saves outside the timing, so that
  every save writes all its bytes (what a framework's back-to-back saves after training
  meet on the first of them);
- stage limits on the same bytes in this process: xxh3_64 and xxh3_128, each stored
  codec's encode on one thread (4 MiB frames), and a write + fsync of the state's size.

Run it under the bench lock (the figures are times on a shared 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

GiB, MiB = 1 << 30, 1 << 20
SLOT = 4 * MiB
WIDTH = 2048


def adamw_state(gib: float, width: int = WIDTH) -> dict[str, Any]:
    """The bench-frameworks mid-size state: Linear(`width`) layers, AdamW after 2 steps."""
    torch.manual_seed(0)
    layers = max(1, math.ceil(gib * GiB / (12 * width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                  for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(2):
        model(torch.randn(8, width, generator=torch.Generator().manual_seed(step))
              ).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "_m": model, "_o": opt}


def _step(state: dict[str, Any]) -> None:
    model, opt = state["_m"], state["_o"]
    model(torch.randn(8, model[0].in_features)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def _saved(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": state["model"], "optimizer": state["optimizer"]}


def _tensors(state: dict[str, Any]) -> list[np.ndarray]:
    out = list(state["model"].values())
    for s in state["optimizer"]["state"].values():
        out += [v for v in s.values() if v.numel() > 1]
    return [t.contiguous().view(torch.uint8).numpy() for t in out]


def back_to_back(root: Path, state: dict[str, Any], reps: int, codec: str,
                 knobs: dict[str, Any], changed: bool) -> list[dict[str, Any]]:
    """Saves back to back through one writer: per save its durable time and stats."""
    import asyncckpt
    nbytes = sum(t.nbytes for t in _tensors(state))
    writer = asyncckpt.start_writer(root, codec=codec, log_file=root.parent / "writer.log",
                                    **knobs)
    client = asyncckpt.connect(writer.address, rank=0, world_size=1, slot_size=SLOT,
                               ring_size=-(-nbytes // SLOT) * SLOT + 4 * SLOT)
    out = []
    try:
        client.save(0, _saved(state)).wait()  # the first save pays one-time costs
        for step in range(1, reps + 1):
            if changed:
                _step(state)
            start = time.perf_counter()
            handle = client.save(step, _saved(state), keep_last=2)
            handle.wait()
            s = handle.stats
            out.append({"durable": time.perf_counter() - start,
                        "staging": s.staging_seconds, "codec": s.codec,
                        "new_mib": s.new_bytes / MiB, "referenced_mib": s.referenced_bytes / MiB,
                        "stored_mib": s.stored_bytes / MiB, "encode_s": s.encode_seconds,
                        "write_s": s.write_seconds, "writer_s": s.seconds,
                        "frames": s.frames})
    finally:
        client.close()
        writer.stop()
    return out


def framework_schedule(root: Path, state: dict[str, Any], gap: int = 2, spaced: int = 3,
                       back: int = 3) -> dict[str, Any]:
    """bench-frameworks' schedule through a Checkpointer (on_busy="block", keep_last=2,
    the node writer it starts, as the integrations use): `spaced` saves `gap` AdamW steps
    apart, then `back` saves back to back. Per save the call's time, its durable time and
    what it stored; and the writer's log lines."""
    from asyncckpt.checkpointer import Checkpointer, CheckpointerOptions
    ckpt = Checkpointer(root, model=state["_m"], optimizer=state["_o"],
                        options=CheckpointerOptions(save_interval=1, keep_last=2))
    records: list[dict[str, Any]] = []
    handles = []
    step = 0
    try:
        for i, kind in enumerate(["first"] + ["spaced"] * spaced + ["back"] * back):
            if kind != "back" or i == 1 + spaced:  # the first back save follows a gap too
                for _ in range(gap):
                    _step(state)  # the Checkpointer's fence waits for staging here
            step += 1
            start = time.perf_counter()
            handle = ckpt.save(step, force=True)
            assert handle is not None  # force=True always saves (on_busy "block")
            records.append({"kind": kind, "call": time.perf_counter() - start,
                            "started": start})
            handles.append(handle)
        ckpt.wait_until_finished()
        for r, h in zip(records, handles):
            s = h.stats
            r.update(durable=s.seconds, codec=s.codec, new_mib=s.new_bytes / MiB,
                     referenced_mib=s.referenced_bytes / MiB, write_s=s.write_seconds,
                     encode_s=s.encode_seconds, staging=s.staging_seconds)
            del r["started"]
    finally:
        ckpt.close()
    logs = [p.read_text() for p in root.parent.glob("*.log")]
    return {"saves": records, "log": [line for text in logs for line in text.splitlines()
                                       if "committed" in line or "codec auto" in line]}


def stage_limits(state: dict[str, Any], work: Path) -> dict[str, float]:
    """GB/s of each stage on the state's bytes, one thread, 4 MiB frames."""
    from asyncckpt.codec.registry import CODECS, CodecParams, FrameHints, make_codec
    frames = [memoryview(t.reshape(-1).data)[i:i + SLOT] for t in _tensors(state)
              for i in range(0, t.nbytes, SLOT)]
    nbytes = sum(len(f) for f in frames)
    out: dict[str, float] = {}
    for name, fn in (("xxh3_64", xxhash.xxh3_64_intdigest),
                     ("xxh3_128", xxhash.xxh3_128_intdigest)):
        start = time.perf_counter()
        for f in frames:
            fn(f)
        out[f"{name}_gbps"] = nbytes / (time.perf_counter() - start) / 1e9
    sample = frames[::8]
    sampled = sum(len(f) for f in sample)
    for name in CODECS:
        if name == "raw":
            continue
        codec = make_codec(name, CodecParams(1, 256 << 10, 0.97))
        stored = 0
        start = time.perf_counter()
        for f in sample:  # fp32 everywhere; one probe per frame (the writer: per tensor)
            choice = codec.probe(f, 4, 0)
            stored += sum(len(p) for p in codec.encode(
                f, FrameHints(4, 0, choice.planes, choice.rotated)).pieces)
        out[f"{name}_gbps"] = sampled / (time.perf_counter() - start) / 1e9
        out[f"{name}_ratio"] = stored / sampled
    work.mkdir(parents=True, exist_ok=True)
    path = work / "limit.bin"
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for f in frames:
            os.write(fd, f)
        os.fsync(fd)
    finally:
        os.close(fd)
    out["write_fsync_gbps"] = nbytes / (time.perf_counter() - start) / 1e9
    path.unlink()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--codec", default="auto")
    ap.add_argument("--knob", action="append", default=[], help="writer knob name=value")
    ap.add_argument("--changed", action="store_true", help="an AdamW step between saves")
    ap.add_argument("--limits", action="store_true", help="also the stage limits")
    ap.add_argument("--schedule", action="store_true",
                    help="bench-frameworks' schedule through a Checkpointer instead")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    knobs: dict[str, Any] = {}
    for kv in args.knob:
        k, v = kv.split("=", 1)
        knobs[k] = json.loads(v) if v[:1].isdigit() or v in ("true", "false") else v
    state = adamw_state(args.gib)
    result: dict[str, Any] = {"load_before": os.getloadavg(), "codec": args.codec,
                              "knobs": knobs, "changed": args.changed,
                              "bytes": sum(t.nbytes for t in _tensors(state))}
    with tempfile.TemporaryDirectory(dir=args.dir or ".", prefix=".bench-drain-") as d:
        if args.limits:
            result["limits"] = stage_limits(state, Path(d) / "limits")
        if args.schedule:
            result.update(framework_schedule(Path(d) / "root", state))
            print(json.dumps(result, indent=1))
            return 0
        saves = back_to_back(Path(d) / "root", state, args.reps, args.codec, knobs,
                             args.changed)
        shutil.rmtree(Path(d) / "root", ignore_errors=True)
    result["saves"] = saves
    result["median_durable"] = statistics.median(s["durable"] for s in saves)
    result["load_after"] = os.getloadavg()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
