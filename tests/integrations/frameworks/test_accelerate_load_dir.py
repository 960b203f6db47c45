"""Accelerate's `load_state(input_dir)` naming one checkpoint, against asyncckpt's
Accelerator (the real Accelerate, one CPU process, in the frameworks venv).

Accelerate's own `load_state(input_dir)` loads the folder it is given, with
`automatic_checkpoint_naming` too (its docs resume a given checkpoint by passing
`project_dir/checkpoints/checkpoint_N`); only `load_state()` picks the newest. A
`load_state` that ignored `input_dir` would resume the newest step instead of the one
asked for: a silent wrong resume (R5-1)."""

from __future__ import annotations

from pathlib import Path

from frameworks_venv import needs_frameworks, script_result

REPO = Path(__file__).parents[3]
pytestmark = needs_frameworks

SAVE_THREE = r'''
import json, os, sys
import torch
from accelerate.utils import ProjectConfiguration
from asyncckpt.integrations.accelerate import Accelerator

out = sys.argv[1]
acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
    project_dir=out, automatic_checkpoint_naming=True))
model = torch.nn.Linear(4, 4)
model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
for value in range(3):  # steps 0, 1, 2: the weights hold the step's number
    with torch.no_grad():
        model.weight.fill_(float(value))
    acc.save_state().wait_staged()  # the next fill_ changes it in place
acc.wait_for_checkpoints()
root = os.path.join(out, "checkpoints")
result = {}
for name, asked in [("accelerate_name", os.path.join(root, "checkpoint_1")),
                    ("step_dir", os.path.join(root, "step-00000000")),
                    ("root", root), ("elsewhere", os.path.join(out, "other"))]:
    with torch.no_grad():
        model.weight.fill_(-1.0)
    try:
        step = acc.load_state(asked)
        result[name] = [step, model.weight[0, 0].item(), acc.save_iteration]
    except Exception as e:
        result[name] = type(e).__name__
acc.end_training()
print("RESULT " + json.dumps(result), flush=True)
'''


def test_load_state_of_a_named_checkpoint_restores_that_step(tmp_path: Path) -> None:
    result = script_result(SAVE_THREE, str(tmp_path))
    assert result["accelerate_name"] == [1, 1.0, 2]  # checkpoint_1: step 1, not the newest
    assert result["step_dir"] == [0, 0.0, 1]
    assert result["root"] == [2, 2.0, 3]  # the root itself: its newest step
    assert result["elsewhere"] == "ValueError"  # not this root: never its newest
