"""Soak: many small saves in a row; the writer must not grow.

    python scripts/faults/soak.py --ranks 4 --saves 500

N rank processes save `saves` consecutive steps through one writer with keep_last=3.
After a warm-up and at the end we read the writer's private memory (RssAnon), its open
file descriptors and the rings it maps; every kept checkpoint must
verify. Reported: the drift of each between warm-up and end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import asyncckpt
from asyncckpt.read.verification import verify_checkpoint
from asyncckpt.runtime.procstat import read_status, ring_mappings
from asyncckpt.storage.posix import PosixStorage

RANK = """
import sys, torch, asyncckpt
rank, world, saves = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
g = torch.Generator().manual_seed(rank)
state = {"w": torch.randn(20_000, generator=g), "opt": {0: {"m": torch.randn(5_000, generator=g)}}}
with asyncckpt.connect(rank=rank, world_size=world, slot_size=64 << 10, ring_size=256 << 10) as c:
    for step in range(1, saves + 1):
        state["w"][0] = step
        c.save(step, {**state, "step": step}).wait(60)
        print(step, flush=True)
"""

WARMUP = 20


def writer_reading(pid: int) -> dict:
    return {"rss_anon": read_status(pid)["RssAnon"], "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "rings": ring_mappings(pid)}


def soak(ranks: int, saves: int, root: Path) -> dict:
    writer = asyncckpt.start_writer(root, keep_last=3, log_file=root.parent / "writer.log")
    try:
        procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(ranks), str(saves)],
                                  stdout=subprocess.PIPE, text=True) for r in range(ranks)]
        warm = None
        assert procs[0].stdout is not None
        for line in procs[0].stdout:
            if int(line) == WARMUP:
                warm = writer_reading(writer.pid)
        codes = [p.wait(600) for p in procs]
        end = writer_reading(writer.pid)
        kept = PosixStorage(root).committed_steps()
        bad = [s for s in kept if not verify_checkpoint(root / f"step-{s:08d}").ok]
    finally:
        writer.stop()
    assert warm is not None and codes == [0] * ranks, codes
    return {"ranks": ranks, "saves_per_rank": saves, "kept_steps": kept, "kept_corrupt": bad,
            "rss_anon_growth_MiB": round((end["rss_anon"] - warm["rss_anon"]) / 2**20, 2),
            "fd_growth": end["fds"] - warm["fds"], "ring_growth": end["rings"] - warm["rings"],
            "writer_rss_anon_end_MiB": round(end["rss_anon"] / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--saves", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="asyncckpt-soak-") as tmp:
        result = soak(args.ranks, args.saves, Path(tmp) / "ckpt")
    print("soak:", json.dumps(result))
    ok = (result["rss_anon_growth_MiB"] < 10 and result["fd_growth"] <= 0
          and result["ring_growth"] <= 0 and not result["kept_corrupt"]
          and result["kept_steps"] == list(range(args.saves - 2, args.saves + 1)))
    print("soak:", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
