"""Saves of a model with BatchNorm through the framework integrations (the real
transformers Trainer and Accelerate, one CPU process each, in the frameworks venv).

The fence holds `optimizer.step()` until a save is staged; a BatchNorm's running
statistics and `num_batches_tracked` are buffers that the next forward changes in place,
before the background copy reached them, and the save failed on its version counter
(R5-10: the HF Trainer's and Accelerate's second save of any BatchNorm model; a ResNet
could not be checkpointed). Their buffers are now cloned at the hand-over (buffers.py),
and a step holds the buffers as they were at its save. (Lightning's CheckpointIO sees no
model, only the state dict Lightning made; its loop did not reach a buffer before the
copy in any run tried here, 2 x 4096 channels included: its hazard stays documented.)"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from frameworks_venv import FRAMEWORKS_PYTHON, full_only, needs_frameworks

REPO = Path(__file__).parents[3]
pytestmark = [pytest.mark.process, needs_frameworks]

HF = r'''
import json, sys, torch
from transformers import TrainingArguments
from asyncckpt.integrations.hf_trainer import AsyncCheckpointTrainer
from asyncckpt.read.loader import load


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(512, generator=g), "labels": torch.randn(1, generator=g)}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b = (torch.nn.Linear(512, 2048), torch.nn.BatchNorm1d(2048),
                                   torch.nn.Linear(2048, 1))

    def forward(self, x, labels=None):
        y = self.b(torch.relu(self.bn(self.a(x))))
        return {"loss": torch.nn.functional.mse_loss(y, labels), "logits": y}


out = sys.argv[1]
net = Net()
args = TrainingArguments(output_dir=out, max_steps=12, save_strategy="steps", save_steps=1,
                         save_total_limit=2, per_device_train_batch_size=8, use_cpu=True,
                         report_to=[], disable_tqdm=True, logging_steps=100,
                         remove_unused_columns=False)
AsyncCheckpointTrainer(model=net, args=args, train_dataset=Data()).train()
saved = load(out + "/asyncckpt", step=12)["model"]
print("RESULT " + json.dumps({
    "same": all(torch.equal(saved[k], v) for k, v in net.state_dict().items()),
    "tracked": int(saved["bn.num_batches_tracked"])}), flush=True)
'''

ACCELERATE = r'''
import json, sys, torch
from asyncckpt.integrations.accelerate import Accelerator
from asyncckpt.read.loader import load

acc = Accelerator(cpu=True)
net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256),
                          torch.nn.Linear(256, 1))
net, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01))
at_save = {}
for step in range(12):
    loss = net(torch.randn(8, 64)).pow(2).mean()
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    acc.save_state(sys.argv[1], step=step)
    at_save[step] = {k: v.clone() for k, v in net.state_dict().items()}
acc.end_training()
same = {step: all(torch.equal(load(sys.argv[1], step=step)["model"]["0"][k], v)
                  for k, v in state.items()) for step, state in at_save.items()
        if step >= 8}
print("RESULT " + json.dumps({"same": all(same.values()), "steps": sorted(same)}), flush=True)
'''

def run(script: str, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([FRAMEWORKS_PYTHON, "-c", script, str(out)], env=env, text=True,
                          capture_output=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])


@full_only  # past make test's time budget: make test-frameworks runs it
def test_the_hf_trainer_saves_a_batchnorm_model_every_step(tmp_path: Path) -> None:
    assert run(HF, tmp_path) == {"same": True, "tracked": 12}


def test_accelerate_saves_a_batchnorm_model_every_step(tmp_path: Path) -> None:
    assert run(ACCELERATE, tmp_path) == {"same": True, "steps": [8, 9, 10, 11]}
