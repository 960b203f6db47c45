"""One rank (a world of one) of torchtune's CheckpointClient saving through asyncckpt's
DistributedCheckpointer while the writer is stopped (SIGSTOP): epoch 1 fills the ring
(one slot), so nothing of epoch 2, saved back to back, can be copied into it
until the writer drains epoch 1. Does the async save of epoch 2 return anyway, does the
next `optimizer.step()` wait for its copy, and does the epoch hold the state of the
call? Run by test_torchtune.py with torchtune's venv.

    torchtune_fence_worker.py OUT

Prints one JSON line: "returned" (the save returned while the writer was stopped),
"step_held" (an optimizer step then waited), "expected"/"loaded" (digests of the state
at the call and of the epoch loaded back), "fence_blocked_seconds".
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torchtune.training.checkpointing._checkpoint_client import (
    CheckpointClient,
    TrainingProgress,
)
from torchtune_worker import digest, tiny_sharded_model

from asyncckpt.integrations.torchtune import install

RETURN_TIMEOUT = 20.0  # s: the save call must return long before (old code: never)
HELD_FOR = 1.0  # s the optimizer step must still be waiting


def main() -> None:
    out = Path(sys.argv[1])
    # a ring of one slot, which the state fits in once (a small state's ring would hold
    # several: then nothing waits)
    os.environ["ASYNCCKPT_RING_SIZE"] = os.environ["ASYNCCKPT_SLOT_SIZE"] = str(4 << 20)
    dist.init_process_group("gloo")
    cfg = OmegaConf.create({"device": "cpu", "enable_async_checkpointing": True,
                            "resume_from_checkpoint": False,
                            "checkpointer": {"checkpoint_dir": str(out / "base"),
                                             "output_dir": str(out / "output")}})
    recipe = type("Recipe", (), {})()
    recipe._checkpoint_client = CheckpointClient(cfg)
    installed = install(recipe)
    client = recipe._checkpoint_client
    model, optimizer = tiny_sharded_model()

    def train_step(seed: int) -> None:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    def progress(epoch: int) -> TrainingProgress:
        return TrainingProgress(seed=0, epochs_run=epoch + 1, total_epochs=100,
                                max_steps_per_epoch=1)

    train_step(0)
    client.save_checkpoint(model, optimizer, progress(0), 0)  # starts the writer
    installed.wait_until_finished()
    train_step(1)
    expected = digest(model, optimizer)
    writer = installed._writer
    assert writer is not None
    returned = threading.Event()
    os.kill(writer.pid, signal.SIGSTOP)
    result: dict = {}
    try:
        def save_both() -> None:
            client.save_checkpoint(model, optimizer, progress(1), 1)  # fills the ring
            client.save_checkpoint(model, optimizer, progress(2), 2)
            returned.set()
        saver = threading.Thread(target=save_both)
        saver.start()
        result["returned"] = returned.wait(RETURN_TIMEOUT)
        if result["returned"]:
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
            model(x).pow(2).mean().backward()
            stepped = threading.Event()
            stepper = threading.Thread(target=lambda: (optimizer.step(), stepped.set()))
            stepper.start()
            result["step_held"] = not stepped.wait(HELD_FOR)
    finally:
        os.kill(writer.pid, signal.SIGCONT)
    saver.join()
    if result["returned"]:
        stepper.join()
    installed.wait_until_finished()
    client.load_distributed_checkpoint(model, optimizer)  # the newest epoch: 2
    result.update(expected=expected, loaded=digest(model, optimizer),
                  fence_blocked_seconds=getattr(installed, "fence_blocked_seconds", None))
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
