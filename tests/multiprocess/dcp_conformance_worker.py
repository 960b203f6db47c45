"""One rank (gloo, CPU) of DCP usage that DCP's own storage allows, through asyncckpt:
re-saving a checkpoint_id with `overwrite=True` (dcp.save and dcp.async_save),
`async_save` given only a checkpoint_id, and async saves of one structure (the cached
plan) then of a structure only rank 1 changed.

    python dcp_conformance_worker.py save OUT_DIR
    python dcp_conformance_worker.py timeline OUT_DIR   save 8, 10, 12; load 8; save 10, 11

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ASYNCCKPT_ADDRESS, CKPT_ROOT.
Prints "OK" on success; any failure raises (non-zero exit).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_worker import leave

from asyncckpt.dcp import StorageWriter


def state(value: float, extra: bool = False) -> dict:
    """Rank r's shard of `w` (rows 2r, 2r+1 of a 4x3 tensor in DCP's eyes: a plain
    tensor per rank, so each rank's own key), and `shared`, which every rank has."""
    rank = dist.get_rank()
    sd = {f"w{rank}": torch.full((2, 3), value + rank), "shared": torch.full((4,), value),
          "step": int(value)}
    if extra and rank == 1:
        sd["late"] = torch.full((5,), value)
    return sd


def save(out: Path, root: Path) -> None:
    dcp.save(state(1.0), storage_writer=StorageWriter(root, 1))
    dcp.save(state(2.0), checkpoint_id=f"{root}/step-1",
             storage_writer=StorageWriter(overwrite=True))
    dcp.async_save(state(3.0), storage_writer=StorageWriter(root, 1, replace=True)).result()
    future = dcp.async_save(state(4.0), checkpoint_id=f"{root}/step-4",
                            storage_writer=StorageWriter())
    future.result()
    for step in (5, 6, 7):  # one structure: the plan is made once
        dcp.async_save(state(float(step)), storage_writer=StorageWriter(root, step)).result()
    dcp.async_save(state(8.0, extra=True), storage_writer=StorageWriter(root, 8)).result()


def timeline(out: Path, root: Path) -> None:
    """8, 10, 12 saved; a restore from 8 (every rank's dcp.load); 10 saved again, async."""
    from asyncckpt.dcp import StorageReader
    for step in (8, 10, 12):
        dcp.save(state(float(step)), storage_writer=StorageWriter(root, step))
    target = state(0.0)
    dcp.load(target, storage_reader=StorageReader(root, 8))
    assert target["step"] == 8, target
    dcp.async_save(state(110.0), storage_writer=StorageWriter(root, 10)).result()
    dcp.save(state(111.0), storage_writer=StorageWriter(root, 11))


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    {"save": save, "timeline": timeline}[mode](out, Path(os.environ["CKPT_ROOT"]))
    dist.barrier()
    print("OK", mode, dist.get_rank())
    leave()


if __name__ == "__main__":
    main()
