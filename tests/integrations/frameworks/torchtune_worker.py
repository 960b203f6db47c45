"""One rank of a torchtune checkpoint run through asyncckpt's DistributedCheckpointer,
installed with `install` into torchtune's real CheckpointClient (the object recipes
build), on a tiny FSDP2 model built here (nothing downloaded). Run by test_torchtune.py
with the frameworks venv's python.

    torchtune_worker.py OUT TAG (save EPOCHS [late] | resume [STEP])

With "late", rank 1 comes to the save of epoch 1 LATE seconds after rank 0; each rank
records how long its checkpointer's `save_checkpoint` took per epoch ("save_seconds").
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.fsdp import fully_shard
from torchtune.training.checkpointing._checkpoint_client import (
    CheckpointClient,
    TrainingProgress,
)

from asyncckpt.integrations.torchtune import install

LATE = 3.0  # s: how late rank 1 comes to the save of epoch 1 with "late"


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        h.update(p.full_tensor().reshape(-1).view(torch.uint8).numpy().tobytes())
        for _, v in sorted(optimizer.state[p].items()):
            t = v.full_tensor() if hasattr(v, "full_tensor") else v
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def tiny_sharded_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Two seeded Linear layers under FSDP2 (`fully_shard`), and their AdamW."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def main() -> None:
    out, tag, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = OmegaConf.create({"device": "cpu", "enable_async_checkpointing": True,
                            "resume_from_checkpoint": mode == "resume",
                            "checkpointer": {"checkpoint_dir": str(out / "base"),
                                             "output_dir": str(out / "output")}})
    recipe = type("Recipe", (), {})()
    recipe._checkpoint_client = CheckpointClient(cfg)  # what the recipe's __init__ does
    installed = install(recipe, keep_last=2)
    if mode == "resume" and len(sys.argv) > 4:  # a user picking an older epoch
        older = str(installed.root / f"step-{int(sys.argv[4]):08d}")
        installed._get_latest_intermediate_checkpoint = lambda: older
    model, optimizer = tiny_sharded_model()
    client = recipe._checkpoint_client
    result: dict = {"digests": {}, "save_seconds": {}}
    save = installed.save_checkpoint

    def timed(state_dict: dict, epoch: int, save_async: bool = False) -> None:
        started = time.perf_counter()
        save(state_dict, epoch, save_async)
        result["save_seconds"][str(epoch)] = time.perf_counter() - started
    installed.save_checkpoint = timed
    start = 0
    if mode == "resume":
        loaded = client.load_distributed_checkpoint(model, optimizer)
        start = loaded["epochs_run"]
        result["resumed"] = start
        result["loaded"] = digest(model, optimizer)
    epochs = int(sys.argv[4]) if mode == "save" else 5
    for epoch in range(start, epochs):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(epoch * 10 + rank))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        progress = TrainingProgress(seed=0, epochs_run=epoch + 1, total_epochs=100,
                                    max_steps_per_epoch=1)
        if "late" in sys.argv[5:] and epoch == 1 and rank == 1:
            time.sleep(LATE)
        client.save_checkpoint(model, optimizer, progress, epoch)  # async: intermediate
        result["digests"][str(epoch)] = digest(model, optimizer)
    client._get_dcp_checkpointer().wait_until_finished()
    (out / f"{tag}-r{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    print(f"OK rank {rank}", flush=True)


if __name__ == "__main__":
    main()
