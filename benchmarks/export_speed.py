"""`asyncckpt export` against the disk: a cold read + write + fsync of the same bytes.

    python -m benchmarks.export_speed --gib 2 --tensors 32 --reps 3   (make bench-export;
                                                    make bench runs it too, its targets listed)

An export reads every stored byte once (verified) and writes every exported byte once,
so its limit on one machine is a plain copy of the checkpoint's data files: a cold
sequential read in 8 MiB blocks, each block written to a new file, then fsync. Each
repetition runs, interleaved and from a cold cache (the checkpoint's files dropped with
POSIX_FADV_DONTNEED): the plain copy, `asyncckpt export` as a command (its imports
included, as a user waits for them), and `asyncckpt export --jobs 2`. Medians; the
ratios are the result (the machine is shared and noisy). A 2 GiB fp32 model in 32
tensors written with the raw codec is the workload the performance issue measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import asyncckpt

from . import measure

HERE = Path(__file__).resolve().parent
MiB, GiB = 1 << 20, 1 << 30
BLOCK = 8 * MiB


def save_model(root: Path, gib: float, tensors: int, codec: str) -> Path:
    per = int(gib * GiB) // tensors // 4
    state = {"model": {f"layers.{i}.weight":
                       torch.randn(per, generator=torch.Generator().manual_seed(i))
                       for i in range(tensors)}}
    writer = asyncckpt.start_writer(root, codec=codec)
    try:
        with asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
            client.save(1, state).wait(600)
    finally:
        writer.stop()
    return next(root.glob("step-*"))


def plain_copy(step: Path, out: Path) -> float:
    """Cold sequential read of the step's data files, each block written to a new file
    in `out`, then fsync of each file and of `out`."""
    measure.drop_cache(step)
    out.mkdir()
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    started = time.perf_counter()
    for source in sorted(step.glob("rank-*")):
        with open(source, "rb", buffering=0) as f, open(out / source.name, "wb", buffering=0) as g:
            while n := f.readinto(buffer):
                g.write(view[:n])
            os.fsync(g.fileno())
    fd = os.open(out, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - started


def export(step: Path, out: Path, jobs: int) -> float:
    measure.drop_cache(step)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "asyncckpt", "export", str(step), "--out", str(out),
                    "--jobs", str(jobs)], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def run(gib: float, tensors: int, reps: int, codec: str, workdir: Path) -> dict:
    """Save the model, then `reps` interleaved rounds of the three runs; the seconds."""
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    try:
        step = save_model(workdir / "root", gib, tensors, codec)
        size = measure.bytes_on_disk(step)
        times: dict[str, list[float]] = {"plain": [], "export": [], "export-jobs2": []}
        for rep in range(reps):
            for name, go in (("plain", lambda o: plain_copy(step, o)),
                             ("export", lambda o: export(step, o, 1)),
                             ("export-jobs2", lambda o: export(step, o, 2))):
                out = workdir / f"{name}-{rep}"
                times[name].append(go(out))
                shutil.rmtree(out)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return report(gib, tensors, reps, codec, size, times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--codec", default="raw")
    parser.add_argument("--workdir", default=str(HERE / "results" / "tmp" / "export-speed"))
    parser.add_argument("--out", default=str(HERE / "results" / "export_speed"))
    args = parser.parse_args(argv)
    result = run(args.gib, args.tensors, args.reps, args.codec, Path(args.workdir))
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    Path(args.out + ".md").write_text(result["markdown"])
    print(result["markdown"])
    return 0


def report(gib: float, tensors: int, reps: int, codec: str, size: int,
           times: dict[str, list[float]]) -> dict:
    med = {name: statistics.median(ts) for name, ts in times.items()}
    ratio, jobs = med["export"] / med["plain"], med["export-jobs2"] / med["export"]
    command = (f"python -m benchmarks.export_speed --gib {gib:g} --tensors {tensors} "
               f"--reps {reps} --codec {codec}")
    lines = [
        "## Export against the disk", "",
        f"`{command}` — {os.cpu_count()} cores, {size / GiB:.2f} GiB checkpoint ({tensors} "
        f"fp32 tensors, codec {codec}), cold cache each time, medians of {reps}, load average "
        f"{measure.loadavg()[0]} at the end.", "",
        "| run | seconds (min–max) | GB/s |", "|---|---|---|"]
    for name, label in (("plain", "plain cold read + write + fsync of the data files"),
                        ("export", "`asyncckpt export` (command, imports included)"),
                        ("export-jobs2", "`asyncckpt export --jobs 2`")):
        ts = times[name]
        lines.append(f"| {label} | {med[name]:.2f} ({min(ts):.2f}–{max(ts):.2f}) | "
                     f"{size / med[name] / 1e9:.2f} |")
    lines += ["", f"- export / plain copy: **{ratio:.2f}x** (target <= 1.3x: "
              f"{'met' if ratio <= 1.3 else 'MISSED'})",
              f"- `--jobs 2` / `--jobs 1`: **{jobs:.2f}x** (each process of `--jobs` pays its "
              "own interpreter and torch import; on one disk the copy is disk-bound)", ""]
    return {"command": command, "bytes": size, "seconds": times, "median": med,
            "export_over_plain": ratio, "jobs2_over_jobs1": jobs, "loadavg": measure.loadavg(),
            "markdown": "\n".join(lines)}


if __name__ == "__main__":
    sys.exit(main())
