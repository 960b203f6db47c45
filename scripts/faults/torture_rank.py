"""A rank of the torture run: saves steps start, start+1, ... until killed.

    python torture_rank.py ADDRESS RANK WORLD START

Its state for a step is `expected_state(rank, step)`, so the checker can rebuild any
committed step bit for bit; part of it changes only every BASE_STEPS steps, so that
steps reference older ones and retention retires a referenced step, and later reclaims
it, while processes die. A failed step (a peer died, the step already exists) is
skipped, as a training loop would; a lost writer ends the process with code 3. Even
ranks save with `skip_unchanged` and keep the frozen tensor as one object while it does
not change, so that their saves send no bytes for it and the writer splices in
references to a step it must keep.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import asyncckpt

BASE_STEPS = 25  # steps that share one frozen tensor (then retention retires and reclaims)


def expected_state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(step * 64 + rank)
    base = torch.Generator().manual_seed(rank * 1_000_003 + step // BASE_STEPS)
    frozen = torch.randn(300_000, generator=base)
    return {"frozen": frozen,  # the same for BASE_STEPS steps: stored as references
            "w": torch.randn(400_000, generator=g).bfloat16(),
            "opt": {0: {"exp_avg": torch.randn(100_000, generator=g)}},
            "meta": {"rank": rank, "step": step}}


def main() -> int:
    return run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))


def serve(address: str, rank: int, world: int, step: int) -> None:
    """`run` in a process forked by torture.py's launcher, its output discarded."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    sys.exit(run(address, rank, world, step))


def run(address: str, rank: int, world: int, step: int) -> int:
    deadline = time.monotonic() + 60
    while True:
        try:
            client = asyncckpt.connect(address, rank=rank, world_size=world,
                                       slot_size=256 << 10, ring_size=1 << 20,
                                       skip_unchanged=rank % 2 == 0)
            break
        except asyncckpt.WriterUnavailableError:
            if time.monotonic() > deadline:
                return 3
            time.sleep(0.1)
    frozen: dict[int, torch.Tensor] = {}
    while True:
        state = expected_state(rank, step)
        if step // BASE_STEPS not in frozen:
            frozen = {step // BASE_STEPS: state["frozen"]}
        state["frozen"] = frozen[step // BASE_STEPS]
        handle = client.save(step, state)
        try:
            handle.wait(120)
        except asyncckpt.WriterUnavailableError:
            return 3
        except asyncckpt.SaveFailedError:
            pass
        step += 1


if __name__ == "__main__":
    sys.exit(main())
