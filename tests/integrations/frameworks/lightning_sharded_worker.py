"""One rank of a Lightning ModelParallelStrategy (FSDP2) run on 2 gloo ranks on CPU,
launched by test_lightning_sharded.py with LOCAL_RANK set (Lightning launches nothing),
checkpointing through AsyncckptModelParallelStrategy; with --fsdp1, an FSDPStrategy
(FSDP1, each Linear wrapped) run on WORLD_SIZE CUDA devices through AsyncckptFSDPStrategy.

    lightning_sharded_worker.py OUT TAG --epochs E [--ckpt PATH|last] [--kill-epoch K]
                                [--fsdp1]

A tiny regression with dropout (the RNG matters), each Linear and the whole net
`fully_shard`ed over the 2 ranks, AdamW and a StepLR; 4 steps an epoch; ModelCheckpoint
keeps the top 2 by the epoch's loss plus `last.ckpt`, in OUT/ckpts. Each rank writes
OUT/TAG-r<rank>.json (the losses by global step, the seconds each save blocked) and
OUT/TAG-final-r<rank>.pt (its final weight and optimizer shards, scheduler, RNG).
--kill-epoch K: at the first save of epoch K rank 0 lets the earlier saves commit, stops
the node's writer (SIGSTOP), hands its part over, then SIGKILLs the writer and itself:
that step is never committed."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from asyncckpt.integrations.lightning_sharded import (
    AsyncckptFSDPStrategy,
    AsyncckptModelParallelStrategy,
)

STAGE_SECONDS = 0.5  # the killed save's staging runs this long before the kill


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
        self.losses: dict[int, list[float]] = {}

    def configure_model(self) -> None:
        if not isinstance(self.trainer.strategy, AsyncckptModelParallelStrategy):
            return  # FSDPStrategy wraps the Linears itself (auto_wrap_policy)
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step] = [loss.item(), torch.rand(()).item()]
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)]


def killing(base: type) -> type:
    """`base` (an asyncckpt strategy) that, at the first save of epoch `kill_epoch`, lets
    the earlier saves commit, stops the writer, hands rank 0's part over, then SIGKILLs
    the writer and rank 0."""

    class KillingStrategy(base):
        def __init__(self, kill_epoch: int | None, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.kill_epoch = kill_epoch

        def save_checkpoint(self, checkpoint: dict, filepath: Any,
                            storage_options: Any = None) -> None:
            if checkpoint["epoch"] != self.kill_epoch or not self.is_global_zero:
                return super().save_checkpoint(checkpoint, filepath, storage_options)
            assert self._ckpt is not None and self._ckpt.writer is not None
            self._ckpt.wait_until_finished()
            self._book.wait_until_finished()
            os.kill(self._ckpt.writer.pid, signal.SIGSTOP)
            super().save_checkpoint(checkpoint, filepath, storage_options)
            time.sleep(STAGE_SECONDS)
            print("KILLING", flush=True)
            os.kill(self._ckpt.writer.pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

    return KillingStrategy


def local(value: Any) -> Any:
    """`value` with every DTensor as this rank's shard (a plain tensor)."""
    if isinstance(value, DTensor):
        return value.to_local().cpu().clone()
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [local(v) for v in value]
    return value


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("tag")
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--ckpt")
    p.add_argument("--kill-epoch", type=int)
    p.add_argument("--fsdp1", action="store_true")
    args = p.parse_args()
    out = Path(args.out)
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=True)
    model = Net()
    world = int(os.environ["WORLD_SIZE"])
    if args.fsdp1:
        strategy = killing(AsyncckptFSDPStrategy)(
            args.kill_epoch, auto_wrap_policy={torch.nn.Linear})
    else:
        strategy = killing(AsyncckptModelParallelStrategy)(
            args.kill_epoch, data_parallel_size=world, tensor_parallel_size=1)
    trainer = pl.Trainer(
        accelerator="cuda" if args.fsdp1 else "cpu", devices=world, strategy=strategy,
        max_epochs=args.epochs,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=out / "ckpts", monitor="train_loss", mode="min",
                                   save_top_k=2, save_last=True)])
    trainer.fit(model, data, ckpt_path=args.ckpt)
    rank = trainer.global_rank
    opt = trainer.optimizers[0]
    weights = trainer.strategy.model.state_dict() if args.fsdp1 else model.state_dict()
    cuda_rng = torch.cuda.get_rng_state() if args.fsdp1 else torch.tensor(0)
    torch.save({"model": local(weights), "optimizer": local(opt.state_dict()),
                "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                "rng": torch.get_rng_state(), "cuda_rng": cuda_rng},
               out / f"{args.tag}-final-r{rank}.pt")
    result = {"losses": {str(k): v for k, v in model.losses.items()},
              "blocked": strategy.blocked_seconds}
    (out / f"{args.tag}-r{rank}.json").write_text(json.dumps(result))
    print(f"OK rank {rank}", flush=True)


if __name__ == "__main__":
    main()
