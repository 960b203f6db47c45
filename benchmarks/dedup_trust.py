"""What verifying referenced bytes costs an incremental save, with and without the
writer's trust of bytes it wrote or read a moment ago (writer/dedup_trust.py).

    python -m benchmarks.dedup_trust [--gib 1] [--saves 6] [--repeats 3] [--out FILE]

An unchanged state saved back to back through a real writer (codec raw, one rank): the
first save writes every byte, each later one references them all. Side by side in one
run, repeats interleaved so that a busy machine weighs on both: `dedup_trust_s=0` (read
and check every referenced byte at every save, the rule before the trust) and the
default. Per save: the time from the save call to durable (median over repeats) and the
referenced bytes read, with the frame threads' seconds in those reads, from the
writer's log. The limit beside it: one cold sequential read of a file of the state's
size (the page cache dropped with POSIX_FADV_DONTNEED, as the writer's writeback does).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import asyncckpt
from asyncckpt.config import WriterKnobs

GiB = 1 << 30
LINE = re.compile(r"step (\d+) verified (\d+) referenced bytes by reading them \(([\d.]+) s\)")


def one_run(base: Path, state: dict, saves: int, trust: float) -> dict:
    """Save `state` `saves` times through a fresh writer; times and reads per save."""
    root = Path(tempfile.mkdtemp(dir=base)) / "root"
    log = root.parent / "writer.log"
    times = []
    with asyncckpt.start_writer(root, codec="raw", log_file=log, dedup_trust_s=trust) as w, \
            asyncckpt.connect(w.address, rank=0, world_size=1) as client:
        for step in range(1, saves + 1):
            began = time.perf_counter()
            client.save(step, state).wait(600)
            times.append(time.perf_counter() - began)
    reads = {int(s): (int(b), float(t)) for s, b, t in LINE.findall(log.read_text())}
    shutil.rmtree(root.parent)
    return {"times": times, "read": [reads.get(s, (0, 0.0)) for s in range(1, saves + 1)]}


def cold_read(base: Path, nbytes: int) -> float:
    """Seconds to read `nbytes` written and fsynced, its pages dropped first."""
    path = base / "cold"
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(nbytes >> 20):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    began = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass
    took = time.perf_counter() - began
    path.unlink()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--saves", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/dedup_trust.md")
    args = parser.parse_args()
    per = int(args.gib * GiB) // 4 // 16
    state = {f"w{i}": torch.randn(per, generator=torch.Generator().manual_seed(i))
             for i in range(16)}
    nbytes = sum(t.numel() * 4 for t in state.values())
    default = WriterKnobs().dedup_trust_s
    load_before = os.getloadavg()
    runs: dict[float, list[dict]] = {0.0: [], default: []}
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        base = Path(tmp)
        limit = cold_read(base, nbytes)
        for _ in range(args.repeats):
            for trust in runs:
                runs[trust].append(one_run(base, state, args.saves, trust))
    load_after = os.getloadavg()
    rows = []
    for trust, done in runs.items():
        for i in range(args.saves):
            rows.append({
                "dedup_trust_s": trust, "save": i + 1,
                "durable_s": statistics.median(r["times"][i] for r in done),
                "read_mib": statistics.median(r["read"][i][0] for r in done) / (1 << 20),
                "read_s": statistics.median(r["read"][i][1] for r in done)})
    later = {t: statistics.median(r["durable_s"] for r in rows
                                  if r["dedup_trust_s"] == t and r["save"] > 2) for t in runs}
    lines = [
        "# Verifying referenced bytes: read at every save, or trusted a moment",
        "",
        f"`python -m benchmarks.dedup_trust --gib {args.gib:g} --saves {args.saves} "
        f"--repeats {args.repeats}` (`make bench-dedup-trust`): {nbytes / GiB:.2f} GiB "
        f"unchanged, saved back to back, codec raw, one rank; medians of {args.repeats} "
        f"repeats, interleaved; load average before {load_before[0]:.1f}, after "
        f"{load_after[0]:.1f} (2 cores shared with other jobs: times move with the load).",
        "",
        "| dedup_trust_s | save | time to durable (s) | referenced MiB read | "
        "frame threads' seconds reading |",
        "|---|---|---|---|---|",
        *(f"| {r['dedup_trust_s']:g} | {r['save']} | {r['durable_s']:.3f} | "
          f"{r['read_mib']:.0f} | {r['read_s']:.3f} |" for r in rows),
        "",
        f"Saves 3 on, median: {later[0.0]:.3f} s reading every reference vs "
        f"{later[default]:.3f} s trusting for {default:g} s "
        f"({later[default] / later[0.0]:.2f} x). Limit measured in this run: a cold read of "
        f"{nbytes / GiB:.2f} GiB took {limit:.3f} s "
        f"({nbytes / GiB / limit:.2f} GiB/s) -- what save 2 pays with the trust off.",
        ""]
    Path(args.out).write_text("\n".join(lines))
    Path(args.out).with_suffix(".json").write_text(json.dumps(
        {"rows": rows, "cold_read_s": limit, "bytes": nbytes,
         "load": [load_before, load_after]}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
