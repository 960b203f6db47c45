"""A Lightning run started from ANOTHER run's checkpoint (a branch: fine-tuning run B
from run A's epoch 1, in its own directory), with AsyncckptCheckpointIO, against the
real Lightning (one CPU process, in the frameworks venv).

Lightning's own IO reads A's file and writes B's checkpoints in B's directory; A is
never touched. R5-7: the IO took the loaded marker's root as its own, so B's steps went
into A's root carrying a timeline forked at A's epoch 1: A's newer steps were abandoned
by another run (A's own `last.ckpt` then names a step of an abandoned history), and B's
markers named steps that live in A's directory. Read there, save here."""

from __future__ import annotations

from pathlib import Path

from frameworks_venv import needs_frameworks, script_result

REPO = Path(__file__).parents[3]
pytestmark = needs_frameworks

BRANCH = r'''
import json, sys
from pathlib import Path
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from asyncckpt.integrations.lightning import AsyncckptCheckpointIO, read_marker
from asyncckpt.read.resolve import current_timeline


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(run, epochs, ckpt_path=None):
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1,
                         plugins=[AsyncckptCheckpointIO()],
                         callbacks=[ModelCheckpoint(dirpath=run / "ckpts", save_top_k=-1,
                                                    save_last=True)],
                         logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(Net(), data, ckpt_path=ckpt_path)


def loaded(run):
    return {p.name: AsyncckptCheckpointIO().load_checkpoint(p)["global_step"]
            for p in sorted((run / "ckpts").glob("*.ckpt"))}


out = Path(sys.argv[1])
a, b = out / "a", out / "b"
fit(a, 4)
before = loaded(a), current_timeline(a / "ckpts" / "asyncckpt").gen
(b / "ckpts").mkdir(parents=True)  # B's folder there already (a log beside it, say)
fit(b, 3, ckpt_path=str(a / "ckpts" / "epoch=1-step=8.ckpt"))
after = loaded(a), current_timeline(a / "ckpts" / "asyncckpt").gen
roots = sorted({str(read_marker(p)[0].relative_to(out)) for p in (b / "ckpts").glob("*.ckpt")})
print("RESULT " + json.dumps({"before": before, "after": after, "b_roots": roots,
                              "b": loaded(b)}), flush=True)
'''


def test_a_branch_from_another_runs_checkpoint_leaves_that_run_alone(tmp_path: Path) -> None:
    result = script_result(BRANCH, str(tmp_path))
    assert result["after"] == result["before"]  # A: same files, same steps, same timeline
    assert result["b_roots"] == ["b/ckpts/asyncckpt"]  # B's steps in B's directory
    assert result["b"]["last.ckpt"] == 12  # B resumed at A's step 8, trained epoch 2
