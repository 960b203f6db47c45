"""`trainer.test(ckpt_path="best")` after a fit whose ModelCheckpoint keeps the top 1 by a
monitored metric, with AsyncckptCheckpointIO against Lightning's own IO in the same
script (the real Lightning, one device, the frameworks venv): the best file named, the
files left, and the weights the test loads must be the same."""

from __future__ import annotations

import pytest
from frameworks_venv import needs_frameworks, script_result

pytestmark = [pytest.mark.process, needs_frameworks]

SCRIPT = r'''
import json, sys
from pathlib import Path
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from asyncckpt.integrations.lightning import AsyncckptCheckpointIO
from asyncckpt.storage.location import storage_for


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, i):  # best at epoch 1 of 0..4, then four newer saves
        self.log("score", float(abs(self.current_epoch - 1)))

    def test_step(self, batch, i):
        self.log("w", self.net.weight.sum().item())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


result = {}
for kind in ("plain", "ours"):
    out = Path(sys.argv[1]) / kind
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    kept = ModelCheckpoint(dirpath=out / "ckpts", monitor="score", mode="min", save_top_k=1,
                           save_last=True)
    trainer = pl.Trainer(max_epochs=5, accelerator="cpu", devices=1, callbacks=[kept],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         plugins=[AsyncckptCheckpointIO(out / "root")] if kind == "ours"
                         else None)
    model = Net()
    trainer.fit(model, data, data)
    final = model.net.weight.sum().item()
    tested = trainer.test(model, data, ckpt_path="best", verbose=False)[0]["w"]
    result[kind] = {"best": Path(kept.best_model_path).name, "tested": tested, "final": final,
                    "files": sorted(p.name for p in (out / "ckpts").iterdir())}
    if kind == "ours":
        result["steps"] = storage_for(out / "root").committed_steps()
print("RESULT " + json.dumps(result))
'''


def test_test_with_the_best_checkpoint_loads_what_lightnings_own_io_loads(tmp_path):
    result = script_result(SCRIPT, str(tmp_path))
    plain, ours = result["plain"], result["ours"]
    assert plain["best"] == "epoch=1-step=8.ckpt"
    assert ours == plain, (ours, plain)
    assert ours["tested"] != ours["final"]  # the best's weights, not the last epoch's
    assert len(result["steps"]) == 2  # the best's step and last.ckpt's: no other kept
