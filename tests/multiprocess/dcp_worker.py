"""One FSDP2 rank (gloo, CPU) saving and loading through PyTorch DCP with asyncckpt's
storage layer.

    python dcp_worker.py save OUT_DIR    train; dcp.save step 3; dcp.async_save step 4
                                         (THREAD: the weights change while it is
                                         written) and step 5 (PROCESS); rank 0 writes
                                         the full reference state of each step
    python dcp_worker.py load OUT_DIR    fresh model at this world size; dcp.load each
                                         step into its DTensor state and compare the
                                         full state with the reference bit for bit
    python dcp_worker.py diskfull OUT_DIR  dcp.async_save (PROCESS) of more than the
                                         root's filesystem holds: the failure must
                                         reach the caller as DiskFullError, with its
                                         step

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ASYNCCKPT_ADDRESS (save),
CKPT_ROOT. Prints "OK" on success; any failure raises (non-zero exit).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_worker import build, full_state, leave, train
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from asyncckpt.dcp import StorageReader, StorageWriter


def state(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> dict:
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd,
            "extra": {"step": step, "tag": f"rank-{dist.get_rank()}".encode(), "shape": (3, 4)}}


def save(out: Path, root: Path) -> None:
    background = dist.new_group(backend="gloo")  # async saves plan off the training group
    model, optim = build(0)
    train(model, optim, range(3))
    dcp.save(state(model, optim, 3), storage_writer=StorageWriter(root, 3))
    reference(model, optim, out / "ref-3.pt")

    train(model, optim, range(3, 4))
    reference(model, optim, out / "ref-4.pt")
    future = dcp.async_save(state(model, optim, 4), storage_writer=StorageWriter(root, 4),
                            process_group=background)
    train(model, optim, range(4, 6))  # changes every weight while step 4 is written
    future.result()

    reference(model, optim, out / "ref-5.pt")
    future = dcp.async_save(state(model, optim, 5), storage_writer=StorageWriter(root, 5),
                            process_group=background,
                            async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    train(model, optim, range(6, 7))
    future.result()


def reference(model: torch.nn.Module, optim: torch.optim.Optimizer, path: Path) -> None:
    full = full_state(model, optim)
    if dist.get_rank() == 0:
        torch.save(full, path)
    dist.barrier()


def load(out: Path, root: Path) -> None:
    for step in (3, 4, 5):
        model, optim = build(100 + step)
        train(model, optim, range(1))  # optimizer state exists, with other values
        sd = state(model, optim, -1)
        dcp.load(sd, storage_reader=StorageReader(root, step))
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        got = full_state(model, optim)
        want = torch.load(out / f"ref-{step}.pt", weights_only=False)
        problems = compare(want, got, ())
        assert not problems, f"step {step}: {problems[:5]}"
        assert sd["extra"]["step"] == step and sd["extra"]["shape"] == (3, 4), sd["extra"]
        # DCP keeps one copy of an object every rank has: the lowest rank's
        assert sd["extra"]["tag"] == b"rank-0", sd["extra"]["tag"]


def disk_full(out: Path, root: Path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from asyncckpt.errors import DiskFullError
    huge = {"w": torch.randn(8 << 20, generator=torch.Generator().manual_seed(1))}  # 32 MiB
    future = dcp.async_save(huge, storage_writer=StorageWriter(root, 7),
                            async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    try:
        future.result()
    except CheckpointException as e:  # DCP's, from its helper process, pickled
        caught = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
    else:
        raise AssertionError("a save larger than the filesystem committed")
    assert caught and all(type(c) is DiskFullError for c in caught), caught
    assert all(c.step == 7 and "disk full" in str(c) for c in caught), caught
    # One write, flushed: DCP's helper process logs to the same pipe meanwhile.
    print(f"caught {[f'{type(c).__name__}: {c}' for c in caught]}", flush=True)


def compare(want: object, got: object, path: tuple) -> list[str]:
    if isinstance(want, torch.Tensor):
        ok = isinstance(got, torch.Tensor) and want.dtype == got.dtype and torch.equal(want, got)
        return [] if ok else [f"{path}: differs"]
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(want) != set(got):
            return [f"{path}: keys {sorted(map(str, want))} vs {sorted(map(str, got or {}))}"]
        return [p for k in want for p in compare(want[k], got[k], path + (k,))]
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(want) != len(got):
            return [f"{path}: length"]
        return [p for i, (a, b) in enumerate(zip(want, got)) for p in compare(a, b, path + (i,))]
    return [] if want == got else [f"{path}: {want!r} vs {got!r}"]


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    {"save": save, "load": load, "diskfull": disk_full}[mode](out, Path(os.environ["CKPT_ROOT"]))
    dist.barrier()
    print("OK", mode, dist.get_rank())
    leave()  # gloo's teardown sometimes aborts after a clean barrier


if __name__ == "__main__":
    main()
