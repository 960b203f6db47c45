"""One rank of FSDP2 over tensor parallelism (gloo, CPU), torchtitan's 2-D layout: a
column-parallel weight is `(_StridedShard(0, sf=2), Shard(0))` on a (dp=2, tp=2) mesh.

    python strided_worker.py save OUT_DIR   4 ranks: train 2 steps; save model +
                                            optimizer through asyncckpt.save (step 1)
                                            and dcp.save (step 2); rank 0 writes the
                                            full reference state
    python strided_worker.py load OUT_DIR   4 ranks: the same 2-D layout; 1 or 2 ranks:
                                            FSDP2 alone; load both steps into a fresh
                                            model (asyncckpt.load into= / dcp.load) and
                                            compare the full state bit for bit

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ASYNCCKPT_ADDRESS (save),
CKPT_ROOT. Prints "OK" on success.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dcp_worker import compare
from fsdp_worker import full_state, leave
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

import asyncckpt
from asyncckpt.dcp import StorageReader, StorageWriter
from asyncckpt.errors import UnsupportedStateError
from asyncckpt.rank.flatten import flatten


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    world = dist.get_world_size()
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    else:
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2 if seed == 0 else 1):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        model(x).sum().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def refuse_other_strided_layouts() -> None:
    """A strided shard whose split factor no later mesh dim provides interleaves rows:
    no box holds them, so it is refused (saving it as one would scramble it)."""
    mesh = init_device_mesh("cpu", (2, 2))
    odd = distribute_tensor(torch.arange(16.0).reshape(8, 2), mesh,
                            [_StridedShard(0, split_factor=2), Replicate()])
    try:
        flatten({"odd": odd})
    except UnsupportedStateError as e:
        assert "has no contiguous box" in str(e), e
    else:
        raise AssertionError("an interleaved strided shard was saved as a box")


def main() -> None:
    mode, out, root = sys.argv[1], Path(sys.argv[2]), Path(os.environ["CKPT_ROOT"])
    dist.init_process_group("gloo")
    model, optim = build(0 if mode == "save" else 1)
    model_sd, optim_sd = get_state_dict(model, optim)
    if mode == "save":
        placements = {str(v.placements) for v in model_sd.values()}
        assert any("_StridedShard" in p for p in placements), placements
        refuse_other_strided_layouts()
        asyncckpt.save(1, {"model": model_sd, "optim": optim_sd}).wait()
        dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=StorageWriter(root, 2))
        full = full_state(model, optim)
        if dist.get_rank() == 0:
            torch.save(full, out / "ref.pt")
    else:
        want = torch.load(out / "ref.pt", weights_only=False)
        for step in (1, 2):
            fresh, fresh_optim = build(1)
            sd = dict(zip(("model", "optim"), get_state_dict(fresh, fresh_optim)))
            if step == 1:
                asyncckpt.load(root, step=1, into=sd)
            else:
                dcp.load(sd, storage_reader=StorageReader(root, 2))
            set_state_dict(fresh, fresh_optim, model_state_dict=sd["model"],
                           optim_state_dict=sd["optim"])
            problems = compare(want, full_state(fresh, fresh_optim), ())
            assert not problems, f"step {step}: {problems[:5]}"
    dist.barrier()
    print("OK", mode)
    leave()  # gloo's teardown sometimes aborts after a clean barrier (CI saw it here)


if __name__ == "__main__":
    main()
