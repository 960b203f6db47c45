"""Two gloo ranks, no writer address anywhere, two roots in one process each: two
Checkpointers (a policy and a critic) and then two DCP roots. Every writer is started
by the ranks themselves; each root must hold its own model, and no rank may see an
address in its environment (a rank that did would take another path into the
collectives than its peer, and the job would hang).

    python roots_worker.py run OUT_DIR

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT. Prints "OK" on success; any
failure raises (non-zero exit).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_worker import leave

from asyncckpt import Checkpointer, CheckpointerOptions
from asyncckpt.dcp import StorageReader, StorageWriter


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(6, 3)


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def run(out: Path) -> None:
    dist.init_process_group("gloo")
    options = CheckpointerOptions(save_interval=1)
    policy, critic = model(1), model(2)
    first = Checkpointer(out / "policy", model=policy, options=options)
    second = Checkpointer(out / "critic", model=critic, options=options)
    for step in (1, 2):
        with torch.no_grad():
            policy.weight.add_(step)
            critic.weight.sub_(step)
        first.save(step).wait_staged()  # no optimizer fence: the loop waits itself
        second.save(step).wait_staged()
    first.close()
    second.close()
    for root, want in ((out / "policy", policy), (out / "critic", critic)):
        fresh = model(99)
        restorer = Checkpointer(root, model=fresh)
        assert restorer.restore() == 2, root
        assert same(want, fresh), f"{root} holds another model"
        restorer.close()
    for name, value in (("dcp-a", 1.0), ("dcp-b", 2.0)):
        dcp.save({"w": torch.full((4,), value)}, storage_writer=StorageWriter(out / name, 1))
    for name, value in (("dcp-a", 1.0), ("dcp-b", 2.0)):
        target = {"w": torch.zeros(4)}
        dcp.load(target, storage_reader=StorageReader(out / name, 1))
        assert torch.equal(target["w"], torch.full((4,), value)), name
    assert "ASYNCCKPT_ADDRESS" not in os.environ, "an auto-start exported its address"
    dist.barrier()
    print("OK", flush=True)


if __name__ == "__main__":
    run(Path(sys.argv[2]))
    leave()
