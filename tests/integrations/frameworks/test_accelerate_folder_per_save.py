"""`save_state(f"step_{n}")`, a folder per save as Accelerate's examples write it,
against asyncckpt's Accelerator (the real Accelerate, one CPU process, in the frameworks
venv). Each folder is a root of its own; each root's checkpointer holds a writer process
and a ring as large as the state. Kept open until `end_training`, a run saving every N
steps would start a writer and map a ring per save (R5-6: 6 saves, 6 writers, RSS up
by a ring each): the process runs out of memory on a real model. Every folder must
still hold its step and load back."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from frameworks_venv import FRAMEWORKS_PYTHON, needs_frameworks

REPO = Path(__file__).parents[3]
pytestmark = needs_frameworks
SAVES = 6

FOLDER_PER_SAVE = r'''
import json, os, sys
import psutil, torch
from asyncckpt.integrations.accelerate import Accelerator

out, saves = sys.argv[1], int(sys.argv[2])
acc = Accelerator(cpu=True)
model = torch.nn.Linear(64, 64)
model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
writers = []
for n in range(saves):
    with torch.no_grad():
        model.weight.fill_(float(n))
    acc.save_state(os.path.join(out, f"step_{n}")).wait_staged()
    writers.append(len(psutil.Process().children(recursive=True)))
loaded = []
for n in range(saves):
    restored = acc.load_state(os.path.join(out, f"step_{n}"))
    loaded.append([restored, model.weight[0, 0].item()])
acc.end_training()
print("RESULT " + json.dumps({"writers": writers, "loaded": loaded,
                              "left": len(psutil.Process().children(recursive=True))}),
      flush=True)
'''


def test_a_folder_per_save_keeps_a_bounded_number_of_writers(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run([FRAMEWORKS_PYTHON, "-c", FOLDER_PER_SAVE, str(tmp_path),
                          str(SAVES)], env=env, text=True, capture_output=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(run.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert max(result["writers"]) <= 2, result["writers"]  # not one per folder
    assert result["loaded"] == [[n, float(n)] for n in range(SAVES)]  # each folder: its save
    assert result["left"] == 0
