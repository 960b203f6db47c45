"""An adapter-only (PEFT) checkpoint resumed onto another base of the same architecture,
with AsyncCheckpointTrainer and the real transformers Trainer and peft (one process,
hf_trainer_worker.py's tiny GPT-2 with LoRA, in the frameworks venv).

The adapter-only step stores the LoRA weights and references the frozen base by its
name and a fingerprint. R5-8: a fingerprint of the frozen tensors' names and shapes
alone passes any base of the same architecture (a base and its instruct variant, two
checkpoints of one pre-training run), so the resume trains the adapter on weights it
was not trained on, silently. The resume must refuse a base whose frozen values
differ."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from frameworks_venv import needs_frameworks
from test_hf_trainer import launch_script

pytestmark = [pytest.mark.process, needs_frameworks]

OTHER_BASE = r'''
import json, pathlib, sys
import torch
sys.path.insert(0, sys.argv[2])
import hf_trainer_worker as w

out = pathlib.Path(sys.argv[1])
w.run({"out": str(out), "max_steps": 2, "save_steps": 2, "peft": True})
built = w.model


def other_base(peft):  # the same architecture, other frozen weights
    net = built(peft)
    with torch.no_grad():
        for p in net.parameters():
            if not p.requires_grad:
                p.mul_(1.01)
    return net


w.model = other_base
try:
    w.run({"out": str(out), "max_steps": 4, "save_steps": 2, "peft": True,
           "resume": str(out / "checkpoint-2")})
    print("RESULT " + json.dumps({"resumed": True}), flush=True)
except Exception as e:
    print("RESULT " + json.dumps({"error": type(e).__name__, "text": str(e)}), flush=True)
'''


def test_an_adapter_resumed_onto_another_base_of_the_same_shapes_is_refused(
        tmp_path: Path) -> None:
    done = launch_script(OTHER_BASE, str(tmp_path / "run"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result.get("error") == "StateMismatchError", result
    assert "frozen base" in result["text"]
