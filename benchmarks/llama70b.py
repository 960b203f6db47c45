"""A Llama-70B training state, one rank of a large job: measured here, projected to the job.

    python -m benchmarks.llama70b --world 512 --reps 3          (make bench-70b)

The shapes are Llama-3-70B's (hidden 8192, 80 layers, FFN 28672, 64 query / 8 KV heads,
vocab 128256, untied head: 70.6 B parameters), the dtypes a mixed-precision Adam job's:
bf16 weights (the model), fp32 master weights and two fp32 Adam moments (the
optimizer), 14 bytes per parameter, 988 GB in all. It is scaled down by the world size,
not by changing the model: the state is what one rank of a `--world`-rank FSDP job
holds, each tensor's Shard(0) slice (rows / world, rounded up) of every one of the 723
tensors of each kind, so the tensor count, dtypes and per-rank bytes are the real ones
for a job of that size.

Measured in one run, medians of `--reps`: a plain `connect()` with default knobs (the
ring sized from the first save, codec auto) saving that state (blocked: `save()` +
`wait_staged()`; durable: `wait()`), the rank's extra RSS and the writer's private RSS,
a cold verified `load`, the export of one whole decoder layer (as each host exports its
share of the full model's whole tensors), and the machine's limits (one-thread copy,
sequential write + fsync, same bytes). The projection divides the full job's bytes by
those measured rates: one writer per host of 8 ranks,
a host with this machine's disk and memory bandwidth. Every projected cell names the
measured figure it comes from.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import asyncckpt

from . import limits, measure

HERE = Path(__file__).resolve().parent
GB, GiB, MiB = 1e9, 1 << 30, 1 << 20
HIDDEN, LAYERS, FFN, KV, VOCAB = 8192, 80, 28672, 1024, 128256
RANKS_PER_HOST = 8
BYTES_PER_PARAM = 2 + 4 + 4 + 4  # bf16 weight, fp32 master, exp_avg, exp_avg_sq


def shapes() -> dict[str, tuple[int, ...]]:
    """Every weight of Llama-3-70B, by its Hugging Face name."""
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
                    p + "self_attn.k_proj.weight": (KV, HIDDEN),
                    p + "self_attn.v_proj.weight": (KV, HIDDEN),
                    p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                    p + "mlp.gate_proj.weight": (FFN, HIDDEN),
                    p + "mlp.up_proj.weight": (FFN, HIDDEN),
                    p + "mlp.down_proj.weight": (HIDDEN, FFN),
                    p + "input_layernorm.weight": (HIDDEN,),
                    p + "post_attention_layernorm.weight": (HIDDEN,)})
    out["model.norm.weight"] = (HIDDEN,)
    out["lm_head.weight"] = (VOCAB, HIDDEN)
    return out


def rank_state(world: int) -> dict[str, Any]:
    """Rank 0's Shard(0) slice of every tensor of the training state."""
    g = torch.Generator().manual_seed(0)
    model, master, avg, sq = {}, {}, {}, {}
    for name, shape in shapes().items():
        local = (math.ceil(shape[0] / world), *shape[1:])
        weight = torch.randn(local, generator=g) * 0.02
        model[name] = weight.to(torch.bfloat16)
        master[name] = weight
        avg[name] = torch.randn(local, generator=g) * 1e-3
        sq[name] = torch.rand(local, generator=g) * 1e-6
    return {"model": model, "optim": {"master": master, "exp_avg": avg, "exp_avg_sq": sq},
            "step": 1}


def tensor_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    return 0


def measure_run(world: int, reps: int, work: Path, export_world: int = 1) -> dict[str, Any]:
    state = rank_state(world)
    nbytes, model_bytes = tensor_bytes(state), tensor_bytes(state["model"])
    tensors = list(_tensors(state))
    root = work / "root"
    writer = asyncckpt.start_writer(root, incremental=False, log_file=work / "writer.log")
    saves: list[dict[str, float]] = []
    copies, writes = [], []
    try:
        with asyncckpt.connect(writer.address) as client:
            for step in range(1, reps + 2):  # the first is the warm-up (it sizes the ring)
                dst = limits.packed_destination(tensors)
                copies.append(limits.copy_tensors(tensors, dst))
                del dst
                started = time.perf_counter()
                handle = client.save(step, state)
                handle.wait_staged()
                blocked = time.perf_counter() - started
                handle.wait(1800)
                durable = time.perf_counter() - started
                saves.append({"blocked": blocked, "durable": durable,
                              "writer_rss": handle.stats.to_json().get("writer_peak_rss_anon", 0)})
                writes.append(limits.write_tensors(work / "reference.bin", tensors))
                (work / "reference.bin").unlink()
            ring = client.knobs.ring_size
    finally:
        writer.stop()
    measure.drop_cache(root)
    started = time.perf_counter()
    loaded = asyncckpt.load(root)
    load_s = time.perf_counter() - started
    assert torch.equal(loaded["optim"]["master"]["lm_head.weight"],
                       state["optim"]["master"]["lm_head.weight"])
    del loaded
    count = len(tensors)
    del state, tensors
    export = measure_export(work / "layer", work / "layer-root", export_world)
    timed = saves[1:]
    med = {key: statistics.median(s[key] for s in timed) for key in ("blocked", "durable")}
    return {"world": world, "bytes": nbytes, "model_bytes": model_bytes, "tensors": count,
            "reps": reps, "blocked": med["blocked"], "durable": med["durable"],
            "saves": saves, "ring": ring,
            "writer_rss": max(s["writer_rss"] for s in saves),
            "copy_1thread": statistics.median(copies[1:]),
            "write_fsync": statistics.median(writes[1:]),
            "load": load_s, **export, "loadavg": measure.loadavg()}


def measure_export(out: Path, root_of_layer: Path, world: int = 1) -> dict[str, float]:
    """Export of whole tensors, as each host exports its share of the full model: one
    decoder layer at its real shapes (bf16, 9 tensors, 1.7 GB; sliced by `world` for a
    smoke test) saved raw, then `export_hf` timed in this process from a cold cache, and
    the command (its interpreter and imports included) for reference."""
    g = torch.Generator().manual_seed(1)
    layer = {name: (torch.randn((math.ceil(shape[0] / world), *shape[1:]), generator=g)
                    * 0.02).to(torch.bfloat16)
             for name, shape in shapes().items() if name.startswith("model.layers.0.")}
    nbytes = tensor_bytes(layer)
    writer = asyncckpt.start_writer(root_of_layer, codec="raw", log_file=out.parent / "layer.log")
    try:
        with asyncckpt.connect(writer.address) as client:
            client.save(1, {"model": layer}).wait(1800)
    finally:
        writer.stop()
    del layer
    measure.drop_cache(root_of_layer)
    started = time.perf_counter()
    asyncckpt.export_hf(root_of_layer, out)
    in_process = time.perf_counter() - started
    shutil.rmtree(out)
    measure.drop_cache(root_of_layer)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "asyncckpt", "export", str(root_of_layer), "--out",
                    str(out)], check=True, stdout=subprocess.DEVNULL)
    command = time.perf_counter() - started
    return {"export_bytes": nbytes, "export": in_process, "export_command": command}


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    return []


def projection(m: dict[str, Any]) -> list[dict[str, Any]]:
    """The full 70B job on 1, 8 and 64 hosts of 8 ranks, from the rates measured here."""
    params = sum(math.prod(s) for s in shapes().values())
    total = params * BYTES_PER_PARAM
    model_total = params * 2
    stage_rate = m["bytes"] / m["blocked"]           # one rank's staging, per rank
    host_rate = m["bytes"] / m["durable"]            # one writer (per host), this disk
    export_rate = m["export_bytes"] / m["export"]    # bf16 bytes out per host
    rows = []
    for hosts in (1, 8, 64):
        ranks = hosts * RANKS_PER_HOST
        per_rank, per_host = total / ranks, total / hosts
        rows.append({
            "hosts": hosts, "ranks": ranks, "state_per_rank": per_rank,
            "host_memory_per_rank": per_rank,   # ring = state (memory allowing)
            "writer_memory": m["writer_rss"],
            "blocked": per_rank / stage_rate,
            "durable": per_host / host_rate,
            "export": model_total / (export_rate * hosts),
        })
    return [{"params": params, "total": total, "model_total": model_total,
             "stage_rate": stage_rate, "host_rate": host_rate, "export_rate": export_rate}, *rows]


def markdown(m: dict[str, Any], proj: list[dict[str, Any]], command: str) -> str:
    head, rows = proj[0], proj[1:]
    lines = [
        "# Llama-70B training state: measured on one rank, projected to the job", "",
        f"Command: `{command}` — {os.cpu_count()} cores; load average {m['loadavg'][0]} at "
        "the end. Medians of the timed saves after one warm-up.", "",
        f"**Measured** (rank 0 of a {m['world']}-rank job: {m['tensors']} tensors, "
        f"{m['bytes'] / GB:.2f} GB, real Llama-3-70B shapes sliced Shard(0), bf16 + fp32 "
        "master + 2 fp32 Adam moments; plain `connect()`, default knobs):", "",
        "| figure | measured | same run, same bytes |", "|---|---|---|",
        f"| blocked per save (`save` + `wait_staged`) | {m['blocked']:.2f} s "
        f"({m['bytes'] / m['blocked'] / GB:.2f} GB/s) | one-thread copy {m['copy_1thread']:.2f} s "
        "|",
        f"| time to durable | {m['durable']:.2f} s ({m['bytes'] / m['durable'] / GB:.2f} GB/s) | "
        f"write + fsync {m['write_fsync']:.2f} s |",
        f"| ring chosen at the first save (the rank's extra host memory) | "
        f"{m['ring'] / MiB:,.0f} MiB | state {m['bytes'] / MiB:,.0f} MiB |",
        f"| writer peak private RSS | {m['writer_rss'] / MiB:.0f} MiB | bound 256 MiB |",
        f"| cold verified load | {m['load']:.2f} s ({m['bytes'] / m['load'] / GB:.2f} GB/s) | |",
        f"| `export_hf` of one whole decoder layer (bf16, 9 tensors, "
        f"{m['export_bytes'] / GB:.2f} GB), cold | {m['export']:.2f} s "
        f"({m['export_bytes'] / m['export'] / GB:.2f} GB/s out) | as a command, imports "
        f"included: {m['export_command']:.2f} s |", "",
        f"**Projected**: the whole state is {head['params'] / 1e9:.1f} B parameters x "
        f"{BYTES_PER_PARAM} B = {head['total'] / GB:,.0f} GB ({head['model_total'] / GB:,.0f} GB "
        f"of bf16 weights); {RANKS_PER_HOST} ranks and one writer per host, each host with this "
        "machine's disk and memory bandwidth, and the memory for a ring the size of each "
        "rank's state (25% of MemAvailable over 8 ranks: 32x the per-rank state free).", "",
        "| hosts (ranks) | state per rank | extra host memory per rank (ring) + per writer | "
        "blocked per save | time to durable | export to HF, bf16 |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['hosts']} ({r['ranks']}) | {r['state_per_rank'] / GB:.1f} GB | "
            f"{r['host_memory_per_rank'] / GB:.1f} GB + {r['writer_memory'] / MiB:.0f} MiB | "
            f"{r['blocked']:.1f} s | {r['durable'] / 60:.1f} min | {r['export'] / 60:.1f} min |")
    lines += [
        "", "How each projected cell is computed: blocked = state per rank / the measured "
        f"staging rate ({head['stage_rate'] / GB:.2f} GB/s per rank, ranks of a host staging "
        "in parallel into their own rings); time to durable = bytes per host / the measured "
        f"writer rate ({head['host_rate'] / GB:.2f} GB/s, this disk); export = bf16 bytes / "
        f"(the measured export rate {head['export_rate'] / GB:.2f} GB/s x hosts, each host "
        "exporting its share with `--part`). With less memory the ring is smaller and "
        "staging waits for the disk for the rest of the state.",
        "Not measured here: 8 ranks of one host sharing its memory bandwidth and disk (a "
        "host's NVMe is typically several times this VM's disk, which would shorten the "
        "durable and export columns in proportion), and GPU-to-host copies (`make bench-gpu`).",
        ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=512, help="ranks the state is sliced for")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--export-world", type=int, default=1,
                        help="slice the exported layer too (1: whole tensors; tests only)")
    parser.add_argument("--workdir", default=str(HERE / "results" / "tmp" / "llama70b"))
    parser.add_argument("--out", default=str(HERE / "results" / "llama70b"))
    args = parser.parse_args(argv)
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        m = measure_run(args.world, args.reps, work, args.export_world)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    proj = projection(m)
    command = f"python -m benchmarks.llama70b --world {args.world} --reps {args.reps}"
    text = markdown(m, proj, command)
    Path(args.out + ".json").write_text(json.dumps({"command": command, "measured": m,
                                                    "projection": proj}, indent=1) + "\n")
    Path(args.out + ".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
