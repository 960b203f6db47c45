"""One FSDP2 rank (gloo, CPU) of a simulated multi-node job that checkpoints every step to
the memory tier, run under torchrun (tests/multiprocess/test_memory_tier_nodes.py).

    torchrun ... memory_tier_worker.py

Environment:
    MT_ROOT       the checkpoint root (the same on every node)
    MT_OUT        shared directory for references and results
    MT_TAG        names this launch's result files (result-<tag>-rank<R>.json)
    MT_ADDRESS    this node's writer (started by the test, so that it outlives the ranks)
    MT_STEPS      train to this step, saving every step (memory) and every MT_DURABLE-th
                  step durably
    MT_RESUME     "1": restore first (whatever tier has the newest step) and compare the
                  state restored with the reference rank 0 wrote for that step

Rank 0 writes the full reference state of every step it saves (reference-<step>.pt).
Each rank's result: {"rank", "restored", "tier", "steps": {step: tier}}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_worker import _assert_same, build, full_state, leave, train  # noqa: E402

import asyncckpt  # noqa: E402

WAIT_S = 120


def main() -> int:
    out, rank = Path(os.environ["MT_OUT"]), None
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    os.environ["ASYNCCKPT_ADDRESS"] = os.environ["MT_ADDRESS"]
    model, optim = build(seed=int(os.environ.get("MT_SEED", "0")))
    options = asyncckpt.CheckpointerOptions(memory_interval=1,
                                            save_interval=int(os.environ["MT_DURABLE"]))
    ckpt = asyncckpt.Checkpointer(os.environ["MT_ROOT"], model=model, optimizer=optim,
                                  options=options, address=os.environ["MT_ADDRESS"])
    result: dict = {"rank": rank, "restored": None, "tier": None, "steps": {}}
    done = 0
    if os.environ.get("MT_RESUME") == "1":
        done = ckpt.restore() or 0
        result["restored"], result["tier"] = done, ckpt.restored_tier
        state = full_state(model, optim)
        if rank == 0:
            _assert_same(state, torch.load(out / f"reference-{done}.pt"), f"step {done}")
    for step in range(done + 1, int(os.environ["MT_STEPS"]) + 1):
        train(model, optim, range(step - 1, step))
        reference = full_state(model, optim)
        if rank == 0:
            torch.save(reference, out / f"reference-{step}.pt")
        handle = ckpt.save(step)
        assert handle is not None
        handle.wait(WAIT_S)
        result["steps"][step] = handle.stats.tier
    ckpt.close()
    (out / f"result-{os.environ['MT_TAG']}-rank{rank}.json").write_text(json.dumps(result))
    print(f"OK rank {rank}: restored {result['restored']} from {result['tier']}", flush=True)
    dist.barrier()
    leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
