"""Two ranks (gloo, CPU) save through `dcp.save` with the memory tier and restore with
`asyncckpt.dcp.load_memory`: a DTensor sharded over both ranks comes back bit for bit
into the same sharding and resharded (replicated: every rank reads both images), a
plain tensor and an object too. Run by tests/integrations/test_dcp_memory.py, one
process per rank (RANK, WORLD_SIZE, MASTER_*, ASYNCCKPT_ADDRESS, CKPT_ROOT); prints
"OK rank R"."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

from asyncckpt.dcp import StorageWriter, load_memory


def state(mesh, seed: int, placement) -> dict:
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(64, 48, generator=g)
    return {"model": {"w": distribute_tensor(full, mesh, [placement]),
                      "b": torch.randn(5, generator=g)},
            "extra": {"epoch": seed, "tag": f"seed-{seed}"}}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = os.environ["CKPT_ROOT"]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    saved = state(mesh, 7, Shard(0))
    writer = StorageWriter(root, 3, tier="memory")
    dcp.save(saved, storage_writer=writer)
    assert writer.stats.tier == "memory", writer.stats.tier
    for placement in (Shard(0), Replicate()):
        target = state(mesh, 99, placement)
        assert load_memory(target, root) == 3, placement
        want = saved["model"]["w"].full_tensor()
        assert torch.equal(target["model"]["w"].full_tensor(), want), placement
        assert torch.equal(target["model"]["w"].to_local(),
                           want if placement == Replicate() else want.chunk(2)[rank])
        assert torch.equal(target["model"]["b"], saved["model"]["b"])
        assert target["extra"] == {"epoch": 7, "tag": "seed-7"}, target["extra"]
    dist.barrier()
    dist.destroy_process_group()
    print(f"OK rank {rank}", flush=True)


if __name__ == "__main__":
    main()
