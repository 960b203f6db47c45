"""Two ranks (gloo, CPU) resume through `dcp.load` of an older step, then save with
`dcp.async_save` in DCP's PROCESS mode, where a StorageWriter without its step is
planned in DCP's helper process: the saves must still begin a timeline at the step
loaded (the helper plans with this process's recorded loads). Run by
tests/integrations/test_dcp_timeline.py, one process per rank (RANK, WORLD_SIZE,
MASTER_*, ASYNCCKPT_ADDRESS, CKPT_ROOT); prints "OK rank R"."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import asyncckpt
from asyncckpt.dcp import StorageReader, StorageWriter
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.storage.timeline import live_steps

WAIT_S = 120


def full(value: float) -> dict:
    return {"w": torch.full((6,), value), "step": int(value)}


def newest_is(root: str, step: int, value: float) -> None:
    """Rank 0 (DCP's lowest holder of the object): the newest live step is `step`,
    holding `value`."""
    if dist.get_rank() == 0:
        loaded = asyncckpt.load(root, rank=0)
        assert (loaded["step"], float(loaded["w"][0])) == (step, value), loaded


def in_helper(root: str, value: float, step: int | None = None) -> None:
    """An async_save of `value` in PROCESS mode: without `step`, to the step the
    checkpoint_id names (planned by DCP's helper process)."""
    number = int(value)
    dcp.async_save(full(value), checkpoint_id=f"{root}/step-{number}",
                   storage_writer=StorageWriter(root, step),
                   async_checkpointer_type=AsyncCheckpointerType.PROCESS).result(timeout=WAIT_S)
    dist.barrier()


def main() -> None:
    dist.init_process_group("gloo")
    rank, root = dist.get_rank(), os.environ["CKPT_ROOT"]
    for step in (8, 10, 12):
        dcp.save(full(step), storage_writer=StorageWriter(root, step))
    target = {"w": torch.zeros(6), "step": 0}
    dcp.load(target, storage_reader=StorageReader(root, 8))
    assert target["step"] == 8, target
    dist.barrier()
    in_helper(root, 9.5)  # planned in the helper: it must fork at 8
    newest_is(root, 9, 9.5)  # 10 and 12 abandoned
    in_helper(root, 10.5)  # an abandoned number: no overwrite needed
    newest_is(root, 10, 10.5)
    in_helper(root, 11.5, step=11)  # staged here: the start this process drew is the same
    newest_is(root, 11, 11.5)
    storage = PosixStorage(root)
    assert live_steps(storage, storage.committed_steps()) == [8, 9, 10, 11], \
        live_steps(storage, storage.committed_steps())
    dist.barrier()
    print(f"OK rank {rank}", flush=True)


if __name__ == "__main__":
    main()
