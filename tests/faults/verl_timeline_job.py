"""One run of a verl job on one rank (gloo, CPU) through the asyncckpt drop-in, for
test_verl_timeline.py. Its model holds a value per (history, step): `old` for the run
later abandoned, `new` for the one resumed from an older step.

    python verl_timeline_job.py DIR old                 save 1..3, then hand 4, die saving it
    python verl_timeline_job.py DIR resume AT KILL      load AT, save AT+1.. and die
                                                        after handing step KILL (with
                                                        the writer armed: once it died)
    python verl_timeline_job.py DIR tracker             load the step the tracker names,
                                                        save the new history up to 4

Each prints `LOADED <step> <history>` for what it loaded (checked bit for bit against
both histories), and dies by SIGKILL (`old`, `resume`) as a killed job does: its writer
finishes what it holds and exits. ASYNCCKPT_CRASH_AT in the environment arms the writer.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from asyncckpt.integrations import verl

LAST = 4


def weights(history: str, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed((1000 if history == "new" else 0) + step)
    return {"weight": torch.randn(48, 48, generator=g), "bias": torch.randn(48, generator=g)}


class Assign(torch.optim.Optimizer):
    """An optimizer whose step sets the weights to `target`: the job changes them only
    by `optimizer.step()`, as a trainer does, which the drop-in's fence holds while an
    async save stages them."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model.parameters(), {})
        self.model = model
        self.target: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        for name, value in self.target.items():
            getattr(self.model, name).copy_(value)


def model_at(model: torch.nn.Module, optim: Assign, history: str, step: int) -> None:
    optim.target = weights(history, step)
    optim.step()


def which(model: torch.nn.Module, step: int) -> str:
    for history in ("old", "new"):
        if all(torch.equal(getattr(model, n), v) for n, v in weights(history, step).items()):
            return history
    return "neither"


def main() -> None:
    base, mode = Path(sys.argv[1]), sys.argv[2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = torch.nn.Linear(48, 48)
    optim = Assign(model)
    manager = verl.FSDPCheckpointManager(model, optim, None, checkpoint_config={
        "save_contents": ["model", "optimizer", "extra"], "async_save": True})

    def path(step: int) -> str:
        return str(base / f"global_step_{step}" / "actor")

    def save(history: str, step: int) -> None:
        model_at(model, optim, history, step)
        manager.save_checkpoint(path(step), None, step, None)

    if mode == "old":
        for step in range(1, LAST):
            save("old", step)
        manager.wait_until_finished()
        save("old", LAST)
        optim.step()  # the fence: returns once step 4 is staged, then die saving it
        os.kill(os.getpid(), signal.SIGKILL)
    at = int(sys.argv[3]) if mode == "resume" else int((base / verl.TRACKER).read_text())
    manager.load_checkpoint(path(at))
    print(f"LOADED {at} {which(model, at)}", flush=True)
    for step in range(at + 1, LAST + 1):
        save("new", step)
        if mode == "resume" and step == int(sys.argv[4]):
            if os.environ.get("ASYNCCKPT_CRASH_AT"):
                manager.wait_until_finished()  # until the writer dies at its point
            else:
                optim.step()  # once it is staged: the writer commits it after the kill
            os.kill(os.getpid(), signal.SIGKILL)
    manager.close()
    dist.destroy_process_group()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
