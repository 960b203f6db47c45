"""Attack on the verl drop-in's load of a memory step (verl.py `load_checkpoint`,
aa61112): which copy of step S it loads when the root holds a committed S too.

`load_checkpoint` loads the step verl's tracker names from the root whenever the root
has a committed step of that number (`step in reader.all_steps()`), else from the
memory tier. A root's committed S is not always the run's S: a run that resumed from
an older step abandons the root's steps above it only at its first *durable* commit,
and with `durable_interval` its next saves go to memory. Run A committed 4 and 5
(durable every step, or its writer flushed its memory 5 at stop); run B resumed from 4
with durable_interval 2 and saved 5 to memory (its tracker names 5). B's restart must
get B's 5 -- the state its tracker and data.pt describe -- not the abandoned run's.

In process, without verl: world 1 over gloo, one writer (ASYNCCKPT_ADDRESS), a linear
model and SGD.
"""

from __future__ import annotations

from pathlib import Path

import torch
from inprocess import InProcessWriter
from verl_memory_job import linear_model, verl_job_fixture  # noqa: F401 (a fixture)

from asyncckpt.checkpointer import Checkpointer, CheckpointerOptions
from asyncckpt.integrations.verl import FSDPCheckpointManager
from asyncckpt.integrations.verl_paths import root_of
from asyncckpt.read import memory


def test_a_resumed_runs_memory_step_wins_over_the_abandoned_runs_durable_one(
        verl_job: tuple[Path, InProcessWriter]) -> None:
    base, w = verl_job
    root = root_of(base / "global_step_1" / "actor")
    for step, fill in ((4, 4.0), (5, 5.0)):  # run A: steps 4 and 5 committed
        model, optim = linear_model(fill)
        ckpt = Checkpointer(root, model=model, optimizer=optim, address=w.address,
                            fence=False, options=CheckpointerOptions(save_interval=1))
        handle = ckpt.save(step, force=True)
        assert handle is not None
        handle.wait(30)
        ckpt.close()
    config = {"durable_interval": 2, "async_save": False,
              "save_contents": ["model", "optimizer", "extra"]}
    model, optim = linear_model(0.0)  # run B: resumes from 4, trains, saves 5 (memory)
    b = FSDPCheckpointManager(model=model, optimizer=optim, checkpoint_config=config)
    b.load_checkpoint(str(base / "global_step_4" / "actor"))
    assert b.restored_tier == "durable" and float(model.weight[0, 0]) == 4.0
    with torch.no_grad():
        model.weight.fill_(55.0)
    b.save_checkpoint(str(base / "global_step_5" / "actor"), global_step=5)
    b.close()
    assert [g["step"] for g in memory.generations(w.address)] == [5]  # B's 5, held
    model, optim = linear_model(0.0)  # run B restarts at its tracker's step, 5
    again = FSDPCheckpointManager(model=model, optimizer=optim, checkpoint_config=config)
    try:
        again.load_checkpoint(str(base / "global_step_5" / "actor"))
    finally:
        again.close()
    assert float(model.weight[0, 0]) == 55.0, (
        f"step 5 loaded from the {again.restored_tier} tier is run A's "
        f"(weight {float(model.weight[0, 0])}), not run B's (55.0), which its memory holds")
