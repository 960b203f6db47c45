"""Peak memory of `asyncckpt export` against the model size, from a sharded checkpoint.

    python -m benchmarks.export_memory --model-gib 1 --ranks 2     (make bench-export)

A model of 64 MiB fp32 tensors is saved by `--ranks` simulated ranks as DTensors (half
`Shard(0)`, half `Shard(1)`, which is the worst case: every output tensor gathers a
column block from each rank), then `asyncckpt export` runs in its own process, as
stored and with `--dtype bfloat16`, `--reps` times each; the median peak RSS (VmHWM) is
compared with the model, the largest stored tensor (target: 2 x at most), and the same
interpreter's baseline after `import torch, asyncckpt.read.export`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, init_device_mesh
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

import asyncckpt

MiB = 1 << 20
ROWS = 4096  # tensors are ROWS x (64 MiB / 4 / ROWS) fp32


def save_sharded(root_writer: asyncckpt.WriterProcess, model_gib: float, ranks: int) -> int:
    n = max(1, int(model_gib * 1024) // 64)
    cols = (64 * MiB // 4) // ROWS
    clients = [asyncckpt.connect(root_writer.address, rank=r, world_size=ranks)
               for r in range(ranks)]
    handles = []
    for r, client in enumerate(clients):
        dist.init_process_group("fake", rank=r, world_size=ranks, store=FakeStore())
        mesh = init_device_mesh("cpu", (ranks,))
        model = {}
        for i in range(n):
            placements = (Shard(i % 2),)
            shape, offsets = compute_local_shape_and_global_offset((ROWS, cols), mesh, placements)
            g = torch.Generator().manual_seed(i * 1000 + r)
            local = torch.randn(shape, generator=g)
            model[f"layer{i}.weight"] = DTensor.from_local(local, mesh, placements, run_check=False,
                                                           shape=torch.Size((ROWS, cols)),
                                                           stride=(cols, 1))
        handles.append(client.save(1, {"model": model}))
        dist.destroy_process_group()
        handles[-1].wait_staged(600)
        del model
    for h in handles:
        h.wait(600)
    for c in clients:
        c.close()
    return n * 64 * MiB


def peak_rss(argv: list[str]) -> int:
    """VmHWM of a Python child running `argv`, in bytes."""
    code = ("import runpy, sys\n"
            f"sys.argv = {argv!r}\n"
            "try:\n    runpy.run_module(sys.argv[0], run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print('PEAK', open('/proc/self/status').read().split('VmHWM:')[1].split()[0])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    return int(out.split("PEAK")[-1].split()[0]) * 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-gib", type=float, default=1.0)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[int]] = {"as stored (fp32)": [], "--dtype bfloat16": [], "base": []}
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent / "results") as tmp:
        with asyncckpt.start_writer(Path(tmp) / "ckpt", codec="zstd",
                                    log_file=Path(tmp) / "writer.log") as writer:
            model_bytes = save_sharded(writer, args.model_gib, args.ranks)
        for rep in range(args.reps):
            for name, extra in (("as stored (fp32)", []), ("--dtype bfloat16", ["--dtype",
                                                                                "bfloat16"])):
                out = str(Path(tmp) / f"hf-{rep}-{len(extra)}")
                runs[name].append(peak_rss(["asyncckpt", "export", str(Path(tmp) / "ckpt"),
                                            "--out", out, *extra, "--max-shard-size", "256MiB"]))
            runs["base"].append(peak_rss(["asyncckpt.read.export"]))
    med = {name: statistics.median(peaks) for name, peaks in runs.items()}
    largest = 64 * MiB
    lines = [
        "## Export peak memory", "",
        f"`python -m benchmarks.export_memory --model-gib {args.model_gib} --ranks {args.ranks} "
        f"--reps {args.reps}`: model {model_bytes / MiB:.0f} MiB fp32 in 64 MiB tensors saved by "
        f"{args.ranks} ranks (Shard(0)/Shard(1), zstd); peak RSS of `asyncckpt export`, medians "
        f"of {args.reps}, above the interpreter with torch ({med['base'] / MiB:.0f} MiB).", "",
        "| export | peak RSS MiB (min–max) | above the interpreter | x the largest tensor "
        "| x the model |", "|---|---|---|---|---|"]
    for name in ("as stored (fp32)", "--dtype bfloat16"):
        over = med[name] - med["base"]
        lines.append(f"| {name} | {med[name] / MiB:.0f} ({min(runs[name]) / MiB:.0f}–"
                     f"{max(runs[name]) / MiB:.0f}) | {over / MiB:.0f} MiB | "
                     f"{over / largest:.2f} | {over / model_bytes:.3f} |")
    worst = max(med[n] - med["base"] for n in ("as stored (fp32)", "--dtype bfloat16")) / largest
    lines += ["", f"- worst / largest tensor: **{worst:.2f}x** (target <= 2x: "
              f"{'met' if worst <= 2 else 'MISSED'})", ""]
    text = "\n".join(lines)
    print(text)
    (Path(__file__).parent / "results" / "export_memory.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
