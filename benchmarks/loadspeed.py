"""Cold verified load against safetensors and the disk, measured side by side.

`make bench` times one load per method among many other things; this one looks at loads
only, so that a change to the read path can be judged in under a minute: the same state
is saved once by the real writer per codec and once by safetensors, then every load is
timed cold (each file dropped from the page cache with posix_fadvise(DONTNEED) first;
the files are fsynced, hence clean) in interleaved rounds (A, B, C, A, B, C ...), and
medians are compared, so a neighbour's burst of work hits every method alike.

The methods:
- asyncckpt.load, per codec: fresh tensors, every byte checked against xxh3;
- asyncckpt.load(into=): the same into a state allocated (and touched) once, as a
  model's parameters are when a job resumes;
- safetensors.torch.load_file with one byte per page touched: it maps the file lazily,
  so without the touch nothing would be read;
- a cold sequential read of the raw checkpoint's data file into one reused 8 MiB
  buffer: the disk's limit for these bytes.

GB/s is the state's tensor bytes over seconds (the cold read: its file's bytes). The
load average is printed with every figure: on a shared machine it is half the story.

    python -m benchmarks.loadspeed --mib 1024 --state synthetic --codecs raw,zstd,bytegroup
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import measure, workloads

MiB = 1 << 20
READ_BLOCK = 8 * MiB
RESULTS_TMP = Path(__file__).resolve().parent / "results" / "tmp"  # ignored by git


def large_state(target_bytes: int, count: int = 4) -> dict[str, Any]:
    """`count` large tensors (bf16 and fp32 alternately) of about `target_bytes` in all."""
    state: dict[str, Any] = {}
    each = target_bytes // count
    for i in range(count):
        dtype = torch.bfloat16 if i % 2 == 0 else torch.float32
        cols = 4096
        rows = max(1, each // (cols * torch.empty((), dtype=dtype).element_size()))
        g = torch.Generator().manual_seed(workloads.SEED + i)
        state[f"w{i}"] = torch.empty(rows, cols, dtype=dtype).normal_(0.0, 0.02, generator=g)
    return state


def build(kind: str, nbytes: int) -> dict[str, Any]:
    if kind == "synthetic":
        return workloads.build_state(workloads.synthetic(nbytes))
    if kind == "large":
        return large_state(nbytes)
    raise ValueError(f"unknown state {kind!r}")


def save_asyncckpt(root: Path, state: dict[str, Any], codec: str) -> Path:
    """Save `state` as step 1 of `root` with a real writer; return the step directory."""
    import asyncckpt
    from asyncckpt.format.layout import step_dir_name
    slot = 4 * MiB
    ring = -(-workloads.state_bytes(state) // slot) * slot
    writer = asyncckpt.start_writer(root, codec=codec, incremental=False,
                                    log_file=root.parent / f"writer-{codec}.log")
    try:
        client = asyncckpt.connect(writer.address, rank=0, world_size=1, slot_size=slot,
                                   ring_size=ring)
        try:
            client.save(1, state).wait()
        finally:
            client.close()
    finally:
        writer.stop()
    return root / step_dir_name(1)


def save_safetensors(path: Path, state: dict[str, Any]) -> Path:
    from safetensors.torch import save_file
    save_file(workloads.flat_tensors(state), str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def cold_read(path: Path) -> int:
    """Read every file under `path` sequentially into one reused buffer; bytes read."""
    buf = bytearray(READ_BLOCK)
    view, total = memoryview(buf), 0
    for p in measure.files_under(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            offset = 0
            while n := os.preadv(fd, [view], offset):
                offset += n
            total += offset
        finally:
            os.close(fd)
    return total


def methods(state: dict[str, Any], roots: dict[str, Path], st_path: Path,
            into: bool) -> list[tuple[str, Path, Callable[[], Any]]]:
    """(name, files to drop, load) for every method measured."""
    from safetensors.torch import load_file

    import asyncckpt
    out: list[tuple[str, Path, Callable[[], Any]]] = []
    for codec, directory in roots.items():
        out.append((f"asyncckpt {codec}", directory,
                    lambda d=directory: asyncckpt.load(d)))
    if into and "raw" in roots:
        target = workloads.empty_like_state(state)
        for _, t in workloads.tensor_items(target):
            t.zero_()  # touched once, as a model's parameters are
        out.append(("asyncckpt raw into=", roots["raw"],
                    lambda: asyncckpt.load(roots["raw"], into=target)))

    def safetensors_load() -> Any:
        loaded = load_file(str(st_path))
        measure.touch_pages(list(loaded.values()))
        return loaded
    out.append(("safetensors load_file", st_path, safetensors_load))
    if "raw" in roots:
        out.append(("cold sequential read", roots["raw"], lambda: cold_read(roots["raw"])))
    return out


def measure_loads(entries: list[tuple[str, Path, Callable[[], Any]]], reps: int
                  ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(wall seconds, CPU seconds of this process) per rep of each entry, cold, in
    interleaved rounds (order rotated)."""
    times: dict[str, list[float]] = {name: [] for name, _, _ in entries}
    cpu: dict[str, list[float]] = {name: [] for name, _, _ in entries}
    for rep in range(reps):
        shift = rep % len(entries)
        for name, files, load in entries[shift:] + entries[:shift]:
            measure.drop_cache(files)
            start, start_cpu = time.perf_counter(), time.process_time()
            result = load()
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
            del result
    return times, cpu


def check_exact(state: dict[str, Any], roots: dict[str, Path]) -> None:
    import asyncckpt
    for codec, directory in roots.items():
        if not workloads.equal_states(state, asyncckpt.load(directory)):
            raise SystemExit(f"asyncckpt {codec}: the loaded state differs from the saved one")


def report(times: dict[str, list[float]], cpu: dict[str, list[float]], state_nbytes: int,
           file_nbytes: int, load: tuple[float, float]) -> list[str]:
    """The table: medians, GB/s, ratios to safetensors and to the cold read."""
    med = {name: statistics.median(ts) for name, ts in times.items()}
    ref_st = med.get("safetensors load_file")
    ref_read = med.get("cold sequential read")
    lines = [f"{'method':26} {'median s':>9} {'GB/s':>6} {'x safetensors':>14} "
             f"{'x cold read':>12} {'cpu s':>6}  all reps (s)"]
    for name, m in med.items():
        nbytes = file_nbytes if name == "cold sequential read" else state_nbytes
        rate = nbytes / m / 1e9
        st = f"{ref_st / m:.2f}" if ref_st else "-"
        rd = f"{rate / (file_nbytes / ref_read / 1e9):.2f}" if ref_read else "-"
        reps = " ".join(f"{t:.3f}" for t in times[name])
        lines.append(f"{name:26} {m:9.3f} {rate:6.2f} {st:>14} {rd:>12} "
                     f"{statistics.median(cpu[name]):6.3f}  {reps}")
    lines.append(f"load average {load[0]:.2f} before, {load[1]:.2f} after (1 min)")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=1024, help="state size in MiB")
    p.add_argument("--state", choices=("synthetic", "large"), default="synthetic",
                   help="synthetic: the benchmark's transformer state (many small tensors); "
                        "large: 4 large tensors")
    p.add_argument("--codecs", default="raw,zstd,bytegroup")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-into", action="store_true", help="skip the into= load")
    p.add_argument("--dir", type=Path, default=RESULTS_TMP,
                   help="where to write, on the disk being measured (default: %(default)s, "
                        "removed afterwards)")
    args = p.parse_args(argv)

    args.dir.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="loadspeed-", dir=args.dir))
    try:
        state = build(args.state, args.mib * MiB)
        tensors = list(workloads.tensor_items(state))
        nbytes = workloads.state_bytes(state)
        largest = max(t.numel() * t.element_size() for _, t in tensors)
        print(f"state {args.state}: {len(tensors)} tensors, {nbytes / MiB:.0f} MiB, largest "
              f"{largest / MiB:.1f} MiB, median "
              f"{statistics.median(t.numel() * t.element_size() for _, t in tensors) / 1024:.1f} "
              "KiB")
        roots = {c: save_asyncckpt(base / f"ckpt-{c}", state, c)
                 for c in args.codecs.split(",") if c}
        for codec, directory in roots.items():
            stored = sum(p.stat().st_size for p in measure.files_under(directory))
            print(f"  {codec}: {stored / MiB:.0f} MiB stored ({stored / nbytes:.3f} of raw)")
        st_path = save_safetensors(base / "state.safetensors", state)
        check_exact(state, roots)
        file_nbytes = sum(p.stat().st_size for p in measure.files_under(roots["raw"])) \
            if "raw" in roots else nbytes
        entries = methods(state, roots, st_path, not args.no_into)
        before = os.getloadavg()[0]
        times, cpu = measure_loads(entries, args.reps)
        after = os.getloadavg()[0]
        print(f"cold loads, median of {args.reps} interleaved, torch threads "
              f"{torch.get_num_threads()}, cpus {os.cpu_count()}")
        for line in report(times, cpu, nbytes, file_nbytes, (before, after)):
            print(line)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
