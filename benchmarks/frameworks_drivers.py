"""One driver per framework and checkpoint method for bench-frameworks: the framework's
own objects (Trainer, Accelerator, LightningModule, torchtune checkpointer), its training
step, and the save the method makes, as a user of that framework writes it.

Methods, per framework:
- hf: `Trainer._save_checkpoint` (what `save_steps` calls: safetensors weights,
  torch.save of optimizer, scheduler and RNG, rotation) against
  `AsyncCheckpointTrainer`'s. The Trainer's own loop is not run (its `train()` owns the
  steps); the bench's loop steps the Trainer's optimizer and scheduler and calls the
  Trainer's save point as `train()` does, `save_total_limit=2`.
- lightning: `trainer.save_checkpoint` (what `ModelCheckpoint` calls) inside `fit`, with
  the default `TorchCheckpointIO`, Lightning's `AsyncCheckpointIO` and
  `AsyncckptCheckpointIO`; the checkpoint two saves back is removed after each save, as
  `save_top_k=2` does.
- accelerate: `accelerate.Accelerator.save_state` against asyncckpt's `Accelerator`,
  `automatic_checkpoint_naming=True`, `total_limit=2`.
- torchtune: the intermediate save of torchtune's `DistributedCheckpointer` (DCP,
  `FileSystemWriter(sync_files=False)`), synchronous and with `save_async=True`
  (dcp.async_save with DCP's default stager), against asyncckpt's
  `DistributedCheckpointer` (async, `keep_last=2`); the state dict is the one
  `CheckpointClient` builds (model and optimizer `state_dict()` of an FSDP2 model).
  torchtune's own async save on the training's gloo group crashes (gloo::EnforceNotMet,
  found in session 2), so both of torchtune's get a gloo group of their own, as asyncckpt's
  makes. torchtune's checkpointer keeps every epoch: the bench removes the epoch two
  back once the newer one is durable.

Imports of the frameworks happen in `preload` (the rank's parent process, before it
forks a child per case), so a case pays no import time.
"""

from __future__ import annotations

import importlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.frameworks_loop import Bench, Saved

MODULES = {
    "hf": ["transformers", "asyncckpt.integrations.hf_trainer"],
    "lightning": ["lightning.pytorch", "lightning.pytorch.plugins.io",
                  "asyncckpt.integrations.lightning"],
    "accelerate": ["accelerate", "asyncckpt.integrations.accelerate"],
    "torchtune": ["torchtune.training.checkpointing._checkpointer",
                  "torch.distributed.checkpoint", "torch.distributed.fsdp",
                  "asyncckpt.integrations.torchtune"],
}
LABELS = {
    ("hf", "default"): "Trainer._save_checkpoint (safetensors + torch.save)",
    ("hf", "asyncckpt"): "AsyncCheckpointTrainer",
    ("lightning", "default"): "TorchCheckpointIO (default)",
    ("lightning", "async"): "AsyncCheckpointIO (Lightning's async)",
    ("lightning", "asyncckpt"): "AsyncckptCheckpointIO",
    ("accelerate", "default"): "Accelerator.save_state",
    ("accelerate", "asyncckpt"): "asyncckpt Accelerator.save_state",
    ("torchtune", "default"): "DistributedCheckpointer, dcp.save",
    ("torchtune", "async"): "DistributedCheckpointer, save_async (dcp.async_save)",
    ("torchtune", "asyncckpt"): "asyncckpt DistributedCheckpointer, save_async",
}
KEEP = 2  # checkpoints kept (each framework's rotation set to it)
BATCH = 8
LR = 1e-4


STATS = ("blocked_seconds", "staging_seconds", "seconds", "encode_seconds", "write_seconds")


def stats_of(handle: Any) -> Any:
    """A reader of an asyncckpt handle's figures (SaveStats) for the bench's record."""
    return lambda: {k: getattr(handle.stats, k) for k in STATS}


def preload(framework: str) -> None:
    for name in MODULES[framework]:
        importlib.import_module(name)


def build_model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                 for _ in range(layers)])


def batch(width: int, step: int) -> torch.Tensor:
    return torch.randn(BATCH, width, generator=torch.Generator().manual_seed(step))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def run(framework: str, method: str, width: int, layers: int, work: Path, bench: Bench) -> None:
    """Run `bench`'s whole schedule with `framework` saving by `method` into `work`."""
    {"hf": _hf, "lightning": _lightning, "accelerate": _accelerate,
     "torchtune": _torchtune}[framework](method, width, layers, work, bench)


def _loop(bench: Bench, step: Any) -> None:
    while True:
        started = time.perf_counter()
        step()
        if bench.on_step(time.perf_counter() - started):
            return


# -- Hugging Face Trainer -------------------------------------------------------------------

def _hf(method: str, width: int, layers: int, work: Path, bench: Bench) -> None:
    from transformers import Trainer, TrainingArguments

    from asyncckpt.integrations.hf_trainer import AsyncCheckpointTrainer
    cls = AsyncCheckpointTrainer if method == "asyncckpt" else Trainer
    args = TrainingArguments(output_dir=str(work / "out"), use_cpu=True, report_to=[],
                             save_strategy="no", save_total_limit=KEEP, disable_tqdm=True,
                             learning_rate=LR)
    model = build_model(width, layers)
    trainer = cls(model=model, args=args)
    trainer.create_optimizer_and_scheduler(num_training_steps=10_000)

    def step() -> None:
        model(batch(width, trainer.state.global_step)).pow(2).mean().backward()
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        trainer.optimizer.zero_grad(set_to_none=False)
        trainer.state.global_step += 1

    def save(n: int) -> Saved:
        real = trainer.state.global_step
        trainer.state.global_step = n  # checkpoint-N per save, also back to back
        try:
            trainer._save_checkpoint(model, None)
        finally:
            trainer.state.global_step = real
        if method == "asyncckpt":
            handle = trainer.asyncckpt_last_handle
            return Saved(wait=handle.wait, stats=stats_of(handle))
        return Saved(fsync=work / "out" / f"checkpoint-{n}")

    bench.save = save
    try:
        _loop(bench, step)
    finally:
        if method == "asyncckpt":
            trainer.asyncckpt_wait()
            if trainer._asyncckpt_ckpt is not None:
                trainer._asyncckpt_ckpt.close()


# -- Lightning ------------------------------------------------------------------------------

def _lightning(method: str, width: int, layers: int, work: Path, bench: Bench) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from torch.utils.data import DataLoader, TensorDataset

    from asyncckpt.integrations.lightning import AsyncckptCheckpointIO
    world = int(os.environ.get("WORLD_SIZE", "1"))

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_model(width, layers)

        def training_step(self, b: list[torch.Tensor], _: int) -> torch.Tensor:
            return self.net(b[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=LR)

        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            optimizer.zero_grad(set_to_none=False)

    plugins: list[Any] = []
    io: Any = None
    if method == "async":
        io = AsyncCheckpointIO()
    elif method == "asyncckpt":
        io = AsyncckptCheckpointIO()
    if io is not None:
        plugins.append(io)
    ckpts = work / "ckpts"

    class Timer(pl.Callback):
        started = 0.0

        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            self.started = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if bench.on_step(time.perf_counter() - self.started):
                trainer.should_stop = True

    holder: dict[str, Any] = {}

    def save(n: int) -> Saved:
        trainer = holder["trainer"]
        path = ckpts / f"save-{n}.ckpt"
        trainer.save_checkpoint(path)
        if n > KEEP:
            trainer.strategy.remove_checkpoint(ckpts / f"save-{n - KEEP}.ckpt")
        if trainer.global_rank != 0:
            return Saved()
        if method == "async":
            done = io._executor.submit(lambda: None)  # one worker: after the save
            return Saved(wait=done.result, fsync=path)
        if method == "asyncckpt":
            handles = [p.handle for p in list(io._pending) if p.path == path.absolute()]
            return (Saved(wait=handles[-1].wait, stats=stats_of(handles[-1])) if handles
                    else Saved())
        return Saved(fsync=path)

    bench.save = save
    steps = bench.plan.steps()
    data = DataLoader(TensorDataset(torch.randn(BATCH * (steps + 1), width)), batch_size=BATCH)
    trainer = pl.Trainer(accelerator="cpu", devices=world,
                         strategy="ddp" if world > 1 else "auto", max_steps=steps,
                         max_epochs=-1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Timer()], plugins=plugins, num_sanity_val_steps=0)
    holder["trainer"] = trainer
    trainer.fit(Module(), data)


# -- Accelerate -----------------------------------------------------------------------------

def _accelerate(method: str, width: int, layers: int, work: Path, bench: Bench) -> None:
    import accelerate
    from accelerate.utils import ProjectConfiguration

    from asyncckpt.integrations import accelerate as ours
    cls = ours.Accelerator if method == "asyncckpt" else accelerate.Accelerator
    acc = cls(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(work / "project"), automatic_checkpoint_naming=True, total_limit=KEEP))
    model = build_model(width, layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = acc.prepare(model, optimizer)
    count = [0]

    def step() -> None:
        acc.backward(model(batch(width, count[0])).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        count[0] += 1

    def save(n: int) -> Saved:
        out = acc.save_state()
        if method == "asyncckpt":
            return Saved(wait=out.wait, stats=stats_of(out))
        return Saved(fsync=Path(out))

    bench.save = save
    try:
        _loop(bench, step)
    finally:
        acc.end_training()


# -- torchtune ------------------------------------------------------------------------------

def _torchtune(method: str, width: int, layers: int, work: Path, bench: Bench) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torchtune.training.checkpointing._checkpointer import (
        DistributedCheckpointer as Theirs,
    )

    from asyncckpt.integrations.torchtune import DistributedCheckpointer as Ours
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    model = build_model(width, layers)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    output = work / "output"
    ckpt: Any
    if method == "asyncckpt":
        ckpt = Ours(str(work / "base"), str(output), keep_last=KEEP)
    else:
        ckpt = Theirs(str(work / "base"), str(output), dist.new_group(backend="gloo"))
    count = [0]

    def step() -> None:
        model(batch(width, count[0] * 10 + rank())).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        count[0] += 1

    def save(n: int) -> Saved:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "seed": 0, "epochs_run": n, "total_epochs": 10_000, "max_steps_per_epoch": 1}
        ckpt.save_checkpoint(state, epoch=n, save_async=method != "default")
        path = output / f"dist_epoch_{n}"
        if method == "asyncckpt":
            future = ckpt._checkpoint_future
            return Saved(wait=future.result, stats=stats_of(future.handle))
        if method == "async":
            return Saved(wait=ckpt._checkpoint_future.result, fsync=path)
        return Saved(fsync=path)

    def rotate(n: int) -> None:
        if method != "asyncckpt" and n > KEEP + 1 and rank() == 0:
            shutil.rmtree(output / f"dist_epoch_{n - KEEP - 1}", ignore_errors=True)

    bench.save, bench.after = save, rotate
    try:
        _loop(bench, step)
    finally:
        if method == "asyncckpt":
            ckpt.wait_until_finished()
            bench.extra["fence_blocked_seconds"] = ckpt.fence_blocked_seconds
        dist.barrier()
        dist.destroy_process_group()
