"""One rank of a tiny Accelerate training run that saves through asyncckpt's
Accelerator (run by test_accelerate.py with the frameworks venv's python, RANK /
WORLD_SIZE / MASTER_* set). It trains an MLP with dropout on a shuffled map-style
dataset (seedable sampler), a scheduler, a registered custom object and noise drawn
from Python's and numpy's RNGs, so that a resume is bit-exact only if every one of
them is restored. Writes OUT/<tag>-r<rank>.json: the losses and digests of the final
state (weights, optimizer, scheduler, RNGs, custom object).

    accelerate_worker.py OUT TAG --steps N --every K [--limit L] [--kill-at S]
                         [--resume [STEP]] [--fsdp]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import sys
from pathlib import Path

import numpy as np
import torch
from accelerate import DataLoaderConfiguration
from accelerate.utils import ProjectConfiguration, set_seed

from asyncckpt.integrations.accelerate import Accelerator


class Counter:
    """A registered object (register_for_checkpointing): the training step and the
    samples seen."""

    def __init__(self) -> None:
        self.step = self.seen = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.seen = state["step"], state["seen"]


def digest(value: object) -> str:
    h = hashlib.sha256()

    def feed(v: object) -> None:
        if isinstance(v, torch.Tensor):
            t = v.full_tensor() if hasattr(v, "full_tensor") else v
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                h.update(repr(k).encode())
                feed(v[k])
        elif isinstance(v, (list, tuple)):
            for x in v:
                feed(x)
        elif isinstance(v, np.ndarray):
            h.update(v.tobytes())
        else:
            h.update(repr(v).encode())
    feed(value)
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("tag")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, required=True)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--resume", nargs="?", const=-1, type=int, default=None)
    p.add_argument("--fsdp", action="store_true")
    a = p.parse_args()
    out = Path(a.out)
    kwargs = {}
    if a.fsdp:
        from accelerate.utils import FullyShardedDataParallelPlugin
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(fsdp_version=2)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(out / "project"), automatic_checkpoint_naming=True,
        total_limit=a.limit), dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        **kwargs)
    if a.fsdp:  # Accelerate 1.16 ignores the FSDP plugin on CPU (state.py: GPU types
        # only) and runs DDP; set here, its own FSDP2 prepare (fully_shard) runs on gloo
        from accelerate import DistributedType
        acc.state.distributed_type = DistributedType.FSDP
        acc.state.fsdp_plugin = kwargs["fsdp_plugin"]
    set_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.ReLU(),
                                torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g),
                                          torch.randn(32, 1, generator=g))
    # its own generator: a DataLoader without one draws each epoch's base seed from the
    # global RNG, so a resume mid-epoch (which opens that epoch again) would shift it
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True,
                                         generator=torch.Generator().manual_seed(5))
    model, optimizer, scheduler, loader = acc.prepare(model, optimizer, scheduler, loader)
    prepared_as = str(acc.distributed_type)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    per_epoch = len(loader)
    restored = None
    if a.resume is not None:
        restored = acc.load_state(step=None if a.resume < 0 else a.resume)
    step = resumed_from = counter.step
    losses: dict[int, float] = {}
    while step < a.steps:
        epoch, skip = divmod(step, per_epoch)
        loader.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if i < skip:
                continue
            step += 1
            noise = float(np.random.rand()) + random.random()
            loss = torch.nn.functional.mse_loss(model(x + 0.01 * noise), y)
            acc.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            counter.seen += x.shape[0]
            counter.step = step
            losses[step] = loss.item()
            if step % a.every == 0:
                acc.save_state()
                writer = acc.asyncckpt().writer  # rank 0 started the node's writer
                if writer is not None and not (out / f"{a.tag}.writer-pid").exists():
                    (out / f"{a.tag}.writer-pid").write_text(str(writer.pid))
                if step == a.kill_at and acc.process_index == 1:
                    os.kill(os.getpid(), signal.SIGKILL)  # mid-save: its part unsent
            if step == a.steps:
                break
    acc.wait_for_checkpoints()
    inner = optimizer.optimizer
    final = {
        "model": digest(model.state_dict()),
        "optimizer": digest(inner.state_dict()),
        "scheduler": digest(scheduler.state_dict()),
        "rng": digest([torch.get_rng_state(), np.random.get_state()[1], random.getstate()]),
        "counter": counter.seen,
        "accelerator_step": acc.step,
    }
    result = {"from": resumed_from, "restored": restored,
              "losses": {str(k): v for k, v in losses.items()}, "final": final,
              "iteration": acc.save_iteration,
              "distributed_type": prepared_as,
              "dtensor": any(hasattr(p_, "full_tensor") for p_ in model.parameters())}
    (out / f"{a.tag}-r{acc.process_index}.json").write_text(json.dumps(result))
    acc.end_training()
    print(f"OK rank {acc.process_index}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
