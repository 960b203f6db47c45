"""One rank of a Lightning DDP run (2 gloo ranks on CPU, launched by test_lightning.py
with LOCAL_RANK set, so Lightning launches nothing) saving through AsyncckptCheckpointIO.

    lightning_worker.py OUT TAG --epochs E [--ckpt PATH|last] [--kill-epoch K]

A tiny regression with dropout (the RNG matters), AdamW and a StepLR; 4 steps an epoch;
ModelCheckpoint keeps the top 2 by the epoch's loss plus `last.ckpt`, in OUT/ckpts.
Each rank writes OUT/TAG-r<rank>.json: the losses by global step, and (rank 0) the final
weights, optimizer and scheduler state and the RNG as the bench compares them, and what
`load_checkpoint` of last.ckpt gives (`reload`: tensor devices per map_location, and
Python's RNG state it restores).
--kill-epoch K: at the first save of epoch K rank 0 lets the earlier saves commit, stops
its writer (SIGSTOP), hands the save over, then SIGKILLs the writer and itself: that
step is never committed."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from asyncckpt.integrations.lightning import AsyncckptCheckpointIO

STAGE_SECONDS = 0.5  # the killed save's staging runs this long before the kill


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
        self.losses: dict[int, list[float]] = {}

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step] = [loss.item(), torch.rand(()).item()]
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)]


class KillingIO(AsyncckptCheckpointIO):
    def __init__(self, kill_epoch: int | None) -> None:
        super().__init__()
        self.kill_epoch = kill_epoch

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
        if checkpoint["epoch"] != self.kill_epoch:
            return super().save_checkpoint(checkpoint, path, storage_options)
        self.wait_until_finished()
        assert self._writer is not None
        os.kill(self._writer.pid, signal.SIGSTOP)
        super().save_checkpoint(checkpoint, path, storage_options)
        time.sleep(STAGE_SECONDS)
        print("KILLING", flush=True)
        os.kill(self._writer.pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def reload(io: AsyncckptCheckpointIO, last: Path) -> dict:
    """What `load_checkpoint` of `last` gives: the devices of its tensors under each
    kind of map_location ("meta": the device a CPU machine has besides the CPU), and
    Python's RNG state it restores."""
    def devices(**kwargs: Any) -> list[str]:
        loaded = io.load_checkpoint(last, **kwargs)
        state = next(iter(loaded["optimizer_states"][0]["state"].values()))
        return sorted({str(t.device) for t in [*loaded["state_dict"].values(), *state.values()]})

    def meta(storage: Any, location: str) -> Any:
        return torch.UntypedStorage(storage.nbytes(), device="meta")

    return {"none": devices(), "name": devices(map_location="meta"),
            "dict": devices(map_location={"cpu": "meta"}), "function": devices(map_location=meta),
            "identity": devices(map_location=lambda storage, location: storage),
            "random": list(random.getstate()[1])}  # load_checkpoint (last) restored it


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("tag")
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--ckpt")
    p.add_argument("--kill-epoch", type=int)
    args = p.parse_args()
    out = Path(args.out)
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=True)
    model = Net()
    io = KillingIO(args.kill_epoch)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=args.epochs,
        plugins=[io], logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=out / "ckpts", monitor="train_loss", mode="min",
                                   save_top_k=2, save_last=True)])
    trainer.fit(model, data, ckpt_path=args.ckpt)
    rank = trainer.global_rank
    result: dict = {"losses": {str(k): v for k, v in model.losses.items()},
                    "blocked": io.blocked_seconds}
    if rank == 0:
        result["reload"] = reload(io, out / "ckpts" / "last.ckpt")
        opt = trainer.optimizers[0]
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                    "rng": torch.get_rng_state()}, out / f"{args.tag}-final.pt")
    (out / f"{args.tag}-r{rank}.json").write_text(json.dumps(result))
    print(f"OK rank {rank}", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
