"""A rank process for multi-process tests.

    python rank_worker.py STEP MODE [MIB]

Environment: ASYNCCKPT_ADDRESS, RANK, WORLD_SIZE. The state is derived from the rank
and step (`worker_state`), so the test can rebuild it and compare bit for bit.
MODE: "save" saves and waits, printing the committed path or the error class;
"die" starts the save then SIGKILLs itself while staging.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

import asyncckpt


def worker_state(rank: int, step: int, mib: int = 1) -> dict:
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {"rank": rank, "step": step,
            "weight": torch.randn(mib << 18, generator=g),
            "state": {rank: torch.full((3,), float(rank))}}


def main() -> int:
    step, mode = int(sys.argv[1]), sys.argv[2]
    mib = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    rank = int(os.environ["RANK"])
    client = asyncckpt.connect(slot_size=1 << 20, ring_size=4 << 20)
    handle = client.save(step, worker_state(rank, step, mib))
    if mode == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        print("COMMITTED", handle.wait(120), flush=True)
    except asyncckpt.CheckpointError as e:
        print("FAILED", type(e).__name__, e, flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
