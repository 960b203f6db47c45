"""Two ranks (gloo, CPU) save through `dcp.save` with the memory tier and restore with
`asyncckpt.dcp.load_memory`: a DTensor sharded over both ranks comes back bit for bit
into the same sharding and resharded (replicated: every rank reads both images), a
plain tensor and an object too. Run by tests/integrations/test_dcp_memory.py, one
process per rank (RANK, WORLD_SIZE, MASTER_*, ASYNCCKPT_ADDRESS, CKPT_ROOT); prints
"OK rank R".

    python dcp_memory_worker.py            dcp.save to memory, load_memory as above
    python dcp_memory_worker.py process    dcp.async_save in DCP's PROCESS mode: a step
                                           given to StorageWriter is staged through the
                                           ring here and held by the node's writer (the
                                           helper process only relays its outcome), and
                                           loads back bit for bit; one without its step
                                           is refused (SaveFailedError from the future,
                                           nothing held), THREAD mode takes it
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

from asyncckpt.dcp import StorageWriter, load_memory
from asyncckpt.errors import SaveFailedError
from asyncckpt.read import memory
from asyncckpt.storage.posix import PosixStorage

WAIT_S = 120


def state(mesh, seed: int, placement) -> dict:
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(64, 48, generator=g)
    return {"model": {"w": distribute_tensor(full, mesh, [placement]),
                      "b": torch.randn(5, generator=g)},
            "extra": {"epoch": seed, "tag": f"seed-{seed}"}}


def held() -> list[int]:
    """The steps the node's writer holds in memory."""
    return sorted(g["step"] for g in memory.generations(os.environ["ASYNCCKPT_ADDRESS"]))


def process_mode(mesh, rank: int, root: str) -> None:
    saved = state(mesh, 7, Shard(0))
    want_w, want_b = saved["model"]["w"].full_tensor(), saved["model"]["b"].clone()
    writer = StorageWriter(root, 3, tier="memory")
    future = dcp.async_save(saved, storage_writer=writer,
                            async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    saved["model"]["w"].to_local().mul_(-1)  # in the ring already: not what is held
    saved["model"]["b"].mul_(-1)
    future.result(timeout=WAIT_S)
    assert writer.stats.tier == "memory", writer.stats.tier
    assert held() == [3] and PosixStorage(root).committed_steps() == [], held()
    target = state(mesh, 99, Shard(0))
    assert load_memory(target, root) == 3
    assert torch.equal(target["model"]["w"].full_tensor(), want_w)
    assert torch.equal(target["model"]["b"], want_b)
    assert target["extra"] == {"epoch": 7, "tag": "seed-7"}, target["extra"]
    dist.barrier()

    # no step until the checkpoint_id: the helper process would run the save itself
    future = dcp.async_save(state(mesh, 4, Shard(0)), checkpoint_id=f"{root}/step-4",
                            storage_writer=StorageWriter(root, tier="memory"),
                            async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    try:
        future.result(timeout=WAIT_S)
    except SaveFailedError as e:
        assert "needs its step when it is staged" in str(e), e
    else:
        raise AssertionError("a step-less memory save ran in DCP's helper process")
    dist.barrier()
    assert held() == [3] and PosixStorage(root).committed_steps() == [], held()
    five = state(mesh, 5, Shard(0))
    dcp.async_save(five, checkpoint_id=f"{root}/step-5",  # THREAD mode: saved here
                   storage_writer=StorageWriter(root, tier="memory")).result(timeout=WAIT_S)
    dist.barrier()
    target = state(mesh, 99, Shard(0))
    assert load_memory(target, root) == 5
    assert torch.equal(target["model"]["w"].full_tensor(), five["model"]["w"].full_tensor())


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = os.environ["CKPT_ROOT"]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if sys.argv[1:] == ["process"]:
        process_mode(mesh, rank, root)
        dist.barrier()
        print(f"OK rank {rank}", flush=True)
        return
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
